"""`convert(model)`: swap a model's norms for shardnorm's in place, keeping the very same Parameters.

What converts is decided by `shardnorm.norm_families` (the math of each known class), never by a class-name
suffix; anything else that looks like a norm is left alone and reported. A norm whose behaviour lives
outside its class (a per-instance `forward`, module hooks, DTensor parameters) is refused with
`NormWrapperError`, since the new module would silently lose it (docs/convert.md).
"""

import difflib
import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ._torch_compat import child_modules, is_dtensor, module_hooks, own_buffers
from . import output_recompute
from .functional import SUPPORTED_DTYPES
from .modules import LayerNorm, RMSNorm
from .norm_families import KNOWN, Extra, NormFamily, lookup, mismatch

_log = logging.getLogger(__name__)

class NormWrapperError(ValueError):
    """A norm carries behaviour (wrappers, hooks, DTensor parameters) that converting it would drop."""

    def __init__(self, name: str, module: torch.nn.Module, wrappers: list):
        self.name, self.wrappers = name, wrappers
        super().__init__(
            f"shardnorm.convert: {name or 'the model'} ({type(module).__name__}) carries {'; '.join(wrappers)}, "
            "which the new module would drop. Convert before adding them (e.g. before tensor parallelism or "
            "deepspeed.initialize), or remove them, convert with shardnorm.conversion.convert_module, and install "
            "their equivalent on the new module (Hugging Face tp_plan: shardnorm.integrations.transformers).")


@dataclass(frozen=True)
class Skipped:
    """A norm-like module `convert` left alone: where it is, its class, and why."""

    name: str
    cls: str
    reason: str


class ConvertResult(tuple):
    """`(model, count)` (so `model, count = convert(model)` works), plus `.converted` (module names)
    and `.skipped` (a `Skipped` per norm-like module left alone)."""

    def __new__(cls, model, count: int, converted: list, skipped: list):
        result = super().__new__(cls, (model, count))
        result.converted, result.skipped = converted, skipped
        return result

    @property
    def model(self) -> torch.nn.Module:
        return self[0]

    @property
    def count(self) -> int:
        return self[1]


def _hook_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def wrappers_of(module: torch.nn.Module) -> list:
    """What `module` carries beyond its class that a replacement would drop: a per-instance `forward`,
    module hooks (forward, backward, state_dict), DTensor parameters. Empty: safe to replace."""
    found = []
    if getattr(module, "_hf_hook", None) is not None:  # its per-instance forward copies the class forward's name
        found.append(f"Accelerate's device hook ({type(module._hf_hook).__name__}: a model dispatched with "
                     f"device_map or offload; convert it before dispatching, then accelerate.dispatch_model)")
    elif "forward" in module.__dict__:
        found.append(f"a per-instance forward ({_hook_name(module.__dict__['forward'])})")
    found += [f"a {what} ({_hook_name(h)})" for what, h in module_hooks(module)]
    for name, p in module.named_parameters(recurse=False):
        if is_dtensor(p):
            found.append(f"a DTensor parameter {name!r} (placements {tuple(p.placements)})")
    return found


def _matches(name: str, patterns: Optional[tuple]) -> bool:
    return patterns is None or any(name == p or (p.startswith("*") and name.endswith(p[1:])) for p in patterns)


def _looks_like_norm(module: torch.nn.Module) -> bool:
    """A leaf module whose class says it is a norm (the ones worth reporting when left alone)."""
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or (
        "norm" in type(module).__name__.lower() and next(module.children(), None) is None)


def _plan(module: torch.nn.Module, extra: Optional[Extra]) -> tuple:
    """(family, None) when `module` converts, else (None, why not)."""
    family = lookup(module, extra)
    if family is None:
        kind = next((c.__name__ for c in (torch.nn.LayerNorm, torch.nn.RMSNorm) if isinstance(module, c)), None)
        if kind:
            return None, f"a subclass of torch.nn.{kind} (its forward may differ); pass extra={{cls: family}} if not"
        return None, ("not in shardnorm's table of norm classes (shardnorm.norm_families); pass "
                      "extra={cls: family} to convert it if its forward is one of the families")
    if reason := mismatch(module, family):
        return None, reason
    # converted, it would fail at its first forward; left alone, the model runs as it did
    unsupported = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False)
                          if p.dtype not in SUPPORTED_DTYPES})
    if unsupported:
        return None, (f"its parameters are {', '.join(unsupported)}, and shardnorm's norms take float32, bfloat16 "
                      f"and float16 (convert after casting the model)")
    return family, None


_HALF = (torch.float16, torch.bfloat16)


