"""Swap a model's norms for shardnorm's as the "shardnorm" section asks.

Everything that can refuse is checked before the model changes, so an error leaves the model as it was.
"""

import contextlib
import warnings

import torch

from ..conversion import convert, convertible
from ..modules import LayerNorm, RMSNorm
from .deepspeed_config import ShardnormConfigError, ShardnormSection


def shardnorm_modules(model: torch.nn.Module) -> list:
    return [m for _, m in named_shardnorm_modules(model)]


def named_shardnorm_modules(model: torch.nn.Module) -> list:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LayerNorm, RMSNorm))]


def planned_norms(model: torch.nn.Module, section: ShardnormSection) -> list:
    """(name, module) of every shardnorm norm `convert_norms` leaves in `model`: the ones already there and the
    replacements it would install (sharing the Parameters); `model` is untouched."""
    return named_shardnorm_modules(model) + convertible(model, section.replace)


@contextlib.contextmanager
def _whole(name: str, module: torch.nn.Module, modify: bool):
    """`module.weight`, gathered where ZeRO-3 partitioned it (built under zero.Init), with grad mode off."""
    with contextlib.ExitStack() as stack:
        try:
            if hasattr(module.weight, "ds_id"):
                from deepspeed.runtime.zero import GatheredParameters

                stack.enter_context(GatheredParameters([module.weight], modifier_rank=0 if modify else None))
        except Exception as e:  # noqa: BLE001 - DeepSpeed's own errors say little about which module
            raise RuntimeError(
                f"shardnorm: could not gather the ZeRO-3 parameter {name or type(module).__name__}.weight (full "
                f"shape {tuple(getattr(module.weight, 'ds_shape', module.weight.shape))}) to store it as weight - 1 "
                f"for zero_centered_gamma: {type(e).__name__}: {e}. Convert after deepspeed.initialize / zero.Init "
                f"have set it up (torch.distributed initialized), or set \"zero_centered_gamma\": false") from e
        with torch.no_grad():
            yield module.weight


def check_exact_shift(planned: list) -> None:
    """Raise unless every weight `zero_centered_gamma` would rewrite to weight - 1 gives back the same scale,
    1 + (weight - 1) == weight bit for bit: the subtraction rounds in the weight's dtype (in bf16 a weight
    of 0.3 would scale by 0.3008), so the converted model would compute another function."""
    for name, module in planned:
        if module.zero_centered_gamma or module.weight is None:
            continue
        with _whole(name, module, modify=False) as weight:
            shifted = (weight.float() - 1).to(weight.dtype)
            inexact = (shifted.double() + 1) != weight.double()
            if inexact.any():
                i = int(inexact.nonzero()[0, 0])
                raise ShardnormConfigError(
                    "shardnorm.zero_centered_gamma",
                    f"{name or type(module).__name__}.weight ({weight.dtype}) has {int(inexact.sum())} of "
                    f"{weight.numel()} values that weight - 1 does not store exactly in {weight.dtype} (weight "
                    f"{weight[i].item()!r} would scale by {shifted[i].double().item() + 1!r}), so the converted norm "
                    "would compute another function. Set \"zero_centered_gamma\": false (the converted norms are "
                    "exact without it), or convert the weights while they are float32 and within [0.5, 2]. "
                    "Nothing was converted")


def _zero_center(name: str, module: torch.nn.Module) -> bool:
    """Store the scale as weight - 1 (exact: `check_exact_shift`) so the module computes the same function
    zero-centered; False when there is no weight to store."""
    if module.weight is not None:
        with _whole(name, module, modify=True) as weight:
            weight.sub_(1)
    module.zero_centered_gamma = True
    return module.weight is not None


def convert_norms(model: torch.nn.Module, section: ShardnormSection) -> tuple[torch.nn.Module, int]:
    """Convert the classes named in `section.replace` (all known norms when unset). Returns (model, count)."""
    if section.zero_centered_gamma:
        check_exact_shift(planned_norms(model, section))
    model, count = convert(model, classes=section.replace, keep_output=section.keep_output)
    if section.zero_centered_gamma:
        shifted = sum(_zero_center(name, module) for name, module in named_shardnorm_modules(model)
                      if not module.zero_centered_gamma)
        if shifted and hasattr(model, "save_pretrained"):
            warnings.warn(f"shardnorm.zero_centered_gamma stored {shifted} norm weights of {type(model).__name__} "
                          "as weight - 1: its state_dict and save_pretrained checkpoints are no longer plain Hugging "
                          "Face checkpoints (set zero_centered_gamma to false to keep them)", stacklevel=3)
    return model, count
