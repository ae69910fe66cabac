"""torch.library custom ops over the kernels, with fake impls and autograd, so torch.compile traces
them without graph breaks.

`shardnorm::norm_fwd(x, weight, bias, residual, eps, rms, zero_centered) -> (y, z, mean, rstd)` and
`shardnorm::norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, dy2=None, dy3=None)
-> (dx, dw, db)` work on 2-D [M, N] tensors whose last dim is contiguous. The norm's grad is dy (+ dy2
(+ dy3)): under torch.compile, `compile_fusion` hands the backward the terms of a grad sum (q, k and v's
input grads) instead of an add kernel's result. Absent outputs (z without a residual, mean
for RMSNorm, dw/db without weight/bias) are None from the backends and empty tensors from the ops.
dw/db come in the weight's dtype: the kernel's fp32 partial sums, reduced in fp32 in a fixed order,
rounded once (so no cast kernel follows; the distributed reducer passes fp32 weights to get fp32
grads).

Backend: CUDA tensors run the Triton kernels, others the torch reference; SHARDNORM_BACKEND=triton or
=torch forces one (Triton on CPU tensors needs TRITON_INTERPRET=1).
"""

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from . import _torch_compat, host, reference

BACKENDS = ("triton", "torch")


def _backend(x: Tensor):
    name = _env_backend() or ("triton" if x.is_cuda else "torch")
    if name == "torch":
        return reference
    if name == "triton":
        return _kernels()
    raise ValueError(f"SHARDNORM_BACKEND must be one of {BACKENDS}, got {name!r}")


def _env_backend() -> Optional[str]:
    """os.environ.get("SHARDNORM_BACKEND"), read per call (tests and users set it at any time) from the
    mapping behind os.environ: `os.environ.get` of an unset variable raises and catches a KeyError,
    ~1-2 us of every call's host time; a dict lookup is ~0.05 us."""
    value = _ENVIRON_DATA.get(_ENV_KEY)
    return value if value is None or type(value) is str else os.environ.decodevalue(value)


# CPython's os._Environ keeps the encoded environment in `_data`; elsewhere, the public mapping.
_ENVIRON_DATA = getattr(os.environ, "_data", os.environ)
_ENV_KEY = os.environ.encodekey("SHARDNORM_BACKEND") if _ENVIRON_DATA is not os.environ else "SHARDNORM_BACKEND"


@functools.cache
def _kernels():
    """The Triton backend, imported on first use: importing triton is slow and CPU runs don't need it
    (and an import statement in `_backend` would cost every call the import machinery's lookup)."""
    from . import kernels

    return kernels


def as_rows(t: Tensor, n: int, flat: bool = False) -> Tensor:
    """[..., N] as the [M, N] rows the ops take, last dim contiguous (a view where strides allow); `flat`: t is
    already [M, N]."""
    if flat and t.stride(1) == 1:
        return t
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _present(outputs: tuple, like: Tensor) -> tuple:
    """Absent outputs (None) as empty tensors: a custom op's schema returns Tensors."""
    return tuple(like.new_empty(0) if t is None else t for t in outputs)


def _check_devices(op: str, anchor: str, like: Tensor, **tensors: Optional[Tensor]) -> None:
    """Every tensor of a custom-op call on `like`'s device: the kernels get raw addresses (kernels/launch.py)
    and would read another device's (or host) memory as their own. The eager path's tensors are checked by
    `functional._check` and, in a backward, by the autograd engine; the ops may be called with anything."""
    device = like.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"shardnorm::{op}: {name} is on {t.device} but {anchor} is on {device}")


@torch.library.custom_op("shardnorm::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
             eps: float, rms: bool, zero_centered: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_devices("norm_fwd", "x", x, weight=weight, bias=bias, residual=residual)
    return _present(_backend(x).norm_fwd(x, weight, bias, residual, eps, rms, zero_centered), x)


@norm_fwd.register_fake
def _norm_fwd_fake(x, weight, bias, residual, eps, rms, zero_centered):
    from . import compile_fusion  # traced for torch.compile (only then): let Inductor fuse the adds around this op

    compile_fusion.install()
    M, N = x.shape
    z = x.new_empty((M, N), dtype=torch.result_type(x, residual)) if residual is not None else x.new_empty(0)
    stats = lambda rows: x.new_empty(rows, dtype=torch.float32)  # noqa: E731
    return x.new_empty((M, N)), z, stats(0 if rms else M), stats(M)


def _norm_bwd_impl(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, dy_terms=()):
    dy = dy.contiguous() if dy.stride()[-1] != 1 else dy
    dz = dz.contiguous() if dz is not None and dz.stride()[-1] != 1 else dz
    if dy_terms and any(t.stride() != dy.stride() for t in dy_terms):  # the kernel reads all with one stride
        dy, dy_terms = dy.contiguous(), tuple(t.contiguous() for t in dy_terms)
    return _backend(src).norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, dy_terms)