class HalfWeightRMSNorm(RMSNorm):
    """shardnorm's RMSNorm for a family whose output takes a 16-bit weight's dtype (`half_weight_output`, T5): one
    cast after the kernel, where x comes in another dtype (a single rounding: the kernel's output is then fp32)."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        out = super().forward(x, residual)
        dtype = self.weight.dtype if self.weight is not None else x.dtype
        if dtype == x.dtype or dtype not in _HALF:
            return out
        return out.to(dtype) if residual is None else (out[0].to(dtype), out[1])


def _build(name: str, module: torch.nn.Module, family: NormFamily) -> torch.nn.Module:
    if found := wrappers_of(module):
        raise NormWrapperError(name, module, found)
    if type(module) is torch.nn.LayerNorm:
        new = LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                        bias=module.bias is not None, device="meta")
        new.bias = module.bias
    elif type(module) is torch.nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    else:
        shape = tuple(getattr(module.weight, "ds_shape", module.weight.shape))
        eps = float(getattr(module, family.eps_attr))
        if family.rms:
            cls = HalfWeightRMSNorm if family.half_weight_output else RMSNorm
            new = cls(shape, eps, device="meta", zero_centered_gamma=family.zero_centered_gamma)
        else:
            new = LayerNorm(shape, eps, bias=family.bias, device="meta", zero_centered_gamma=family.zero_centered_gamma)
            if family.bias:
                new.bias = module.bias
    new.weight = module.weight
    for buffer_name, buffer, persistent in own_buffers(module):  # only torch's own norms get here with buffers
        new.register_buffer(buffer_name, buffer, persistent=persistent)
    new.train(module.training)
    return new


def convert_module(module: torch.nn.Module, extra: Optional[Extra] = None, name: str = "") -> Optional[torch.nn.Module]:
    """The shardnorm module that computes what `module` computes, sharing its Parameters; None when
    `module` is not a norm shardnorm knows. Raises `NormWrapperError` (naming `name`) if `module`
    carries wrappers, hooks or DTensor parameters (`wrappers_of`)."""
    if isinstance(module, (LayerNorm, RMSNorm)):
        return None
    family, _ = _plan(module, extra)
    return None if family is None else _build(name, module, family)


def unknown_classes(classes: Iterable[str], extra: Optional[Extra] = None) -> list:
    """The entries of a `classes` selection that name no class `convert` knows (the table, torch's two norms,
    `extra`), so they could never select anything: a typo, or a class that needs `extra`."""
    names = {"LayerNorm", "RMSNorm", *KNOWN, *(k if isinstance(k, str) else k.__name__ for k in (extra or {}))}
    return [p for p in classes if not any(_matches(name, (p,)) for name in names)]


def near_class(name: str) -> Optional[str]:
    """The known norm class name closest to `name` (a likely typo's intent), or None."""
    found = difflib.get_close_matches(name.removeprefix("*"), ["LayerNorm", "RMSNorm", *sorted(KNOWN)], n=1)
    return found[0] if found else None


def _check_classes(patterns: tuple, extra: Optional[Extra]) -> None:
    if unknown := unknown_classes(patterns, extra):
        listed = ", ".join(f"{p!r}" + (f" (did you mean {near!r}?)" if (near := near_class(p)) else "")
                           for p in unknown)
        raise ValueError(f"shardnorm.convert: classes names no norm class shardnorm knows: {listed}. Known: "
                         "LayerNorm, RMSNorm and the classes of shardnorm.norm_families; for your own class pass "
                         "extra={cls: family}")


def _replacements(model: torch.nn.Module, patterns: Optional[tuple], extra: Optional[Extra]) -> tuple:
    """What `convert` would do, with the model untouched: ([(parent or None, attribute, new module)], converted
    names, skipped). Every name a module is registered under in its parents is listed, so aliases
    (`self.final_norm = self.norm`) stay one module."""
    converted, skipped, done = [], [], {}

    def visit(name: str, module: torch.nn.Module) -> Optional[torch.nn.Module]:
        if id(module) in done:
            return done[id(module)]
        new = None
        if not isinstance(module, (LayerNorm, RMSNorm)) and _matches(type(module).__name__, patterns):
            family, reason = _plan(module, extra)
            if family is not None:
                new = _build(name, module, family)
                converted.append(name)
            elif _looks_like_norm(module):
                skipped.append(Skipped(name, type(module).__name__, reason))
        done[id(module)] = new
        return new

    root = visit("", model)
    if root is not None:
        return [(None, "", root)], converted, skipped
    swaps = []
    for parent_name, parent in model.named_modules():
        for child_name, child in child_modules(parent):  # named_children() hides a second name of one module
            new = visit(f"{parent_name}.{child_name}" if parent_name else child_name, child)
            if new is not None:
                swaps.append((parent, child_name, new))
    return swaps, converted, skipped


def convertible(model: torch.nn.Module, classes: Optional[Iterable[str]] = None, *,
                extra: Optional[Extra] = None) -> list:
    """(name, replacement) for each module `convert(model, classes, extra=extra)` would replace, the replacement
    sharing its Parameters, with the model untouched. Raises what `convert` would raise."""
    patterns = _patterns(classes, extra)
    swaps, converted, _ = _replacements(model, patterns, extra)
    new_modules = list({id(new): new for _, _, new in swaps}.values())  # aliases: one replacement, one name
    return list(zip(converted, new_modules))


def _patterns(classes: Optional[Iterable[str]], extra: Optional[Extra]) -> Optional[tuple]:
    """`classes` as a tuple of checked names (`_check_classes`); None: every known class."""
    if isinstance(classes, str):
        raise TypeError(f"shardnorm.convert: classes must be a list of class names, got the string {classes!r}")
    if classes is None:
        return None
    patterns = tuple(classes)
    _check_classes(patterns, extra)
    return patterns


def convert(model: torch.nn.Module, classes: Optional[Iterable[str]] = None, *,
            extra: Optional[Extra] = None, warn: bool = True, keep_output: bool = True) -> ConvertResult:
    """Replace the norms of `model` (and `model` itself if it is one). Returns `ConvertResult`:
    `model, count = convert(model)`, with `.converted` and `.skipped` for the details. Every replacement is
    built before the first is installed, so an error leaves `model` as it was. Logs what it converted at
    INFO (logger "shardnorm.conversion").

    classes: only convert classes with these names (a leading "*" matches a suffix: "*RMSNorm");
        default: every class shardnorm knows. Never widens the table; a name that matches no known
        class (a typo) raises ValueError.
    extra: `{cls or class name: NormFamily}` for your own norm classes (see shardnorm.norm_families).
    warn: warn once, listing the norm-like modules left alone and why.
    keep_output: False: every shardnorm norm of the result (converted here or before) recomputes its output
        in backward instead of keeping it (`shardnorm.output_recompute`). Where any norm of the result has
        keep_output=False, `model`'s forward becomes the scope in which its consumers save a recompute handle.
        True (the default) changes no norm's setting, so that adapters converting an already converted model
        leave the user's choice as it is: to keep the outputs again, set `norm.keep_output = True` on the norms.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shardnorm.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    output_recompute.check_keep_output(keep_output)  # before any swap: "no" would keep the outputs
    patterns = _patterns(classes, extra)
    swaps, converted, skipped = _replacements(model, patterns, extra)
    # for the log line: the classes as they were
    owner, classes = type(model).__name__, Counter(type(model.get_submodule(name)).__name__ for name in converted)
    for parent, attribute, new in swaps:
        if parent is None:
            model = new
        else:
            setattr(parent, attribute, new)
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]
    if not keep_output:
        for module in norms:
            module.keep_output = False
    if not all(m.keep_output for m in norms):  # the model's forward is where their consumers' saves are taken
        output_recompute.scope(model, norms)
    _log_converted(model, owner, converted, classes, skipped)
    if warn:
        _warn(model, converted, skipped)
    return ConvertResult(model, len(converted), converted, skipped)


def _log_converted(model: torch.nn.Module, owner: str, converted: list, classes: Counter, skipped: list) -> None:
    """One line at INFO: what was converted (classes, then names), what was left alone, what the model now holds."""
    if not _log.isEnabledFor(logging.INFO):
        return
    total = sum(isinstance(m, (LayerNorm, RMSNorm)) for m in model.modules())
    names = [name for name in converted if name]  # "" is the model itself
    shown = ", ".join(f"{cls} x{n}" for cls, n in classes.items()) + (
        ": " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "")
    _log.info("shardnorm.convert: converted %d norm module(s) of %s%s, left %d alone; %d shardnorm norm module(s) "
              "in the model", len(converted), owner, f" ({shown})" if converted else "", len(skipped), total)


def _warn(model: torch.nn.Module, converted: list, skipped: list) -> None:
    if skipped:
        kinds = Counter((s.cls, s.reason) for s in skipped)
        lines = "; ".join(f"{cls} x{n}: {reason}" for (cls, reason), n in kinds.items())
        warnings.warn(f"shardnorm.convert left {len(skipped)} norm module(s) alone: {lines}", stacklevel=3)
    elif not converted and not any(isinstance(m, (LayerNorm, RMSNorm)) for m in model.modules()):
        warnings.warn(f"shardnorm.convert found no norm to convert in {type(model).__name__}", stacklevel=3)
