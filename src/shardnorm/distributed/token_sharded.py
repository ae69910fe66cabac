"""The eager norm of a token-sharded DTensor (rows sharded or replicated, normalized dims whole) as one autograd node.

The kernels run on the local rows as for plain tensors; what costs host time is the DTensor wrapping. Composed from
`to_local` and `DTensor.from_local` (the path `dtensor.py` keeps for torch.compile and the hidden-sharded norm), a
call takes four to six autograd nodes, each building and validating a DTensorSpec in forward or backward (~15 us
apiece on a CPU). Here one node takes the DTensors, runs the ops' shared forward and backward (`shardnorm.ops`) on
their local tensors, and wraps its results with specs cached per layout and shape. The grads are the composed path's:
x (and residual) get DTensor grads laid out like x; weight/bias get theirs `Partial` over the token mesh dims or,
bound to a reducer, push fp32 partial sums into it from this node's backward (`grad_routing`).
A backward with grad mode on (`create_graph=True`) computes the same grads with differentiable ops.
"""

import torch
from torch.distributed.tensor import DTensor

from shardnorm import _torch_compat, ops, reference
from shardnorm.distributed.grad_routing import route_to_reducer, routed_params
from shardnorm.distributed.layout import NormLayout
from shardnorm.rows import as_param, as_rows

_SPECS_PER_LAYOUT = 64  # (shape, stride, dtype) variants kept per layout: sequence lengths, output dtypes


def _spec(layout: NormLayout, placements: tuple, shape, stride: tuple, dtype: torch.dtype):
    """The DTensorSpec `DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)` builds, cached."""
    key = (placements is layout.grad_placements, shape, stride, dtype)
    spec = layout.specs.get(key)
    if spec is None:
        if len(layout.specs) >= _SPECS_PER_LAYOUT:
            layout.specs.clear()
        spec = layout.specs[key] = _torch_compat.dtensor_spec(layout.mesh, placements, shape, stride, dtype)
    return spec


def routing(weight, bias, layout: NormLayout):
    """(reducer, [(input index, param)], group) for the params whose grads go to a reducer
    (`grad_routing.routed_params`); None if there are none."""
    if len(layout.token_mesh_dims) != 1:
        return None
    reducer, routed = routed_params((weight, bias))
    if reducer is None:
        return None
    return reducer, [(i + 1, (weight, bias)[i]) for i in routed], layout.mesh.get_group(layout.token_mesh_dims[0])


def _local_param(p, n: int, fp32: bool):
    """This rank's param as the kernels take it; an fp32 copy where its grad goes to a reducer (fp32 partial sums)."""
    if p is None:
        return None
    local = as_param(p.to_local() if isinstance(p, DTensor) else p, n)
    return local.float() if fp32 and local.dtype != torch.float32 else local


def _wrap(t, layout: NormLayout, meta: tuple, dtype):
    """A local result ([M, N] rows of x's local shape) as a DTensor laid out like x, in `dtype`."""
    shape, stride, local_shape = meta[:3]
    t = t.view(local_shape).to(dtype)
    return _torch_compat.dtensor_with_spec(t, _spec(layout, layout.placements, shape, stride, dtype))


