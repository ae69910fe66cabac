"""Every ```python block of README.md and docs/ runs on CPU, as a reader would paste it.

The blocks are read from the markdown at collection time (whatever exists then), each run in a fresh namespace
from `tests/docs_prelude.py` (the placeholders: `x`, `model`, `path`, ...). An HTML comment on the line before a
fence changes how it runs:

- `<!-- docs-test: ranks=2 -->`: in 2 processes (gloo), with `world_size`, `dp` = 1, `tp` = 2 and `mesh` (2-D,
  dims ("dp", "tp")) bound; `ranks=2 dp=2` makes dp = 2, tp = 1;
- `<!-- docs-test: gpu REASON -->`: run on a GPU as written (no placeholders moved to the CPU), skipped where there
  is none; only where running is impossible on CPU (REASON must say why);
- `<!-- docs-test: skip REASON -->`: not run; only where running is impossible on any host here (REASON must say why).

shardnorm's warnings that a `keep_output=False` norm keeps its output after all (outside a converted model's forward,
or a gathered output without `RegatherColwiseParallel` consumers) fail the example: the recipes must act as written.

`path` (a tiny Qwen3 saved with save_pretrained, one copy the ranks share), `trainer` and token-dict
`micro_batches` are bound only where the block needs them (`docs_prelude.lazy_names`). The examples run in a
temporary directory holding a link to configs/.
"""

import contextlib
import re
import warnings
from pathlib import Path

import pytest
import torch

import docs_prelude
import optional_packages
from spawn_ranks import DEVICE, spawn

OPTIONAL_PACKAGES = ("torchtitan", "lightning", "deepspeed", "liger_kernel")

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^( *)```python\s*$")


def python_blocks(text: str) -> list:
    """[(line number, marker or "", code)] of the ```python fences in `text` (indented fences de-indented)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence.group(1)), i
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(previous)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        blocks.append((start + 1, marker.group(1) if marker else "", "\n".join(body) + "\n"))
        i += 1
    return blocks


def _examples() -> list:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    params = []
    for md in files:
        for line, marker, code in python_blocks(md.read_text()):
            name = f"{md.relative_to(ROOT)}:{line}"
            marks = []
            if marker.startswith("skip"):
                reason = marker[len("skip"):].strip()
                assert reason, f"{name}: a docs-test skip marker must give its reason"
                marks.append(pytest.mark.skip(reason=reason))
            elif marker.startswith("gpu"):
                reason = marker[len("gpu"):].strip()
                assert reason, f"{name}: a docs-test gpu marker must give its reason"
                marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason=reason))
            elif marker.startswith("ranks="):
                marks.append(pytest.mark.distributed)
            params.append(pytest.param(name, marker, code, id=name, marks=marks))
    return params


def test_marker_parsing():
    text = "intro\n\n<!-- docs-test: ranks=2 -->\n```python\na = 1\n```\n  ```python\n  b = 2\n  ```\n"
    assert python_blocks(text) == [(4, "ranks=2", "a = 1\n"), (7, "", "b = 2\n")]
    assert ranked_options("ranks=2") == {"ranks": 2, "dp": 1}
    assert ranked_options("ranks=4 dp=2") == {"ranks": 4, "dp": 2}
    with pytest.raises(AssertionError, match="unknown docs-test options"):
        ranked_options("ranks=2 pp=2")


def _namespace(root: str, code: str, seed: int) -> dict:
    return {**docs_prelude.namespace(root, seed), **docs_prelude.lazy_names(code, root)}


def _run(code: str, name: str, names: dict, on_gpu: bool = False) -> None:
    with warnings.catch_warnings(), (contextlib.nullcontext() if on_gpu else docs_prelude.cuda_as_cpu()):
        warnings.simplefilter("ignore")
        # an example whose keep_output=False would not act as written (a norm outside a converted model's forward,
        # a gathered output without RegatherColwiseParallel consumers) fails instead of keeping the outputs silently
        warnings.filterwarnings("error", message=r"shardnorm: .* has keep_output=False", category=UserWarning)
        exec(compile(code, name, "exec"), names)


def ranked_options(marker: str) -> dict:
    """`ranks=N [dp=D]` -> {"ranks": N, "dp": D} (D defaults to 1 and must divide N)."""
    options = dict(option.split("=", 1) for option in marker.split())
    assert set(options) <= {"ranks", "dp"}, f"unknown docs-test options in {marker!r}"
    ranks, dp = int(options["ranks"]), int(options.get("dp", 1))
    assert ranks % dp == 0, f"docs-test: dp={dp} does not divide ranks={ranks}"
    return {"ranks": ranks, "dp": dp}


def _ranked_body(rank, world_size, root, name, code, dp):
    from torch.distributed.device_mesh import init_device_mesh

    if "deepspeed" in code.lower():
        from deepspeed_harness import use_test_device

        use_test_device(rank)
    # the checkpoint `path` is shared: the test wrote it before the spawn (save_pretrained writes on rank 0 only)
    names = {**docs_prelude.namespace(f"{root}/rank{rank}", seed=0), **docs_prelude.lazy_names(code, root)}
    tp = world_size // dp
    names.update(mesh=init_device_mesh(DEVICE, (dp, tp), mesh_dim_names=("dp", "tp")), world_size=world_size,
                 dp=dp, tp=tp)
    _run(code, name, names)


@pytest.mark.parametrize("name, marker, code", _examples())
def test_docs_example_runs(name, marker, code, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the examples name configs/ relative to the checkout
    monkeypatch.chdir(tmp_path)
    for package in OPTIONAL_PACKAGES:  # the GPU image lacks some of the extras the CPU environment pins
        if re.search(rf"^\s*(from|import) {package}\b", code, re.M):
            optional_packages.importorskip(package)
    if marker.startswith("ranks="):
        if torch.cuda.is_available():  # the libraries in the examples (Lightning, HF tp_plan) would take the GPUs
            pytest.skip("the prelude's placeholders are CPU objects (cuda_as_cpu): the ranked examples run on gloo "
                        "on a CPU-only host")
        options = ranked_options(marker)
        if docs_prelude.uses_path(code):
            docs_prelude.tiny_hf_model_dir(str(tmp_path))
        spawn(_ranked_body, options["ranks"], str(tmp_path), name, code, options["dp"])
    else:
        assert not marker or marker.startswith("gpu"), f"{name}: unknown docs-test marker {marker!r}"
        print(f"seed 0: {name}")
        _run(code, name, _namespace(str(tmp_path), code, seed=0), on_gpu=bool(marker))
    if not torch.cuda.is_available():
        torch.set_default_device(None)
