"""shardnorm's LayerNorm/RMSNorm for DTensor inputs: token-sharded ones on their local rows (weight/bias grads
to the model's reducer, or `Partial` without one), hidden-sharded ones through `hidden_sharded.py`."""

import torch
from torch.distributed.tensor import DTensor

from shardnorm import _torch_compat, ops
from shardnorm.distributed.grad_routing import route_to_reducer
from shardnorm.distributed.hidden_sharded import HiddenShardedNorm
from shardnorm.distributed.layout import NormLayout, global_normalized_numel, norm_layout
from shardnorm.distributed.token_sharded import TokenShardedNorm, routing
from shardnorm.rows import as_rows

_token_sharded_norm = _torch_compat.function_apply(TokenShardedNorm)


def norm_dtensor(x: DTensor, weight, bias, residual, eps: float, rms: bool, zero_centered: bool,
                 normalized_shape: tuple):
    """Normalize DTensor `x` (plus `residual`) over its trailing `normalized_shape` dims; returns
    (y, x + residual or None) as DTensors like x. Shapes, dtypes and eps were checked by the caller
    (`shardnorm.functional`); this checks placements."""
    layout = norm_layout(x, weight, bias, residual, normalized_shape)
    if layout.hidden_mesh_dim is None and _one_node_ok(x, weight, bias, residual):
        n = global_normalized_numel(x, layout)
        return _token_sharded_norm(x, weight, bias, residual, eps, rms, zero_centered, layout, n,
                                   routing(weight, bias, layout))[:2]
    x_local = x.to_local()
    x2d = _rows(x_local, layout)
    r2d = _rows(residual.to_local(), layout) if residual is not None else None
    # after x's to_local: autograd runs later-created nodes first, so the grads reach the reducer (and
    # may launch its bucket) before backward moves on to the previous layer
    w, b = (p.reshape(-1) if p is not None else None for p in _local_params(weight, bias, layout))
    if layout.hidden_mesh_dim is None:
        y, z = ops.norm(x2d, w, b, r2d, eps, rms, zero_centered)
    else:
        z = x2d + r2d if r2d is not None else None
        group = layout.mesh.get_group(layout.hidden_mesh_dim)
        y = HiddenShardedNorm.apply(x2d if z is None else z, w, b, eps, rms, zero_centered, group,
                                    global_normalized_numel(x, layout))

    def as_dtensor(t):
        return DTensor.from_local(t.view(x_local.shape), layout.mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())

    return as_dtensor(y), (as_dtensor(z) if z is not None else None)


def _one_node_ok(x, weight, bias, residual) -> bool:
    """Whether `TokenShardedNorm` may run the call: eager (not traced, no dispatch mode, which must see the ops)
    on local tensors the kernels can read."""
    if torch.compiler.is_compiling() or _torch_compat.dispatch_modes_active():
        return False
    local = _torch_compat.dtensor_local
    return ops._eager_ok(local(x), local(residual) if residual is not None else None,
                         local(weight) if isinstance(weight, DTensor) else weight,
                         local(bias) if isinstance(bias, DTensor) else bias)


def _rows(t: torch.Tensor, layout: NormLayout) -> torch.Tensor:
    """[M, N_local] rows of a local shard, last dim contiguous as the op requires."""
    return as_rows(t, t.shape[t.dim() - layout.normalized_ndim:].numel())


def _local_params(weight, bias, layout: NormLayout):
    """This rank's weight/bias. Their grads are partial sums over the token mesh dims: routed to the
    reducer when one is bound (single token mesh dim), else returned to autograd as `Partial`."""
    local = tuple(p.to_local(grad_placements=layout.grad_placements) if isinstance(p, DTensor) else p
                  for p in (weight, bias))
    if len(layout.token_mesh_dims) != 1:
        return local
    return route_to_reducer((weight, bias), local, layout.mesh.get_group(layout.token_mesh_dims[0]))
