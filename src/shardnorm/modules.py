"""Drop-in `LayerNorm` / `RMSNorm` modules.

They subclass `torch.nn.LayerNorm` / `torch.nn.RMSNorm`, so constructor arguments, attributes,
`extra_repr`, `reset_parameters` and state_dict keys are torch's own and `load_state_dict` works both
ways (and `isinstance(m, torch.nn.LayerNorm)` stays true for code that looks for norms). Added:
`zero_centered_gamma` (scale = 1 + weight; weight then initializes to zeros) and an optional
`residual` argument to `forward` that fuses the prenorm residual add and returns `(y, x + residual)`, and
`keep_output` (False: the norm's consumers save a recompute handle instead of its output, which is made again when
their backward needs it, inside a model handed to `shardnorm.convert(model, keep_output=False)` or, under sequence
parallelism, for consumers that own the re-gather; see `shardnorm.output_recompute`).
"""

import math
from typing import Optional

import torch
from torch import Tensor

from . import functional as F
from . import output_recompute

# The marks of a norm whose grads go to a reducer's grad sinks (`shardnorm.distributed.attach_reducer`), here so
# that the forward reads them without importing torch.distributed: the reducer, on each of its parameters
# (`distributed/grad_sources.py`) and on the module itself. The module's mark outlives its parameters, which
# `nn.Module._apply` (`model.to(dtype)`, `.half()`: `torch.utils.swap_tensors` swaps their `__dict__`) and
# `load_state_dict(assign=True)` (new objects) replace without theirs.
REDUCER_ATTR = "_shardnorm_reducer"
BOUND_REDUCER_ATTR = "_shardnorm_bound_reducer"


class _FusedNorm:
    """Mixin: the forward and the `zero_centered_gamma` option shared by both norms.

    The forward reads registered parameters from `_parameters` (what `self.weight` resolves to, minus
    nn.Module.__getattr__'s 1.5-3 us); a weight held otherwise (a parametrization's property, FSDP1's
    plain-tensor views) goes through attribute lookup. RMSNorm has no bias unless one is
    registered."""

    zero_centered_gamma: bool = False
    _keep_output: bool = True
    _shardnorm_bound_reducer = None  # BOUND_REDUCER_ATTR: a class default, one lookup for a norm never bound
    _rms: bool

    @property
    def keep_output(self) -> bool:
        return self._keep_output

    @keep_output.setter
    def keep_output(self, keep: bool) -> None:
        output_recompute.check_keep_output(keep)
        self._keep_output = keep

    def __prepare_scriptable__(self):
        """torch.jit.script calls this first: a clear error instead of TorchScript's own on the Python forward."""
        raise TypeError(f"shardnorm.{type(self).__name__} cannot be compiled by torch.jit.script (TorchScript): its "
                        "forward runs the kernels from Python. Use torch.jit.trace (the traced shapes), torch.export "
                        "or torch.compile")

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else None if self._rms else getattr(self, "bias", None)
        reducer = self._shardnorm_bound_reducer
        if reducer is not None and (getattr(weight, REDUCER_ATTR, None) is not reducer
                                    or bias is not None and getattr(bias, REDUCER_ATTR, None) is not reducer) \
                and torch.is_grad_enabled():  # without grads nothing skips the reducer (an evaluation in bf16)
            _refuse_replaced(self)  # else their grads would skip the reducer, silently
        if not self._keep_output and residual is None and torch.compiler.is_compiling():
            return output_recompute.compiled_norm(self._norm, x, weight, bias)
        if self._keep_output:
            y, z = F._norm(x, residual, self.normalized_shape, weight, bias, self.eps, self._rms,
                           self.zero_centered_gamma)
        else:
            eps = F.resolve_eps(self.eps)
            y, z = F._norm(x, residual, self.normalized_shape, weight, bias, eps, self._rms, self.zero_centered_gamma)
            output_recompute.track(self, y, x if residual is None else z, weight, bias, eps, self._rms,
                                   self.zero_centered_gamma, math.prod(self.normalized_shape))
        return y if residual is None else (y, z)

    def _norm(self, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
        return F._norm(x, None, self.normalized_shape, weight, bias, self.eps, self._rms, self.zero_centered_gamma)[0]

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.zero_centered_gamma and self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        extra = (", zero_centered_gamma=True" if self.zero_centered_gamma else "") + \
            (", keep_output=False" if not self._keep_output else "")
        return super().extra_repr() + extra


def _refuse_replaced(norm) -> None:
    raise RuntimeError(f"shardnorm: {type(norm).__name__}'s parameters were replaced after attach_reducer(model) "
                       "(model.to(dtype), .half(), .float(), load_state_dict(assign=True)): their grads would skip "
                       "the model's norm-grad reducer; call shardnorm.distributed.attach_reducer(model) again")


def _check_args(normalized_shape, eps, zero_centered_gamma) -> tuple:
    """The constructor's arguments, checked as every call checks them (torch's constructors accept a string eps and
    leave a float size to fail in torch.empty): the error names the argument at construction. Returns
    (normalized_shape, eps) as every call takes them (numpy's integers and floats as Python's)."""
    F.check_zero_centered(zero_centered_gamma)
    return F._shape(normalized_shape), (F.check_eps(eps) if eps is not None else None)


class LayerNorm(_FusedNorm, torch.nn.LayerNorm):
    _rms = False

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, zero_centered_gamma: bool = False, keep_output: bool = True) -> None:
        normalized_shape, eps = _check_args(normalized_shape, eps, zero_centered_gamma)
        self.zero_centered_gamma = zero_centered_gamma  # read by reset_parameters inside super().__init__
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.keep_output = keep_output


class RMSNorm(_FusedNorm, torch.nn.RMSNorm):
    _rms = True

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, zero_centered_gamma: bool = False, keep_output: bool = True) -> None:
        normalized_shape, eps = _check_args(normalized_shape, eps, zero_centered_gamma)
        self.zero_centered_gamma = zero_centered_gamma
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.keep_output = keep_output
