"""shardnorm: fused Triton LayerNorm / RMSNorm for distributed training."""

from . import versions as _versions

_versions.check_installed()  # an unsupported torch or Triton stops here, named, before anything uses it

from .conversion import convert  # noqa: E402
from .functional import add_layer_norm, add_rms_norm, layer_norm, rms_norm  # noqa: E402
from .modules import LayerNorm, RMSNorm  # noqa: E402

__all__ = ["LayerNorm", "RMSNorm", "accumulate", "add_layer_norm", "add_rms_norm", "convert", "discard_pending",
           "finalize_grads", "layer_norm", "rms_norm"]
__version__ = "1.0.0"


def __getattr__(name):
    """The distributed pieces load lazily (torch.distributed.tensor takes ~1 s to import):
    `shardnorm.accumulate` / `finalize_grads` / `discard_pending`, and the `distributed` and `fsdp` modules."""
    if name in ("accumulate", "discard_pending", "finalize_grads"):
        from .distributed import accumulation

        return getattr(accumulation, name)
    if name in ("distributed", "fsdp"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardnorm' has no attribute {name!r}")