class TokenShardedNorm(torch.autograd.Function):
    """apply(x, weight, bias, residual, eps, rms, zero_centered, layout, n, route) -> (y, z or None, z's local rows
    or None): y and z DTensors like x.

    x and residual: DTensors with `layout`'s placements, their local tensors plain (or a collective's pending
    result); `n`: the normalized numel; `route`: `routing(weight, bias, layout)`, taken where grad mode is as the
    caller has it. Shapes, dtypes and placements were checked by the caller."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms, zero_centered, layout, n, route):
        routed = {i for i, _ in route[1]} if route else ()
        x_local = x.to_local()  # grad mode is off in forward: the local tensor itself
        x2d = as_rows(ops._ready(x_local), n)
        r2d = as_rows(ops._ready(residual.to_local()), n) if residual is not None else None
        w, b = _local_param(weight, n, 1 in routed), _local_param(bias, n, 2 in routed)
        y, z, mean, rstd = ops._forward(x2d, w, b, r2d, eps, rms, zero_centered)
        meta = ctx.meta = (x.shape, x.stride(), x_local.shape, x.dtype,
                           residual.dtype if residual is not None else None)
        y = _wrap(y, layout, meta, y.dtype)
        src = x2d
        if residual is not None:
            # z's rows are a third output, for the backward to save: a create_graph backward's grads then
            # depend on z through this node (saving the DTensor z instead costs a DTensor dispatch each way)
            src, z = z.view_as(z), _wrap(z, layout, meta, z.dtype)
        # the ops' prefix (`ops._save`): the rows the kernel read (x's, or z = x + residual), the weight as it read
        # it, the statistics; then the DTensor x (a create_graph backward's grads depend on it) and the params as
        # passed
        ctx.save_for_backward(src, w, mean, rstd, x if residual is None else None, weight, bias)
        ctx.flags = (bias is not None, residual is not None, rms, zero_centered, eps)
        ctx.layout, ctx.route, ctx.n = layout, route, n
        ctx.set_materialize_grads(False)
        return y, z, (src if residual is not None else None)

    @staticmethod
    def backward(ctx, dy, dz, dsrc):
        if torch.is_grad_enabled():
            return _create_graph_grads(ctx, dy, dz, dsrc)
        src, w, mean, rstd, _, weight, bias = ctx.saved_tensors
        has_bias, has_residual, rms, zero_centered, _ = ctx.flags
        layout, meta = ctx.layout, ctx.meta
        dy = _local_rows(dy, layout, ctx.n)
        if dy is None:  # only z was used
            dy = torch.zeros(src.shape, dtype=meta[3], device=src.device)
        dz = _sum(_local_rows(dz, layout, ctx.n), dsrc) if has_residual else None
        run_bwd = ops._backward_kernels if ops._eager_ok(dy, dz) else ops.norm_bwd
        dx, dweight, dbias = run_bwd(dy, dz, src, w, mean, rstd, has_bias, rms, zero_centered)
        dweight, dbias = _param_grads(ctx, weight, bias, dweight, dbias, _param_grad)
        return (_wrap(dx, layout, meta, meta[3]), dweight, dbias,
                _wrap(dx, layout, meta, meta[4]) if has_residual else None, None, None, None, None, None, None)


def _param_grads(ctx, weight, bias, dweight, dbias, as_grad):
    """What autograd gets for weight and bias: None for those routed to a reducer (their grads go to it here)."""
    grads = [None, dweight if weight is not None else None, dbias if bias is not None else None]
    if ctx.route is not None:
        reducer, routed, group = ctx.route
        reducer.add([p for _, p in routed], [grads[i] for i, _ in routed], group)
        for i, _ in routed:
            grads[i] = None
    return tuple(as_grad(grads[i], p, ctx.layout) if grads[i] is not None and ctx.needs_input_grad[i] else None
                 for i, p in ((1, weight), (2, bias)))


def _local_rows(grad, layout: NormLayout, n: int):
    """An output's grad as local [M, N] rows laid out like x (redistributed first if it came otherwise)."""
    if grad is None:
        return None
    if tuple(grad.placements) != layout.placements:
        grad = grad.redistribute(layout.mesh, layout.placements)
    return as_rows(ops._ready(grad.to_local()), n)


def _param_grad(grad, param, layout: NormLayout):
    """A weight/bias grad as autograd takes it for `param`: `Partial` over the token mesh dims for a DTensor."""
    if not isinstance(param, DTensor):
        return grad.view(param.shape)
    spec = _spec(layout, layout.grad_placements, param.shape, param.stride(), grad.dtype)
    return _torch_compat.dtensor_with_spec(grad.view(param.to_local().shape), spec)


def _param_grad_differentiable(grad, param, layout: NormLayout):
    if not isinstance(param, DTensor):
        return grad.view(param.shape)
    return DTensor.from_local(grad.view(param.to_local().shape), layout.mesh, layout.grad_placements,
                              shape=param.shape, stride=param.stride())


def _sum(a, b):
    return b if a is None else a if b is None else a + b


def _create_graph_grads(ctx, dy, dz, dsrc):
    """The grads as differentiable functions of dy, dz, the norm's input (or z) and its params, as the composed
    path (`to_local`, the reference backward's torch ops, `DTensor.from_local`, `route_to_reducer`) computes them."""
    src, _, _, _, x, weight, bias = ctx.saved_tensors
    has_bias, has_residual, rms, zero_centered, eps = ctx.flags
    layout, n, (shape, stride, local_shape, x_dtype, residual_dtype) = ctx.layout, ctx.n, ctx.meta
    if not has_residual:
        src = as_rows(x.to_local(), n)
    params = tuple(p.to_local(grad_placements=layout.grad_placements) if isinstance(p, DTensor) else p
                   for p in (weight, bias))
    if ctx.route is not None:
        params = route_to_reducer((weight, bias), params, ctx.route[2])
    w = as_param(params[0], n)

    def rows(grad):
        if grad is None:
            return None
        if tuple(grad.placements) != layout.placements:
            grad = grad.redistribute(layout.mesh, layout.placements)
        return as_rows(grad.to_local(), n)

    dy = rows(dy)
    if dy is None:
        dy = torch.zeros(src.shape, dtype=x_dtype, device=src.device)
    mean, rstd = reference.statistics(src, eps, rms)
    dx, dweight, dbias = reference.norm_bwd(dy, _sum(rows(dz), dsrc) if has_residual else None, src, w, mean, rstd,
                                            has_bias, rms, zero_centered)
    dweight, dbias = _param_grads(ctx, weight, bias, dweight, dbias, _param_grad_differentiable)

    def as_dtensor(t, dtype):
        return DTensor.from_local(t.view(local_shape).to(dtype), layout.mesh, layout.placements, shape=shape,
                                  stride=stride)

    return (as_dtensor(dx, x_dtype), dweight, dbias, as_dtensor(dx, residual_dtype) if has_residual else None,
            None, None, None, None, None, None)
