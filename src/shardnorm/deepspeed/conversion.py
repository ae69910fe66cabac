"""Swap a model's norms for shardnorm's as the "shardnorm" section asks."""

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


def _zero_center(module: torch.nn.Module) -> None:
    """Store the scale as weight - 1 so the module computes the same function zero-centered."""
    if module.weight is not None and not module.zero_centered_gamma:
        with _gathered(module.weight), torch.no_grad():
            module.weight.sub_(1)
    module.zero_centered_gamma = True


def convert_norms(model: torch.nn.Module, section: ShardnormSection) -> tuple[torch.nn.Module, int]:
    """Convert the classes named in `section.replace` (all known norms when unset). Returns (model, count)."""
    model, count = convert(model, classes=section.replace)
    if section.zero_centered_gamma:
        for module in shardnorm_modules(model):
            _zero_center(module)
    return model, count
