"""The norm as one differentiable op over the kernels: `norm(x, weight, bias, residual, eps, rms, zero_centered)`.

One autograd node, `_NormFunction`, takes every call; its forward and backward reach the backend one of two ways:

- directly (eager calls on plain tensors, no dispatch mode, no TorchScript tracer): the backend's launchers, no op
  dispatch;
- through the ops `torch.ops.shardnorm.norm_fwd` / `norm_bwd` (everything else): Dynamo traces the Function with
  the ops in its graphs, without graph breaks; a TorchDispatchMode sees the norm as one op (`shardnorm.norm_fwd`)
  rather than the kernels' output allocations, so selective activation checkpointing's policy can save or
  recompute it as a whole; `torch.jit.trace` records the op (a kernel launched directly is no op: the traced
  module would lose it); a tensor subclass's dispatch unwraps its tensors.

The ops are Triton ops (`torch.library.triton_op`). The Function is the autograd of every norm call; `norm_fwd` also
has a formula of its own (its backward `norm_bwd`), for graphs that hold the op without the Function (torch.export
inlines an autograd.Function's forward); `norm_bwd` has none (a call autograd would record raises).
Compiled, AOTAutograd decomposes them into what their bodies record: on CUDA the plans' allocations and kernels,
which Inductor launches from its generated code, so a compiled call runs none of shardnorm's Python (where Inductor
cannot launch a kernel, an opaque op over the launchers: at the ops below). Called on real tensors they run the
launchers behind custom ops' Python layers (autograd, redispatch): the direct way exists for host time (rows
`shardnorm_ops` against `shardnorm_functional` of `benchmarks/host_time.py`; docs/performance.md).

`norm_fwd(x, weight, bias, residual, eps, rms, zero_centered) -> (y, z, mean, rstd)` and
`norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered) -> (dx, dw, db)` work on 2-D [M, N]
tensors whose last dim is contiguous. Absent outputs (z without a residual, mean for RMSNorm, dw/db without
weight/bias) are None from the backends (kernels and reference) and empty tensors from the ops, whose schema
returns Tensors. dw/db come in the weight's dtype: the kernel's fp32 partial sums, reduced in fp32 in a fixed order,
rounded once.

A backward run with grad mode on (`create_graph=True`, e.g. a gradient penalty) computes the grads with
differentiable torch ops from the saved input instead of the kernels, so second-order grads are torch's.

Backend (`settings.backend`, SHARDNORM_BACKEND): CUDA tensors run the Triton kernels, others the torch reference.
"""

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import _torch_compat, reference, settings


def _backend(t: Tensor):
    return _kernels() if settings.runs_triton(t) else reference


@functools.cache
def _kernels():
    """The Triton backend, imported on first use: CPU runs on the torch backend never need it."""
    from . import kernels

    return kernels


def _present(outputs: tuple, like: Tensor) -> tuple:
    """Absent outputs (None) as empty tensors: the ops' schemas return Tensors."""
    return tuple(like.new_empty(0) if t is None else t for t in outputs)


def _check_devices(op: str, anchor: str, like: Tensor, **tensors: Optional[Tensor]) -> None:
    """Every tensor of an op call on `like`'s device: the kernels get raw addresses and would read another
    device's (or host) memory as their own. The eager path's tensors are checked by `functional._check` and, in a
    backward, by the autograd engine; the ops may be called with anything."""
    device = like.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"shardnorm::{op}: {name} is on {t.device} but {anchor} is on {device}")


# ---- the shared forward and backward ------------------------------------------------------------------------

def _forward(x, weight, bias, residual, eps, rms, zero_centered):
    return _backend(x).norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)


def _backward_kernels(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered):
    dy = dy.contiguous() if dy.stride()[-1] != 1 else dy
    dz = dz.contiguous() if dz is not None and dz.stride()[-1] != 1 else dz
    return _backend(src).norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)


# ---- the ops: what torch.compile, dispatch modes and tensor subclasses see ----------------------------------------

