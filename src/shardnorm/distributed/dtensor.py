"""shardnorm's LayerNorm/RMSNorm for DTensor inputs: unwrap, the norm's one node (`ops.norm`), rewrap.

Token-sharded inputs (rows sharded or replicated, normalized dims whole) run the node on their local rows. Weight/bias
grads are partial sums over the token mesh dim: they go to the model's reducer through its grad sinks (arguments of
the node, `reducer.py`), or, without a reducer, to autograd as `Partial`. Two ways to the same node:

- eager (no trace, no dispatch mode, plain local tensors): the node takes the DTensors themselves and a
  `TokenShards`, which unwraps them and wraps its results with cached specs. Composed from `to_local` and
  `DTensor.from_local` instead, an eager call records four to six autograd nodes, each building and checking a spec
  (forward 1.5-1.8x torch's `SequenceParallel` host time on a CPU, a table since removed from benchmarks/results:
  `git show 11e21bc:benchmarks/results/cpu-torch2.13/host_time_dtensor.md`);
- traced or under a dispatch mode: `to_local`, the node on plain tensors, `DTensor.from_local`, all of which Dynamo
  traces.

Hidden-sharded inputs (a normalized dim sharded) need their statistics all-reduced between the two halves of the
norm, which the fused kernels cannot do: `hidden_sharded.py` computes them with torch ops.
"""

import torch
from torch.distributed.tensor import DTensor

from shardnorm import _torch_compat, ops
from shardnorm.distributed.grad_sources import grad_sink
from shardnorm.distributed.hidden_sharded import HiddenShardedNorm
from shardnorm.distributed.layout import NormLayout, global_normalized_numel, norm_layout
from shardnorm.rows import as_dtensor, as_param, as_rows, cached_spec, contiguous_strides, dtensor_like



def norm_dtensor(x: DTensor, weight, bias, residual, eps: float, rms: bool, zero_centered: bool,
                 normalized_shape: tuple):
    """Normalize DTensor `x` (plus `residual`) over its trailing `normalized_shape` dims; returns
    (y, x + residual or None) as DTensors like x. Shapes, dtypes and eps were checked by the caller
    (`shardnorm.functional`); this checks placements."""
    layout = norm_layout(x, weight, bias, residual, normalized_shape)
    n = global_normalized_numel(x, layout)
    if layout.hidden_mesh_dim is not None:
        return _hidden_sharded(x, weight, bias, residual, eps, rms, zero_centered, layout, n)
    sinks = _sinks(weight, bias, layout)
    if _one_node_ok(x, weight, bias, residual):
        return ops.norm(x, weight, bias, residual, eps, rms, zero_centered, sinks,
                        TokenShards(layout, weight, bias, n))
    x_local = x.to_local()
    w, b = _local_params(weight, bias, layout, n, sinks)
    y, z = ops.norm(as_rows(x_local, n), w, b, as_rows(residual.to_local(), n) if residual is not None else None,
                    eps, rms, zero_centered, sinks)
    return _from_local(y, x, x_local), (_from_local(z, x, x_local) if z is not None else None)


def _sinks(weight, bias, layout: NormLayout) -> tuple:
    """The reducer's grad sinks of weight and bias ((None, None) without a reducer, or with grads off). Their
    grads are partial sums over the single token mesh dim; rows sharded over several mesh dims give `Partial`
    grads to autograd instead."""
    if len(layout.token_mesh_dims) != 1 or not torch.is_grad_enabled():
        return None, None
    sinks = tuple(grad_sink(p) if p is not None and p.requires_grad else None for p in (weight, bias))
    if not torch.compiler.is_compiling():
        group = layout.mesh.get_group(layout.token_mesh_dims[0])
        for name, sink in zip(("weight", "bias"), sinks):
            if sink is not None and sink.group is not group:
                raise ValueError(f"shardnorm: this norm's {name} is reduced over another process group than the "
                                 f"one its input x is sharded over ({layout.mesh}); call attach_reducer(model) "
                                 "again after parallelizing")
    return tuple(None if s is None else s.tensor for s in sinks)


def _one_node_ok(x, weight, bias, residual) -> bool:
    """Whether the node may take the DTensors themselves: eager (not traced, no dispatch mode, which must see the
    ops) on local tensors the kernels can read."""
    if torch.compiler.is_compiling() or _torch_compat.ops_observed():
        return False
    local = _torch_compat.dtensor_local
    return ops._eager_ok(local(x), local(residual) if residual is not None else None,
                         local(weight) if isinstance(weight, DTensor) else weight,
                         local(bias) if isinstance(bias, DTensor) else bias)


def _local_params(weight, bias, layout: NormLayout, n: int, sinks: tuple) -> tuple:
    """This rank's weight/bias as the op takes them; grads flowing back through them are `Partial` over the
    token mesh dims. Where a sink takes a parameter's grad, a compiled call cuts the parameter off autograd, so
    that nothing can reach its `.grad` but the reducer: a `Partial` `.grad` there (seen in compiled steps on
    GPUs) makes the reducer add into a DTensor, a redistribution per parameter per step, and stash slot by
    slot. (Its create_graph backward, which differentiates the weight again, does not run under compile.)"""
    compiling = torch.compiler.is_compiling()
    return tuple(as_param(_local(p, layout, cut=compiling and sink is not None), n)
                 for p, sink in zip((weight, bias), sinks))


