"""`python -m shardnorm [--model ID_OR_PATH]`: what shardnorm would run with here, for a bug report or a first check.

Prints the versions of Python, torch, Triton and the frameworks shardnorm has adapters for (read from the installed
packages' metadata, without importing them), the GPU, whether the Triton kernels load and which tensors take them,
and the `SHARDNORM_*` settings in effect. With `--model`, it also lists what `shardnorm.convert` would convert in that
Hugging Face model: the model is built from its config on the meta device, so no weights are downloaded or allocated.
"""

import argparse
import os
import platform
import sys
from collections import Counter
from importlib import metadata

import torch

import shardnorm
from shardnorm import settings, versions

FRAMEWORKS = ("transformers", "accelerate", "deepspeed", "torchtitan", "lightning")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    names = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        names.append(f"cuda:{index} {torch.cuda.get_device_name(index)} (sm_{major}{minor})")
    return "; ".join(names)


def _kernels(current: settings.Settings) -> list[tuple[str, str]]:
    """Whether the Triton kernels import, which tensors take them, and the long-row kernels of GPU 0."""
    if versions.installed_triton() is None:
        return [("Triton kernels", "Triton is not installed: every call takes the torch reference")]
    try:
        from shardnorm import kernels  # noqa: F401 (the import is the check)
        from shardnorm.kernels import config
    except Exception as e:  # noqa: BLE001 (any failure to load is what the report is for)
        return [("Triton kernels", f"fail to load ({type(e).__name__}: {e}): every call takes the torch reference")]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if current.backend == "torch":
        who = "none: SHARDNORM_BACKEND=torch sends every call to the torch reference"
    elif current.backend == "triton":
        who = "every tensor (SHARDNORM_BACKEND=triton)" + (
            "; CPU tensors interpreted (TRITON_INTERPRET=1)" if interpreted else "; CPU tensors need TRITON_INTERPRET=1")
    else:
        who = "CUDA tensors; other tensors take the torch reference (SHARDNORM_BACKEND unset)"
    rows = [("Triton kernels", "load"), ("kernels run for", who)]
    if torch.cuda.is_available():
        family = config.specialized(torch.device("cuda", 0))
        reason = " (SHARDNORM_PORTABLE_KERNELS=1)" if current.portable_kernels else ""
        rows.append(("long rows on cuda:0", f"{family} kernels" if family else f"portable kernels{reason}"))
    return rows


def environment() -> list[tuple[str, str]]:
    rows = [("shardnorm", f"{shardnorm.__version__} ({os.path.dirname(shardnorm.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", torch.__version__ + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")),
            ("triton", versions.installed_triton() or "not installed")]
    rows += [(name, _version(name)) for name in FRAMEWORKS]
    rows.append(("GPU", _gpu()))
    try:
        current = settings.get()
    except ValueError as e:
        return rows + [("settings", f"error: {e}")]
    for name in ("SHARDNORM_BACKEND", "SHARDNORM_PORTABLE_KERNELS"):
        rows.append((name, os.environ.get(name) or "unset"))
    rows.append(("settings in effect", f"backend={current.backend or 'by device'}, "
                                       f"portable_kernels={current.portable_kernels}"))
    return rows + _kernels(current)


class NoModelReport(Exception):
    """`--model` names nothing that can be reported on: the report's row says why, and the command exits 1."""


def model_report(model_id: str) -> list[tuple[str, str]]:
    """What `shardnorm.convert` would convert in the Hugging Face model `model_id` (a hub id or a local dir)."""
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        raise NoModelReport("transformers is not installed (pip install 'shardnorm[hf]')") from None
    import transformers

    try:
        config = AutoConfig.from_pretrained(model_id)  # a hub id downloads config.json alone
    except (OSError, ValueError) as error:
        raise NoModelReport(f"{model_id}: no model config could be read ({type(error).__name__}: {error})") from None
    # the class the checkpoint names (an encoder-decoder's conditional generation model, a multimodal one), else
    # a causal LM, else the bare model
    named = [getattr(transformers, name, None) for name in (getattr(config, "architectures", None) or [])]
    with torch.device("meta"):  # the structure without weights: no memory, no download
        if named and named[0] is not None:
            model = named[0](config)
        else:
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:  # not a causal LM (an encoder, a seq2seq model)
                model = AutoModel.from_config(config)
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    result = shardnorm.convert(model, warn=False)
    converted = Counter(classes[name] for name in result.converted)
    rows = [("model", f"{model_id}: {type(model).__name__}"),
            ("convert would convert", f"{result.count} norm module(s)"
             + (": " + ", ".join(f"{cls} x{n}" for cls, n in converted.items()) if converted else ""))]
    skipped = Counter((s.cls, s.reason) for s in result.skipped)
    rows.append(("and leave alone", f"{len(result.skipped)} norm-like module(s)" + "".join(
        f"\n    {cls} x{n}: {reason}" for (cls, reason), n in skipped.items())))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Prints the report; exit status 1 where `--model` could not be reported on (a script checking a model id
    learns it from the status, as from the report's row)."""
    parser = argparse.ArgumentParser(prog="python -m shardnorm", description=__doc__.split("\n")[0])
    parser.add_argument("--model", metavar="ID_OR_PATH",
                        help="a Hugging Face model id or local directory: list what shardnorm.convert would convert")
    args = parser.parse_args(argv)
    rows, status = environment(), 0
    if args.model:
        try:
            rows += model_report(args.model)
        except NoModelReport as error:
            rows, status = rows + [("model", str(error))], 1
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return status


if __name__ == "__main__":
    sys.exit(main())
