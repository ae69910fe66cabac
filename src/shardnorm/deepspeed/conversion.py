"""Swap a model's norms for shardnorm's as the "shardnorm" section asks."""

import warnings

import torch

from ..convert import convert
from ..modules import LayerNorm, RMSNorm
from .config import ShardnormSection


def shardnorm_modules(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]


def _gathered(param: torch.nn.Parameter):
    """A context in which a ZeRO-3 partitioned parameter (built under zero.Init) is whole."""
    if hasattr(param, "ds_id"):
        from deepspeed.runtime.zero import GatheredParameters

        return GatheredParameters([param], modifier_rank=0)
    return torch.no_grad()


def _zero_center(module: torch.nn.Module) -> bool:
    """Store the scale as weight - 1 so the module computes the same function zero-centered; False when
    it already was (Gemma-style norms convert zero-centered with their stored weight unchanged)."""
    if module.zero_centered_gamma:
        return False
    if module.weight is not None:
        with _gathered(module.weight), torch.no_grad():
            module.weight.sub_(1)
    module.zero_centered_gamma = True
    return module.weight is not None


def convert_norms(model: torch.nn.Module, section: ShardnormSection) -> tuple[torch.nn.Module, int]:
    """Convert the classes named in `section.replace` (all known norms when unset). Returns (model, count)."""
    model, count = convert(model, classes=section.replace)
    if section.zero_centered_gamma:
        shifted = sum(_zero_center(module) for module in shardnorm_modules(model))
        if shifted and hasattr(model, "save_pretrained"):
            warnings.warn(f"shardnorm.zero_centered_gamma stored {shifted} norm weights of {type(model).__name__} "
                          "as weight - 1: its state_dict and save_pretrained checkpoints are no longer plain Hugging "
                          "Face checkpoints (set zero_centered_gamma to false to keep them)", stacklevel=3)
    return model, count
