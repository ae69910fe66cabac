"""The Hugging Face decoders that bench_hf_models times, and the norms each variant puts in them.

Llama, Qwen3 (per-head q/k norms) and Gemma (scale 1 + weight), random weights (seeded), norm weights moved off their
init (+ N(0, 0.2)) so that a scale error shows. Variants: the model's own norms (`native`), `shardnorm.convert`
(`shardnorm`), the same with `keep_output=False` (`shardnorm_discard`: the norm outputs recomputed in the backward
instead of kept), and Liger's norm patch (`liger`): `apply_liger_kernel_to_<arch>(model=..., rms_norm=True,
everything else False)`, falling back to swapping each norm for a `LigerRMSNorm` holding the same weight (the row's
notes say which).
"""

import importlib
import inspect

import torch

ARCHS = {
    "llama": dict(model_type="llama", liger="apply_liger_kernel_to_llama", offset=0.0, casting="llama"),
    "qwen3": dict(model_type="qwen3", liger="apply_liger_kernel_to_qwen3", offset=0.0, casting="llama"),
    "gemma": dict(model_type="gemma", liger="apply_liger_kernel_to_gemma", offset=1.0, casting="gemma"),
}
SHAPE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
SMOKE_SHAPE = dict(SHAPE, vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)  # the code paths on a CPU, in seconds


def build(arch: str, layers: int, shape: dict, device: str):
    import transformers

    config = transformers.AutoConfig.for_model(ARCHS[arch]["model_type"], **dict(shape, num_hidden_layers=layers))
    if config.head_dim != shape["head_dim"]:
        raise RuntimeError(f"{arch}: head_dim {config.head_dim}, expected {shape['head_dim']}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, 0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype))
    return model.train()


def norm_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if "norm" in n}


def _shardnorm(keep_output: bool):
    def patch(model, arch):
        import shardnorm

        result = shardnorm.convert(model, keep_output=keep_output)
        if result.skipped:
            raise RuntimeError(f"shardnorm.convert left norms alone: {result.skipped}")
        return result.model, f"{result.count} norms converted, keep_output={keep_output}"

    return patch


def _liger_swap(model, arch) -> int:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    spec, count = ARCHS[arch], 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and not type(child).__name__.startswith("Liger"):
                eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
                new = LigerRMSNorm(child.weight.shape[0], eps=eps, offset=spec["offset"], casting_mode=spec["casting"],
                                   init_fn="zeros" if spec["offset"] else "ones", in_place=False)
                new.weight = child.weight
                setattr(parent, name, new)
                count += 1
    return count


def _liger(model, arch):
    import liger_kernel.transformers as lt

    fn = getattr(lt, ARCHS[arch]["liger"], None)
    notes = []
    if fn is not None:
        params = inspect.signature(fn).parameters
        kwargs = {k: False for k, v in params.items() if isinstance(v.default, bool)}
        kwargs["rms_norm"] = True
        if "model" in params:
            try:
                fn(model=model, **kwargs)
                patched = sum(type(m).__name__.startswith("Liger") or ("forward" in m.__dict__ and "norm" in n)
                              for n, m in model.named_modules())
                expected = sum(1 for n, _ in model.named_modules() if n.endswith("norm"))
                if patched == expected:
                    return model, f"{fn.__name__}(model=..., {', '.join(f'{k}={v}' for k, v in kwargs.items())}): " \
                                  f"{patched} norms"
                notes.append(f"{fn.__name__} patched {patched} of {expected} norms")
            except Exception as e:  # noqa: BLE001 - fall back to the module swap below
                notes.append(f"{fn.__name__} failed: {type(e).__name__}: {e}")
    count = _liger_swap(model, arch)
    return model, "; ".join(notes + [f"LigerRMSNorm module swap: {count} norms"])


PATCHES = {"native": lambda model, arch: (model, "the model's own norms"), "shardnorm": _shardnorm(True),
           "shardnorm_discard": _shardnorm(False), "liger": _liger}


class restore_module_globals:
    """Liger's apply_* also rebinds names in the modeling module (e.g. LlamaRMSNorm = LigerRMSNorm), which would
    change every model built after it: put them back when the case ends."""

    def __init__(self, arch):
        t = ARCHS[arch]["model_type"]
        self.module = importlib.import_module(f"transformers.models.{t}.modeling_{t}")

    def __enter__(self):
        self.saved = dict(vars(self.module))

    def __exit__(self, *exc):
        for k in list(vars(self.module)):
            if k not in self.saved:
                delattr(self.module, k)
        for k, v in self.saved.items():
            setattr(self.module, k, v)
