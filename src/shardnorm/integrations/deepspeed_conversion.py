"""Swap a model's norms for shardnorm's as the "shardnorm" section asks."""

import contextlib
import warnings

import torch

from ..conversion import convert
from ..modules import LayerNorm, RMSNorm
from .deepspeed_config import ShardnormSection


def shardnorm_modules(model: torch.nn.Module) -> list:
    return [m for _, m in named_shardnorm_modules(model)]


def named_shardnorm_modules(model: torch.nn.Module) -> list:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LayerNorm, RMSNorm))]


def _gathered(param: torch.nn.Parameter):
    """A context in which a ZeRO-3 partitioned parameter (built under zero.Init) is whole."""
    if hasattr(param, "ds_id"):
        from deepspeed.runtime.zero import GatheredParameters

        return GatheredParameters([param], modifier_rank=0)
    return torch.no_grad()


def _zero_center(name: str, module: torch.nn.Module) -> bool:
    """Store the scale as weight - 1 so the module computes the same function zero-centered; False when
    it already was (Gemma-style norms convert zero-centered with their stored weight unchanged)."""
    if module.zero_centered_gamma:
        return False
    if module.weight is not None:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_gathered(module.weight))
            except Exception as e:  # noqa: BLE001 - DeepSpeed's own errors say little about which module
                raise RuntimeError(
                    f"shardnorm: could not gather the ZeRO-3 parameter {name or type(module).__name__}.weight (full "
                    f"shape {tuple(getattr(module.weight, 'ds_shape', module.weight.shape))}) to store it as weight - 1 "
                    f"for zero_centered_gamma: {type(e).__name__}: {e}. Convert after deepspeed.initialize / zero.Init "
                    f"have set it up (torch.distributed initialized), or set \"zero_centered_gamma\": false") from e
            with torch.no_grad():
                module.weight.sub_(1)
    module.zero_centered_gamma = True
    return module.weight is not None


def convert_norms(model: torch.nn.Module, section: ShardnormSection) -> tuple[torch.nn.Module, int]:
    """Convert the classes named in `section.replace` (all known norms when unset). Returns (model, count)."""
    model, count = convert(model, classes=section.replace, keep_output=section.keep_output)
    if section.zero_centered_gamma:
        shifted = sum(_zero_center(name, module) for name, module in named_shardnorm_modules(model))
        if shifted and hasattr(model, "save_pretrained"):
            warnings.warn(f"shardnorm.zero_centered_gamma stored {shifted} norm weights of {type(model).__name__} "
                          "as weight - 1: its state_dict and save_pretrained checkpoints are no longer plain Hugging "
                          "Face checkpoints (set zero_centered_gamma to false to keep them)", stacklevel=3)
    return model, count