# The launchers as opaque ops (a plain `torch.library` definition: the dispatcher alone between a compiled graph and
# the launchers): what a traced `norm_fwd` / `norm_bwd` records where Inductor cannot launch the kernels itself.
_LIBRARY = torch.library.Library("shardnorm", "DEF")
_LIBRARY.define("norm_fwd_launch(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool rms, "
                "bool zero_centered) -> (Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define("norm_bwd_launch(Tensor dy, Tensor? dz, Tensor src, Tensor? weight, Tensor? mean, Tensor rstd, "
                "bool has_bias, bool rms, bool zero_centered) -> (Tensor, Tensor, Tensor)")

_NO_AUTOGRAD = ("shardnorm::{} has no autograd of its own: for grads call shardnorm's norms (the modules, "
                "shardnorm.layer_norm / rms_norm, shardnorm.ops.norm), whose autograd.Function calls it, or call it "
                "under torch.no_grad()")


def _refuse_grad(op: str, *tensors: Optional[Tensor]) -> None:
    """The launch ops have no autograd of their own: a call that autograd would record (grad mode on, an input
    requiring grad) gets an error rather than outputs whose grads would be silently missing. The Function calls them
    with grad mode off, as compiled graphs do."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(_NO_AUTOGRAD.format(op))


def _norm_fwd_launch_impl(x, weight, bias, residual, eps, rms, zero_centered):
    _refuse_grad("norm_fwd_launch", x, weight, bias, residual)
    _check_devices("norm_fwd_launch", "x", x, weight=weight, bias=bias, residual=residual)
    return _present(_forward(x, weight, bias, residual, eps, rms, zero_centered), x)


def _norm_bwd_launch_impl(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered):
    _refuse_grad("norm_bwd_launch", dy, dz, src, weight, mean, rstd)
    _check_devices("norm_bwd_launch", "src", src, dy=dy, dz=dz, weight=weight, mean=mean, rstd=rstd)
    return _present(_backward_kernels(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered), rstd)


_LIBRARY.impl("norm_fwd_launch", _norm_fwd_launch_impl, "CompositeExplicitAutograd")
_LIBRARY.impl("norm_bwd_launch", _norm_bwd_launch_impl, "CompositeExplicitAutograd")
_norm_fwd_launch = torch.ops.shardnorm.norm_fwd_launch.default
_norm_bwd_launch = torch.ops.shardnorm.norm_bwd_launch.default


@torch.library.register_fake("shardnorm::norm_fwd_launch", lib=_LIBRARY)
def _norm_fwd_launch_fake(x, weight, bias, residual, eps, rms, zero_centered):
    M, N = x.shape
    z = x.new_empty((M, N), dtype=torch.result_type(x, residual)) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0) if rms else x.new_empty(M, dtype=torch.float32)  # absent: `_present`'s
    return x.new_empty((M, N)), z, mean, x.new_empty(M, dtype=torch.float32)


@torch.library.register_fake("shardnorm::norm_bwd_launch", lib=_LIBRARY)
def _norm_bwd_launch_fake(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered):
    N = src.shape[1]
    dtype = weight.dtype if weight is not None else torch.float32
    grad = lambda present: src.new_empty(N, dtype=dtype) if present else rstd.new_empty(0)  # noqa: E731
    return src.new_empty(src.shape), grad(weight is not None), grad(has_bias)


# `norm_fwd` / `norm_bwd`: Triton ops. Called on real tensors (eager through a dispatch mode or a tensor subclass)
# their bodies run the launchers as the direct way does. Traced by torch.compile (AOTAutograd decomposes them: their
# arguments are fake or functional tensors), a CUDA call records the plan's allocations and its kernels through
# `torch.library.wrap_triton`, and Inductor launches the kernels from its generated code, with no Python of
# shardnorm's per call (RMSNorm 8 x 4096 on an H200: docs/performance.md, "Host time per call"); Inductor's
# analysis of what each kernel writes must find exactly its outputs (tests/test_traced_kernels.py). Where Inductor
# cannot launch the kernel, the traced body records an opaque call of the launchers instead (`norm_fwd_launch` /
# `norm_bwd_launch`), so compiled and eager calls still run the same kernels: the staged long-row kernels (Hopper:
# Gluon, a cooperative grid with a persistent exchange buffer, and a choice per call by the tensors' alignment) and
# the interpreted kernels of a CPU call with SHARDNORM_BACKEND=triton. The torch backend (CPU tensors by default)
# is traced as the aten ops of `reference`. Their kernels are listed for AOTAutograd's cache key, and imported only
# when a compile reads them (`_torch_compat.triton_op`; registered by `torch.library.triton_op` itself, reading
# the bodies' source imports Inductor: `import shardnorm` took 1.0 s instead of 0.02 on a CPU-only machine).

def _norm_fwd_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
                 rms: bool, zero_centered: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_devices("norm_fwd", "x", x, weight=weight, bias=bias, residual=residual)
    backend = _backend(x)
    if backend is not reference and type(x) not in _PLAIN:  # traced
        out = backend.norm_fwd_traced(x, weight, bias, residual, eps, rms, zero_centered) if x.is_cuda else None
        if out is None:
            return _norm_fwd_launch(x, weight, bias, residual, eps, rms, zero_centered)
        return _present(out, x)
    return _present(_forward(x, weight, bias, residual, eps, rms, zero_centered), x)


def _norm_bwd_op(dy: Tensor, dz: Optional[Tensor], src: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                 rstd: Tensor, has_bias: bool, rms: bool, zero_centered: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check_devices("norm_bwd", "src", src, dy=dy, dz=dz, weight=weight, mean=mean, rstd=rstd)
    backend = _backend(src)
    if backend is not reference and type(src) not in _PLAIN:  # traced
        dy = dy.contiguous() if dy.stride()[-1] != 1 else dy
        dz = dz.contiguous() if dz is not None and dz.stride()[-1] != 1 else dz
        out = backend.norm_bwd_traced(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered) \
            if src.is_cuda else None
        if out is None:
            return _norm_bwd_launch(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)
        return _present(out, rstd)
    return _present(_backward_kernels(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered), rstd)


_norm_fwd_op = _torch_compat.triton_op("shardnorm::norm_fwd", _norm_fwd_op, lambda: _kernels().TRACED_FWD_KERNELS)
_norm_bwd_op = _torch_compat.triton_op("shardnorm::norm_bwd", _norm_bwd_op, lambda: _kernels().TRACED_BWD_KERNELS)


def _no_autograd(op: str):
    """setup_context for an op: what custom ops run when autograd would record the call (grad mode on, an input
    requiring grad), after the body; the error `_refuse_grad` gives the launch ops."""
    def refuse(ctx, inputs, output):
        raise RuntimeError(_NO_AUTOGRAD.format(op))
    return refuse


def _unreachable_backward(ctx, *grads):
    raise AssertionError("shardnorm::norm_bwd records no autograd node (its setup_context raises)")


def _norm_fwd_setup(ctx, inputs, output):
    x, weight, bias, residual, eps, rms, zero_centered = inputs
    _, z, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.flags = (bias is not None, residual is not None, rms, zero_centered, eps)
    ctx.save_for_backward(z if residual is not None else x, weight, None if rms else mean, rstd)


def _norm_fwd_backward(ctx, dy, dz, _mean, _rstd):
    """`norm_fwd`'s own grads, for a graph that holds the op without the norms' Function: torch.export (non-strict)
    inlines an autograd.Function's forward, so an exported model's norms are this op, run under autograd when the
    exported module is called with grad mode on. The Function's backward (`_grads`) by the op pair."""
    has_bias, has_residual, rms, zero_centered, eps = ctx.flags
    src, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _grads(norm_bwd, dy, dz if has_residual else None, src, weight, mean, rstd, has_bias, rms,
                                zero_centered, eps)
    return dx, dweight, dbias, (dx if has_residual else None), None, None, None


_norm_fwd_op.register_autograd(_norm_fwd_backward, setup_context=_norm_fwd_setup)
_norm_bwd_op.register_autograd(_unreachable_backward, setup_context=_no_autograd("norm_bwd"))
norm_fwd = torch.ops.shardnorm.norm_fwd.default
norm_bwd = torch.ops.shardnorm.norm_bwd.default


# ---- the autograd.Function ---------------------------------------------------------------------------------------

_PLAIN = (Tensor, torch.nn.Parameter, type(None))
_is_pending = _torch_compat.is_pending_collective


def _ready(t: Optional[Tensor]) -> Optional[Tensor]:
    """The plain tensor behind a collective's pending result, waited on (the kernels must not read a buffer that a
    collective is still writing); other tensors as they are."""
    return t.wait() if type(t) not in _PLAIN and _is_pending(t) else t


def _eager_ok(*tensors) -> bool:
    for t in tensors:  # a loop, not all(<genexpr>): ~0.5 us of host time per call
        if type(t) not in _PLAIN and not _is_pending(t):
            return False
    return True


def _fp32(t: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or t.dtype == torch.float32 else t.float()


class _NormFunction(torch.autograd.Function):
    """The norm's one autograd node: every norm call of shardnorm's (module, functional, DTensor, with or without a
    reducer, eager or compiled) is one application of it. Returns y, or (y, z) with a residual; the statistics stay
    in ctx.

    `sink_w` / `sink_b`: None, or a reducer's grad sink for weight / bias (`distributed/reducer.py`): an fp32 leaf
    that takes the parameter's fp32 partial-sum grad instead of autograd giving it to the parameter; the kernels
    then read an fp32 copy of the parameter, so that their fixed-order sums are rounded to fp32 only. Being an input
    of this node, the hand-off is an ordinary grad: Dynamo traces it, and the reducer's bookkeeping runs in the
    sink's post-accumulate hook, outside any graph.

    `opts`: (eps, rms, zero_centered, direct, shards) in one argument, as the node keeps them in one ctx attribute:
    each argument and attribute of the node is host time per call (docs/performance.md).
    `direct`: the call runs the backend's launchers itself (eager, plain local tensors, no dispatch mode); otherwise
    its forward and backward call the ops, which Dynamo traces into the graph and a dispatch mode or tensor subclass
    sees. `shards`: None, or (eager only) the `distributed.dtensor.TokenShards` of a token-sharded DTensor call: the
    node then takes and returns DTensors and runs on their local rows, with cached specs instead of the autograd
    nodes and spec checks of `to_local` / `DTensor.from_local` (host time: docs/performance.md)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, sink_w, sink_b, opts):
        eps, rms, zero_centered, direct, shards = opts
        x_in, weight_in = x, weight  # as passed: what a create_graph backward differentiates
        if shards is not None:
            x, weight, bias, residual = shards.unwrap(x, weight, bias, residual)
        if sink_w is not None:
            weight = _fp32(weight)
        if sink_b is not None:
            bias = _fp32(bias)
        if direct:
            if type(x) not in _PLAIN:
                x = _ready(x)
            if type(residual) not in _PLAIN:
                residual = _ready(residual)
            y, z, mean, rstd = _forward(x, weight, bias, residual, eps, rms, zero_centered)
        else:
            y, z, mean, rstd = norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)
            if rms:  # the op's empty placeholder: saved, a compiled forward would allocate and return it
                mean = None
        has_residual = residual is not None
        src = z if has_residual else x  # the rows the kernel normalized
        routed_w, routed_b = sink_w is not None, sink_b is not None
        # one ctx attribute: each costs host time per call, set here and read in the backward
        ctx.flags = (bias is not None, has_residual, rms, zero_centered, eps, direct, shards, routed_w, routed_b,
                     y.dtype)
        if routed_w or routed_b:
            ctx.sinks = (sink_w, sink_b)
        if shards is not None:
            y = shards.wrap(y, y.dtype)
            z = shards.wrap(z, z.dtype) if has_residual else None
        # saves begin (src, weight as the kernel read it, mean, rstd), which the output recompute reads
        # (`output_recompute`); a create_graph backward differentiates from x (or z) and the weight as passed
        if shards is not None or routed_w or routed_b:
            ctx.save_for_backward(src, weight, mean, rstd, z if has_residual else x_in, weight_in)
        else:
            ctx.save_for_backward(src, weight, mean, rstd)
        ctx.set_materialize_grads(False)
        return y if not has_residual else (y, z)

    @staticmethod
    def backward(ctx, dy, dz=None):
        has_bias, has_residual, rms, zero_centered, eps, direct, shards, sink_w, sink_b, y_dtype = ctx.flags
        if shards is not None:
            differentiable = torch.is_grad_enabled()
            dy, dz = shards.rows(dy, differentiable), shards.rows(dz, differentiable)
        saved = ctx.saved_tensors
        src, weight, mean, rstd = saved[:4]
        if dy is None:  # only z was used
            dy = torch.zeros(src.shape, dtype=y_dtype, device=src.device)
        dz = dz if has_residual else None
        if torch.is_grad_enabled():  # create_graph: `_grads` differentiates, from x (or z) and the weight as passed
            if len(saved) > 4:
                src, weight = _differentiable_inputs(shards, sink_w, saved[4], saved[5])
            run_bwd = None
        else:
            if direct:
                if type(dy) not in _PLAIN or type(dz) not in _PLAIN:
                    dy, dz = _ready(dy), _ready(dz)
                    direct = _eager_ok(dy, dz)
            # the forward's rule again: a dispatch mode entered around the backward alone sees the op too; compiled
            # autograd traces the op (the rule's own checks are no ops Dynamo can trace)
            run_bwd = _backward_kernels if direct and not torch.compiler.is_compiling() and not _ops_observed() \
                else norm_bwd
        try:  # costs nothing until it catches
            dx, dweight, dbias = _grads(run_bwd, dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered, eps)
        except (RuntimeError, NotImplementedError):
            if not _torch_compat.is_batched_grad(dy):
                raise
            # a batched backward (`is_grads_batched`, `jacobian(vectorize=True)`), whose tensors the kernels cannot
            # read: torch ops, which it batches
            dx, dweight, dbias = _grads(reference.norm_bwd, dy, dz, src, weight, mean, rstd, has_bias, rms,
                                        zero_centered, eps)
        if (sink_w or sink_b) and not torch.compiler.is_compiling():
            sink_w, sink_b = _reached_sinks(ctx.sinks)
        to_w, to_b = (None if sink_w else dweight), (None if sink_b else dbias)
        dres = None
        if shards is not None:
            x_dtype, residual_dtype = shards.dtypes
            dres = shards.wrap(dx, residual_dtype) if has_residual else None
            dx = shards.wrap(dx, x_dtype)
            to_w, to_b = shards.param_grad(to_w, 0), shards.param_grad(to_b, 1)
        elif has_residual:
            dres = dx
        return dx, to_w, to_b, dres, dweight if sink_w else None, dbias if sink_b else None, None


def _reached_sinks(sinks: tuple) -> tuple:
    """(whether this backward accumulates into the weight's sink, the bias's). One that does not is no backward of
    the step (`torch.autograd.grad(loss, params)`, `backward(inputs=params)`): the parameter then gets its grad
    itself, as without a reducer, instead of the sink that nothing would read."""
    return tuple(sink is not None and _torch_compat.backward_reaches(sink) for sink in sinks)


def _grads(run_bwd, dy, dz, src, weight, mean, rstd, has_bias: bool, rms: bool, zero_centered: bool, eps: float):
    """(dx, dweight or None, dbias or None) of the norm of `src`, by `run_bwd` (a backward of the kernels' signature);
    with grad mode on (a create_graph backward) by the differentiable torch math instead, the statistics recomputed
    from src, so that second-order grads are torch's. The backward of both autograd nodes: the Function's and the
    `norm_fwd` op's own."""
    if torch.is_grad_enabled():
        mean, rstd = reference.statistics(src, eps, rms)
        run_bwd = reference.norm_bwd
    dx, dweight, dbias = run_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)
    return dx, (dweight if weight is not None else None), (dbias if has_bias else None)


def _differentiable_inputs(shards, routed_w: bool, x_or_z, weight):
    """(src rows, weight) for a create_graph backward, as differentiable functions of the call's inputs (or z)."""
    src = shards.rows(x_or_z, differentiable=True) if shards is not None else x_or_z
    if shards is not None:
        weight = shards.param(weight)
    return src, (_fp32(weight) if routed_w else weight)


_INSTEAD = ("Use torch.nn.functional.layer_norm / rms_norm (or torch.nn.LayerNorm / RMSNorm) where you need it; "
            "reverse-mode grads (backward, torch.autograd.grad, create_graph=True for second order) are supported")


def _unsupported(what: str) -> str:
    return (f"shardnorm's norms do not support {what}: their autograd.Function over the kernels has no torch.func "
            f"rules. {_INSTEAD}")


def _call_error(error: Exception, *tensors) -> Exception:
    """The error to raise for `error` from a norm call on `tensors` (x, weight, bias, residual): a clear one when a
    plain x meets a DTensor (torch's own names the op, not the argument), a torch.func transform is running or an
    input is a forward-mode AD dual tensor (torch's own says "must override setup_context", "must implement the jvp
    function", or names no transform), else `error` itself."""
    x = tensors[0]
    if not _torch_compat.is_dtensor(x):
        for name, t in zip(("weight", "bias", "residual"), tensors[1:]):
            if _torch_compat.is_dtensor(t):
                return ValueError(f"shardnorm: x is a plain torch.Tensor but {name} is a DTensor (placements "
                                  f"{tuple(t.placements)}); pass x as a DTensor on {name}'s mesh (a sequence-parallel "
                                  f"norm's input: DTensor.from_local), or {name}.to_local()")
    transform = _torch_compat.innermost_functorch_transform()
    if transform is None:
        if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
            return NotImplementedError(_unsupported("forward-mode AD (torch.autograd.forward_ad dual tensors)"))
        return error
    what = {"Vmap": "torch.func.vmap", "Grad": "torch.func.grad / vjp / jacrev",
            "Jvp": "torch.func.jvp / jacfwd (forward-mode AD)"}.get(transform, f"torch.func's {transform} transform")
    return NotImplementedError(_unsupported(what))


def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
         eps: float, rms: bool, zero_centered: bool, sinks: tuple = (None, None),
         shards=None) -> tuple[Tensor, Optional[Tensor]]:
    """Differentiable norm of 2-D x (or of x + residual). Returns (y, x + residual or None).

    `sinks`: the reducer's grad sinks for (weight, bias) (`_NormFunction`). `shards`: a token-sharded DTensor
    call's `TokenShards` (eager only; the caller checked that its local tensors are plain): x, residual, weight
    and bias are then DTensors, and so are y and z."""
    eps = float(eps)
    sink_w, sink_b = sinks
    try:
        if shards is not None:
            out = _apply(x, weight, bias, residual, sink_w, sink_b, (eps, rms, zero_centered, True, shards))
        elif not torch.compiler.is_compiling() and _eager_ok(x, weight, bias, residual) \
                and not _ops_observed():
            out = _apply(x, weight, bias, residual, sink_w, sink_b, (eps, rms, zero_centered, True, None))
        elif sink_w is None and sink_b is None and torch.compiler.is_exporting():
            # the op with its own autograd formula: strict export runs an autograd.Function's forward with grad mode
            # off and keeps no backward (the norm would leave autograd); non-strict export inlines it to the op anyway
            y, z, _, _ = norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)
            out = y if residual is None else (y, z)
        else:
            out = _NormFunction.apply(x, weight, bias, residual, sink_w, sink_b, (eps, rms, zero_centered, False, None))
    except (RuntimeError, NotImplementedError) as e:  # a try costs nothing until it catches
        raise _call_error(e, x, weight, bias, residual) from e
    return (out, None) if residual is None else out


def recompute_output(src: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool,
                     zero_centered: bool, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """A norm's output again, bitwise the first forward's: the same backend and kernel on the same src, no
    autograd. `src` is x, or z = x + residual for the residual form (the kernels normalize the rounded z, and
    round y from fp32 once, to `dtype`, as here). Returns (y, mean, rstd). The forward's one rule decides the way
    (`norm`): under a dispatch mode the op, so that the mode sees the recompute as the forward it repeats."""
    with torch.no_grad():
        forward = _forward if not _ops_observed() else norm_fwd
        y, _, mean, rstd = forward(src, weight, bias, None, float(eps), rms, zero_centered)
    return (y if y.dtype == dtype else y.to(dtype)), mean, rstd


_ops_observed = _torch_compat.ops_observed
_apply = _torch_compat.function_apply(_NormFunction)
