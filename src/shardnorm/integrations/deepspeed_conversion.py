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


def _weights_to_shift(planned: list) -> list:
    """The norms `zero_centered_gamma` re-centres, one list of (name, module) per Parameter: norms that share
    one weight (tied, or one Parameter reached through several modules or names) must shift it once, not once
    per module, or it ends up weight - 2."""
    groups = {}
    for name, module in planned:
        if not module.zero_centered_gamma and module.weight is not None:
            groups.setdefault(id(module.weight), []).append((name, module))
    return list(groups.values())


def _names(group: list) -> str:
    return " = ".join(f"{name or type(module).__name__}.weight" for name, module in group)


def check_shared_weights(model: torch.nn.Module, planned: list) -> None:
    """Raise unless every holder of a weight to re-centre is a norm re-centred with it. Anything else holding
    the same Parameter (a tied Linear, a norm that is not converted or already scales by 1 + weight, another
    slot such as a bias) would silently compute with weight - 1 in place of weight."""
    groups = _weights_to_shift(planned)
    shifted_weights = {id(group[0][1].weight): group for group in groups}
    # the model's own modules: a planned replacement is not installed yet, the module it replaces holds the weight
    shifted_modules = {id(model.get_submodule(name)) for group in groups for name, _ in group}
    for owner, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            group = shifted_weights.get(id(p))
            if group is not None and not (attr == "weight" and id(module) in shifted_modules):
                holder = f"{owner}.{attr}" if owner else attr
                raise ShardnormConfigError(
                    "shardnorm.zero_centered_gamma",
                    f"{_names(group)} is the same Parameter as {holder} ({type(module).__name__}), which "
                    "zero_centered_gamma does not re-centre: storing the weight as weight - 1 would change what "
                    f"{holder} computes. Untie them (give each its own Parameter), convert both as norms, or set "
                    "\"zero_centered_gamma\": false. Nothing was converted")


def check_exact_shift(planned: list) -> None:
    """Raise unless every weight `zero_centered_gamma` would rewrite to weight - 1 gives back the same scale,
    1 + (weight - 1) == weight bit for bit: the subtraction rounds in the weight's dtype (in bf16 a weight
    of 0.3 would scale by 0.3008), so the converted model would compute another function."""
    for group in _weights_to_shift(planned):
        name, module = group[0]
        with _whole(name, module, modify=False) as weight:
            shifted = (weight.float() - 1).to(weight.dtype)
            inexact = (shifted.double() + 1) != weight.double()
            if inexact.any():
                i = int(inexact.nonzero()[0, 0])
                raise ShardnormConfigError(
                    "shardnorm.zero_centered_gamma",
                    f"{_names(group)} ({weight.dtype}) has {int(inexact.sum())} of "
                    f"{weight.numel()} values that weight - 1 does not store exactly in {weight.dtype} (weight "
                    f"{weight[i].item()!r} would scale by {shifted[i].double().item() + 1!r}), so the converted norm "
                    "would compute another function. Set \"zero_centered_gamma\": false (the converted norms are "
                    "exact without it), or convert the weights while they are float32 and within [0.5, 2]. "
                    "Nothing was converted")


def _shift(name: str, module: torch.nn.Module) -> None:
    """Store `module.weight` as weight - 1 (exact: `check_exact_shift`), so that read as 1 + weight it scales
    as before."""
    with _whole(name, module, modify=True) as weight:
        weight.sub_(1)


def convert_norms(model: torch.nn.Module, section: ShardnormSection) -> tuple[torch.nn.Module, int]:
    """Convert the classes named in `section.replace` (all known norms when unset). Returns (model, count)."""
    if section.zero_centered_gamma:
        planned = planned_norms(model, section)
        check_shared_weights(model, planned)
        check_exact_shift(planned)
    model, count = convert(model, classes=section.replace, keep_output=section.keep_output)
    if section.zero_centered_gamma:
        norms = [(name, module) for name, module in named_shardnorm_modules(model) if not module.zero_centered_gamma]
        groups = _weights_to_shift(norms)
        for group in groups:
            _shift(*group[0])  # once per Parameter, however many norms share it
        for _, module in norms:  # all of them read 1 + weight now (one without a weight computes the same)
            module.zero_centered_gamma = True
        if groups and hasattr(model, "save_pretrained"):
            warnings.warn(f"shardnorm.zero_centered_gamma stored {len(groups)} norm weights of {type(model).__name__} "
                          "as weight - 1: its state_dict and save_pretrained checkpoints are no longer plain Hugging "
                          "Face checkpoints (set zero_centered_gamma to false to keep them)", stacklevel=3)
    return model, count
