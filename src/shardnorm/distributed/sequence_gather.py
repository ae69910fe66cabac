"""A sequence-parallel norm's all-gather of its output (`SequenceParallelNorm(output_layouts=Replicate())`), on the
local tensors.

`DTensor.redistribute` from `Shard(seq)` to `Replicate()` costs an eager sublayer's host several times what the
collective's own launch does (its spec propagation, its autograd node and the reduce-scatter's redistribute in
backward). `gather_sequence` runs the same collectives on the local tensors, with the layouts DTensor gives them
(outputs and grads bitwise), where nothing needs DTensor's dispatch: eager, one 1-D mesh of more than one rank,
shards even, no dispatch mode. Elsewhere, and under torch.compile (which traces the redistribute), it is the
redistribute itself.
"""

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardnorm import _torch_compat, ops
from shardnorm.rows import cached_spec

_REPLICATE, _PARTIAL_SUM = (Replicate(),), (Partial(),)


def gather_sequence(y: DTensor, owner: nn.Module) -> DTensor:
    """`y.redistribute(placements=(Replicate(),))` for y sharded on one dim of a 1-D mesh; `owner`: the module whose
    output it is, which keeps the specs and the group (`rows.cached_spec`)."""
    if torch.compiler.is_compiling():  # traced: DTensor's redistribute (no side effect on `owner`)
        return y.redistribute(placements=_REPLICATE)
    cache = owner.__dict__.get("_shardnorm_gather")
    if cache is None:
        cache = owner.__dict__["_shardnorm_gather"] = _GatherCache()
    group = cache.get("group")
    if group is None:
        group = cache["group"] = y.device_mesh.get_group(0)
    if not _local_path(y, group.size()):
        return y.redistribute(placements=_REPLICATE)
    return _GatherSequence.apply(y, group, cache)


class _GatherCache(dict):
    """A gathering module's specs and group: a deep copy of the module (an EMA copy) starts with an empty one, as
    process groups do not copy."""

    def __deepcopy__(self, memo):
        return _GatherCache()


def start_gather(local: Tensor, group):
    """This rank's shard all-gathered, launched (`gathered` waits): the forward's gather and the keep_output=False
    consumers' re-gather in backward (`regather.GatheredOutput`) are the same collective."""
    return _torch_compat.all_gather_start(local.contiguous(), group)


def gathered(started, dim: int, world: int, local_shape, shape) -> Tensor:
    """The all-gather from `start_gather`, waited for, laid out as DTensor's `Shard(dim) -> Replicate` lays it out:
    the collective stacks the ranks' shards on dim 0, moved here to `dim` (a view where the dims before it are 1)."""
    out = _torch_compat.collective_result(started)
    return out.view(world, *local_shape).movedim(0, dim).reshape(shape) if dim else out


def _local_path(y, world: int) -> bool:
    if world == 1 or type(y) is not DTensor or y.device_mesh.ndim != 1:  # one rank: the redistribute gathers nothing
        return False
    placement = y.placements[0]
    if not isinstance(placement, Shard) or y.shape[placement.dim] % world:
        return False
    local = _torch_compat.dtensor_local(y)
    if type(local) not in ops._PLAIN and not ops._is_pending(local):
        return False
    return not _torch_compat.ops_observed()


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's shard all-gathered (DTensor's `Shard -> Replicate`: the collective on dim 0, the chunks
    moved to the sharded dim). Backward: a `Partial` grad (the column-parallel consumers' dgrad) reduce-scattered
    back to the shard (DTensor's `Partial -> Shard`: the chunks of the sharded dim stacked on dim 0), a `Replicate`
    one sliced; any other layout, or a backward that builds a graph (create_graph), through `redistribute`."""

    @staticmethod
    def forward(ctx, y: DTensor, group, cache: dict) -> DTensor:
        local = ops._ready(_torch_compat.dtensor_local(y))
        dim, world = y.placements[0].dim % y.dim(), group.size()
        out = gathered(start_gather(local, group), dim, world, local.shape, y.shape)
        ctx.group, ctx.dim, ctx.local_shape, ctx.y_spec = group, dim, local.shape, _torch_compat.dtensor_spec_of(y)
        spec = cached_spec(cache, "gathered", y.device_mesh, _REPLICATE, y.shape, None, y.dtype)
        return _torch_compat.dtensor_with_spec(out, spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec, dim, world = ctx.y_spec, ctx.dim, ctx.group.size()
        if torch.is_grad_enabled() or grad.placements not in (_PARTIAL_SUM, _REPLICATE):
            return grad.redistribute(placements=spec.placements), None, None
        local = ops._ready(_torch_compat.dtensor_local(grad))
        if grad.placements == _REPLICATE:
            size = local.shape[dim] // world
            shard = local.narrow(dim, ctx.group.rank() * size, size).contiguous()
        else:
            if dim:  # the chunks of `dim` one after another on dim 0, as the collective scatters them
                shape = local.shape
                local = local.view(*shape[:dim], world, shape[dim] // world, *shape[dim + 1:]).movedim(dim, 0)
                local = local.reshape(world * shape[:dim].numel(), *local.shape[dim + 1:])
            shard = _torch_compat.collective_result(
                _torch_compat.reduce_scatter_start(local.contiguous(), ctx.group))
            shard = shard.view(ctx.local_shape)
        return _torch_compat.dtensor_with_spec(shard, spec), None, None