@torch.library.custom_op("shardnorm::norm_bwd", mutates_args=())
def norm_bwd(dy: Tensor, dz: Optional[Tensor], src: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
             rstd: Tensor, has_bias: bool, rms: bool, zero_centered: bool, dy2: Optional[Tensor] = None,
             dy3: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    dy_terms = tuple(t for t in (dy2, dy3) if t is not None)
    for name, term in zip(("dy2", "dy3"), (dy2, dy3)):
        if term is not None and term.shape != dy.shape:
            raise ValueError(f"shardnorm::norm_bwd: {name} has shape {tuple(term.shape)}, dy {tuple(dy.shape)}")
    _check_devices("norm_bwd", "src", src, dy=dy, dz=dz, weight=weight, mean=mean, rstd=rstd, dy2=dy2, dy3=dy3)
    return _present(_norm_bwd_impl(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, dy_terms), rstd)


@norm_bwd.register_fake
def _norm_bwd_fake(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, dy2=None, dy3=None):
    N = src.shape[1]
    dtype = weight.dtype if weight is not None else torch.float32
    grad = lambda present: src.new_empty(N if present else 0, dtype=dtype)  # noqa: E731
    return src.new_empty(src.shape), grad(weight is not None), grad(has_bias)


def _norm_bwd_any(dy, dz, *args):
    """`_norm_bwd_impl` for plain grads; for grads that stay tensor subclasses once pending ones are waited on, the
    op, whose dispatch unwraps them."""
    return (_norm_bwd_impl if _all_plain(dy, dz) else norm_bwd)(dy, dz, *args)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, rms, zero_centered = inputs
    _, z, mean, rstd = output
    ctx.save_for_backward(z if residual is not None else x, weight, mean, rstd)
    ctx.flags = (bias is not None, residual is not None, rms, zero_centered)


def _input_grads(ctx, dy, dz, run_bwd):
    """Grads for (x, weight, bias, residual, eps, rms, zero_centered); dz flows on to x and residual."""
    src, weight, mean, rstd = ctx.saved_tensors
    has_bias, has_residual, rms, zero_centered = ctx.flags
    dx, dweight, dbias = run_bwd(dy, dz if has_residual else None, src, weight, mean, rstd, has_bias, rms,
                                 zero_centered)
    return (dx, dweight if weight is not None else None, dbias if has_bias else None,
            dx if has_residual else None, None, None, None)


torch.library.register_autograd("shardnorm::norm_fwd", lambda ctx, dy, dz, *_: _input_grads(ctx, dy, dz, norm_bwd),
                                setup_context=_setup_context)


_PLAIN = (Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = frozenset((Tensor, torch.nn.Parameter, type(None)))
_PENDING = "AsyncCollectiveTensor"  # a functional collective's result (e.g. a reduce-scatter's)


def _ready(t: Optional[Tensor]) -> Optional[Tensor]:
    """The plain tensor behind an AsyncCollectiveTensor, waited on; other tensors as they are."""
    return t.wait() if type(t).__name__ == _PENDING else t


def _all_plain(*tensors, pending_ok: bool = False) -> bool:
    return all(t is None or type(t) in _PLAIN or pending_ok and type(t).__name__ == _PENDING for t in tensors)


class _EagerNorm(torch.autograd.Function):
    """Eager fast path over the same launchers, skipping the custom-op dispatch layers, for plain
    tensors and AsyncCollectiveTensors (waited on first: the kernels must not read a buffer that a
    collective is still writing). Other subclasses go through the ops, whose dispatch unwraps them.

    Those layers cost tens of microseconds of CPU per call, as long as the whole kernel at small N
    (32768 x 1024 bf16 moves 128 MB, ~40 us): eager calls go here (through `_apply`, the C apply),
    torch.compile traces the ops. Returns y, or (y, z) with a residual; the statistics stay in ctx.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms, zero_centered):
        if type(x) not in _PLAIN or (residual is not None and type(residual) not in _PLAIN):
            x, residual = _ready(x), _ready(residual)
        output = _backend(x).norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)
        _setup_context(ctx, (x, weight, bias, residual, eps, rms, zero_centered), output)
        return output[0] if residual is None else output[:2]

    @staticmethod
    def backward(ctx, dy, dz=None):
        if type(dy) in _PLAIN and (dz is None or type(dz) in _PLAIN):
            return _input_grads(ctx, dy, dz, _norm_bwd_impl)
        return _input_grads(ctx, _ready(dy), _ready(dz), _norm_bwd_any)


_apply = _torch_compat.fast_apply(_EagerNorm, tensors=4)


def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
         eps: float, rms: bool, zero_centered: bool) -> tuple[Tensor, Optional[Tensor]]:
    """Differentiable norm of 2-D x (or of x + residual). Returns (y, x + residual or None)."""
    compiling = _is_compiling()
    plain = not compiling and type(x) in _PLAIN_OR_NONE and type(weight) in _PLAIN_OR_NONE and \
        type(bias) in _PLAIN_OR_NONE and type(residual) in _PLAIN_OR_NONE  # _all_plain's common case, inlined
    eager = plain or not compiling and _all_plain(x, weight, bias, residual, pending_ok=True)
    if eager and x.is_cuda and _env_backend() is None:  # the C++ host path (host/), once built
        if host.norm is not None and not _transforms_active():
            # a collective's pending result (sequence parallel's norm input) is waited on, the kernels read the
            # tensor behind it (the entry leaves pending parameters to this path)
            out = host.norm(x, weight, bias, residual, float(eps), rms, zero_centered) if plain else \
                host.norm(x, weight, bias, residual, float(eps), rms, zero_centered, _ready(x), _ready(residual))
            if out is not None:  # None: the call is the Python path's (forward-mode AD, wrapped tensors)
                return out
        else:
            host.start()
    if eager:
        if not _grad_enabled():  # inference: no autograd node to build (the Function's apply, ~5-10 us)
            x, residual = _ready(x), _ready(residual)
            y, z, _, _ = _backend(x).norm_fwd(x, weight, bias, residual, float(eps), rms, zero_centered)
            return y, (z if residual is not None else None)  # the torch backend's absent z is empty
        if residual is None:
            return _apply(x, weight, bias, None, float(eps), rms, zero_centered), None
        return _apply(x, weight, bias, residual, float(eps), rms, zero_centered)
    y, z, _, _ = norm_fwd(x, weight, bias, residual, float(eps), rms, zero_centered)
    return y, (z if residual is not None else None)


_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_transforms_active = _torch_compat.transforms_active