def _local(p, layout: NormLayout, cut: bool):
    if not isinstance(p, DTensor):
        return p
    return p.detach().to_local() if cut else p.to_local(grad_placements=layout.grad_placements)


def _from_local(t, x: DTensor, x_local):
    """A result `t` (contiguous rows) as a DTensor laid out like x: its global stride the contiguous one, whatever
    x's (a transposed x's stride over a contiguous result would make views of it fail)."""
    return as_dtensor(t.view(x_local.shape), x.device_mesh, x.placements, x.shape, contiguous_strides(x.shape))


def _hidden_sharded(x, weight, bias, residual, eps, rms, zero_centered, layout: NormLayout, n: int):
    x_local = x.to_local()
    x2d = _hidden_rows(x_local, layout)
    z = x2d + _hidden_rows(residual.to_local(), layout) if residual is not None else None
    # weight/bias grads: partial sums over the rows' mesh dims (a 2-D mesh's dp or cp dim), sharded like the hidden dim
    w, b = (p.to_local(grad_placements=layout.grad_placements).reshape(-1) if p is not None else None
            for p in (weight, bias))
    group = layout.mesh.get_group(layout.hidden_mesh_dim)
    y = HiddenShardedNorm.apply(x2d if z is None else z, w, b, eps, rms, zero_centered, group, n)
    return _from_local(y, x, x_local), (_from_local(z, x, x_local) if z is not None else None)


def _hidden_rows(local, layout: NormLayout):
    """A hidden-sharded input's local part as [rows, this rank's columns], also where an uneven shard leaves this
    rank no columns (`as_rows` cannot infer the rows of an empty row)."""
    columns = local.shape[local.dim() - layout.normalized_ndim:].numel()
    if columns:
        return as_rows(local, columns)
    return local.reshape(local.shape[:local.dim() - layout.normalized_ndim].numel(), 0)


def _spec(layout: NormLayout, placements: tuple, shape, stride: tuple, dtype: torch.dtype):
    """The DTensorSpec `DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)` builds, cached (the
    placements are x's or the grads' of this layout)."""
    return cached_spec(layout.specs, placements is layout.grad_placements, layout.mesh, placements, shape, stride,
                       dtype)


class TokenShards:
    """One eager token-sharded call's DTensor side, for the norm's node (`ops._NormFunction`): its inputs' local
    rows and parameters, its results as DTensors laid out like x (specs cached per layout), its output grads as
    local rows, and its parameter grads as `Partial` DTensors."""

    __slots__ = ("layout", "n", "params", "meta", "dtypes")

    def __init__(self, layout: NormLayout, weight, bias, n: int):
        self.layout, self.n, self.params = layout, n, (weight, bias)

    def unwrap(self, x, weight, bias, residual) -> tuple:
        """(x rows, weight, bias, residual rows) as the kernels read them (grad mode is off in a node's forward)."""
        local = _torch_compat.dtensor_local
        x_local = local(x)
        self.meta = (x.shape, x_local.shape)
        self.dtypes = (x.dtype, residual.dtype if residual is not None else None)
        n = self.n
        w, b = (as_param(local(p) if isinstance(p, DTensor) else p, n) for p in (weight, bias))
        return as_rows(x_local, n), w, b, (as_rows(local(residual), n) if residual is not None else None)

    def wrap(self, rows, dtype):
        """Local rows as a DTensor laid out like x, in `dtype` (differentiable where grad mode is on: a create_graph
        backward's grads), its global stride the contiguous one whatever x's (the rows are contiguous)."""
        shape, local_shape = self.meta
        t = rows.view(local_shape).to(dtype)
        layout = self.layout
        if torch.is_grad_enabled():
            return as_dtensor(t, layout.mesh, layout.placements, shape, contiguous_strides(shape))
        return _torch_compat.dtensor_with_spec(t, _spec(layout, layout.placements, shape, None, dtype))

    def rows(self, t, differentiable: bool = False):
        """An output (or its grad) as local rows laid out like x (redistributed first if it came otherwise)."""
        if t is None:
            return None
        layout = self.layout
        if tuple(t.placements) != layout.placements:
            t = t.redistribute(layout.mesh, layout.placements)
        local = t.to_local() if differentiable else ops._ready(_torch_compat.dtensor_local(t))
        return as_rows(local, self.n)

    def param(self, p):
        """A parameter as a differentiable local vector (a create_graph backward's)."""
        if isinstance(p, DTensor):
            p = p.to_local(grad_placements=self.layout.grad_placements)
        return as_param(p, self.n)

    def param_grad(self, grad, index: int):
        """A weight (0) / bias (1) grad as autograd takes it: `Partial` over the token mesh dims for a DTensor."""
        if grad is None:
            return None
        param = self.params[index]
        if not isinstance(param, DTensor):
            return grad.view(param.shape)
        layout, local = self.layout, grad.view(_torch_compat.dtensor_local(param).shape)
        if torch.is_grad_enabled():
            return dtensor_like(local, param, layout.grad_placements)
        return _torch_compat.dtensor_with_spec(local, _spec(layout, layout.grad_placements, param.shape,
                                                            param.stride(), grad.dtype))
