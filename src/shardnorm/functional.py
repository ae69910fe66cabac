"""Functional API with torch.nn.functional semantics: validation, flattening to [M, N], dispatch.

`layer_norm` / `rms_norm` mirror `torch.nn.functional.layer_norm` / `rms_norm`; `add_layer_norm` /
`add_rms_norm` fuse the prenorm residual add and return `(norm(x + residual), x + residual)`.
`zero_centered_gamma=True` scales by `1 + weight` (Gemma, Megatron's `apply_layernorm_1p`).
The output has x's dtype; the weight may be fp32 while x is bf16/fp16 (mixed precision).
DTensor inputs are handed to `shardnorm.distributed.dtensor`, which runs the same op on local shards.
"""

import math
import numbers
import operator
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import ops
from ._torch_compat import is_dtensor
from .rows import as_param as _flat
from .rows import as_rows as _rows

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ShapeLike = Union[int, Sequence[int], torch.Size]


def _shape(normalized_shape) -> tuple:
    """normalized_shape as a tuple of sizes (ints, or a traced graph's symbolic ints; other integers, such as
    numpy's, which torch's norms take, as ints): a TypeError naming it for anything else (a tensor, a string, a
    float size would otherwise reach the comparisons and the kernels)."""
    if type(normalized_shape) is tuple:
        shape = normalized_shape
    elif isinstance(normalized_shape, (int, torch.SymInt)) and not isinstance(normalized_shape, bool):
        return (normalized_shape,)
    elif isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (operator.index(normalized_shape),)
    elif isinstance(normalized_shape, (Tensor, str, bytes)) or not hasattr(normalized_shape, "__iter__"):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got "
                        f"{type(normalized_shape).__name__}")
    else:
        shape = tuple(normalized_shape)
    for d in shape:
        if type(d) is not int and not isinstance(d, torch.SymInt):
            if isinstance(d, bool) or not isinstance(d, numbers.Integral):
                raise TypeError(f"normalized_shape must be an int or a sequence of ints, got an element of type "
                                f"{type(d).__name__} ({d!r})")
            return tuple(d if isinstance(d, torch.SymInt) else operator.index(d) for d in shape)
    return shape


def check_eps(eps) -> float:
    """eps as the kernels take it, a float (an int converted: the launch plans key their kernels on eps being one),
    or a TypeError / ValueError naming it: a tensor or a string would reach the kernels as another kind of argument."""
    if type(eps) is not float:
        if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, torch.SymFloat)):
            raise TypeError(f"eps must be a float, got {type(eps).__name__}")
        if not isinstance(eps, torch.SymFloat):
            eps = float(eps)
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"eps must be >= 0, got {eps}")
    return eps


def check_zero_centered(zero_centered) -> None:
    """zero_centered_gamma is a bool: a string such as "no" would select the 1 + weight kernels by its truth value."""
    if zero_centered is not False and zero_centered is not True:
        raise TypeError(f"zero_centered_gamma must be a bool, got {type(zero_centered).__name__}")


def _check(x: Tensor, residual, shape: tuple, weight, bias) -> None:
    if x.is_nested:
        raise TypeError("x is a nested tensor, which shardnorm's norms do not take: pad its sequences into one tensor, "
                        "or use torch.nn.functional.layer_norm / rms_norm for it")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if len(shape) == 0 or min(shape) <= 0:
        raise ValueError(f"normalized_shape must be a non-empty shape of positive sizes, got {list(shape)}")
    if x.dim() < len(shape) or x.shape[-len(shape):] != shape:
        raise ValueError(f"normalized_shape {list(shape)} does not match the trailing dims of x "
                         f"(shape {list(x.shape)})")
    device = x.device
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        if residual.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"residual must be float32, bfloat16 or float16, got {residual.dtype}")
        if residual.device != device:
            raise ValueError(f"residual is on {residual.device} but x is on {device}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if p.shape != shape:
            raise ValueError(f"{name} must have shape normalized_shape {list(shape)}, got {list(p.shape)}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {p.dtype}")
        if p.device != device:
            raise ValueError(f"{name} is on {p.device} but x is on {device}")


# The default eps of torch's rms_norm: the epsilon of the type it computes in (ATen's opmath type: float32 for
# bfloat16, float16 and float32 inputs), not of the input's dtype as its docstring says (torch.finfo costs ~0.5 us
# per call).
_DEFAULT_EPS = torch.finfo(torch.float32).eps


def resolve_eps(eps: Optional[float]) -> float:
    """eps as the op takes it: None is torch's default for rms_norm, finfo(float32).eps for every dtype the kernels
    take (others: _check raises); a number as `check_eps` takes it."""
    return _DEFAULT_EPS if eps is None else check_eps(eps)


def _norm(x, residual, normalized_shape: ShapeLike, weight, bias, eps, rms: bool, zero_centered: bool):
    """eps: a number (a caller that keeps the value, the module with keep_output=False, resolves it once and passes
    it), or None for `resolve_eps`'s default."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_zero_centered(zero_centered)
    shape = _shape(normalized_shape)
    eps = resolve_eps(None) if eps is None else check_eps(eps)
    _check(x, residual, shape, weight, bias)  # DTensors too: their shapes are the global ones
    if is_dtensor(x):
        from .distributed.dtensor import norm_dtensor

        return norm_dtensor(x, weight, bias, residual, eps, rms, zero_centered, shape)
    # [M, N] inputs with 1-D parameters (the common case) pass straight through: at small sizes
    # every reshape and view is host time the kernel cannot hide.
    n = shape[0] if len(shape) == 1 else math.prod(shape)
    flat = x.dim() == 2 and len(shape) == 1
    y, z = ops.norm(_rows(x, n, flat), _flat(weight, n), _flat(bias, n),
                    _rows(residual, n, flat) if residual is not None else None, eps, rms, zero_centered)
    if flat:
        return y, z
    return y.view(x.shape), (z.view(x.shape) if z is not None else None)


def layer_norm(x: Tensor, normalized_shape: ShapeLike, weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5, *, zero_centered_gamma: bool = False) -> Tensor:
    return _norm(x, None, normalized_shape, weight, bias, eps, False, zero_centered_gamma)[0]


def rms_norm(x: Tensor, normalized_shape: ShapeLike, weight: Optional[Tensor] = None,
             eps: Optional[float] = None, *, zero_centered_gamma: bool = False) -> Tensor:
    return _norm(x, None, normalized_shape, weight, None, eps, True, zero_centered_gamma)[0]


def add_layer_norm(x: Tensor, residual: Tensor, normalized_shape: ShapeLike, weight: Optional[Tensor] = None,
                   bias: Optional[Tensor] = None, eps: float = 1e-5, *,
                   zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor]:
    """(layer_norm(x + residual), x + residual), one fused pass; x + residual has torch's promoted dtype."""
    return _norm(x, residual, normalized_shape, weight, bias, eps, False, zero_centered_gamma)


def add_rms_norm(x: Tensor, residual: Tensor, normalized_shape: ShapeLike, weight: Optional[Tensor] = None,
                 eps: Optional[float] = None, *, zero_centered_gamma: bool = False) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual), one fused pass; x + residual has torch's promoted dtype."""
    return _norm(x, residual, normalized_shape, weight, None, eps, True, zero_centered_gamma)
