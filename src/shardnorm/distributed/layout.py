"""Where a norm's input lives on a DeviceMesh, and what that implies for its statistics and grads.

Every mesh dim of the input is a *token* dim (``Shard`` of a leading dim: each rank normalizes its own rows,
weight/bias grads are partial sums over them), the *hidden* dim (``Shard`` of a normalized dim: statistics
need a cross-rank all-reduce, weight/bias are sharded to match) or ``Replicate``. Anything else (``Partial``,
strided shards) is rejected by name.
"""

import functools
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .._torch_compat import is_block_shard


@dataclass(frozen=True)
class NormLayout:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]  # x's
    normalized_ndim: int
    token_mesh_dims: tuple[int, ...]  # weight/bias grads are partial sums over these mesh dims
    hidden_mesh_dim: int | None  # statistics are all-reduced over this mesh dim
    param_placements: tuple[Placement, ...]  # what weight/bias must be on the mesh
    grad_placements: tuple[Placement, ...]  # their grads' placements: Partial over the token mesh dims
    # DTensorSpecs of the inputs' and grads' layouts (`rows.cached_spec`, from `dtensor.TokenShards`)
    specs: dict = field(default_factory=dict, compare=False, repr=False)


def norm_layout(x: DTensor, weight, bias, residual, normalized_shape: tuple) -> NormLayout:
    """Classify x's placements and check that weight, bias and residual agree with them (their
    shapes were checked against `normalized_shape` by `shardnorm.functional`)."""
    # traced: the plain function (Dynamo traces through a cache and warns that it did)
    classify = _classify.__wrapped__ if torch.compiler.is_compiling() else _classify
    layout = classify(x.device_mesh, tuple(x.placements), x.dim(), len(normalized_shape))
    for name, p in (("weight", weight), ("bias", bias)):
        _check_param(name, p, x, layout)
    if residual is not None:
        if not isinstance(residual, DTensor) or residual.device_mesh != x.device_mesh \
                or tuple(residual.placements) != tuple(x.placements):
            got = tuple(residual.placements) if isinstance(residual, DTensor) else "a plain torch.Tensor"
            raise ValueError(f"shardnorm: residual must be a DTensor on x's mesh with x's placements "
                             f"{tuple(x.placements)}, got {got}")
    return layout


@functools.lru_cache(maxsize=256)
def _classify(mesh: DeviceMesh, placements: tuple, ndim: int, normalized_ndim: int) -> NormLayout:
    """The layout of every input with these placements: a model's norms share a few (cached: every eager norm
    call asks)."""
    first_normalized = ndim - normalized_ndim
    token_dims, hidden_dims, param_placements = [], [], []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            param_placements.append(Replicate())
        elif is_block_shard(p):
            dim = p.dim % ndim
            if dim < first_normalized:
                token_dims.append(mesh_dim)
                param_placements.append(Replicate())
            else:
                hidden_dims.append(mesh_dim)
                param_placements.append(Shard(dim - first_normalized))
        else:
            raise NotImplementedError(
                f"shardnorm: x has placement {p} on mesh dim {mesh_dim}; supported are Shard(d) and "
                f"Replicate(). Redistribute x first (e.g. x.redistribute(placements=[Shard(1)]) for a "
                f"Partial sum)."
            )
    if len(hidden_dims) > 1:
        raise NotImplementedError(
            f"shardnorm: x is sharded on its normalized dims over mesh dims {hidden_dims} "
            f"(placements {placements}); at most one mesh dim may shard the normalized dims."
        )
    token_dims = tuple(token_dims)
    grad_placements = tuple(Partial() if d in token_dims else p for d, p in enumerate(param_placements))
    return NormLayout(mesh, placements, normalized_ndim, token_dims, hidden_dims[0] if hidden_dims else None,
                      tuple(param_placements), grad_placements)


def _check_param(name: str, p, x: DTensor, layout: NormLayout) -> None:
    if p is None:
        return
    if isinstance(p, DTensor):
        if p.device_mesh != layout.mesh:
            raise ValueError(f"shardnorm: {name} lives on {p.device_mesh}, x on {layout.mesh}")
        if tuple(p.placements) != layout.param_placements:
            raise ValueError(
                f"shardnorm: {name} has placements {tuple(p.placements)}, but x's placements "
                f"{tuple(x.placements)} need {layout.param_placements} (Replicate where x shards tokens "
                f"or is replicated, Shard matching x where x shards the normalized dims)"
            )
        return
    # A plain tensor next to a DTensor input: only for Megatron-style params (replicated on every rank,
    # marked `sequence_parallel` so that shardnorm's reducer or Megatron sums their grads), or frozen ones.
    if layout.hidden_mesh_dim is not None or (p.requires_grad and not getattr(p, "sequence_parallel", False)):
        raise ValueError(
            f"shardnorm: {name} is a plain torch.Tensor but x is a DTensor with placements "
            f"{tuple(x.placements)}; make {name} a DTensor with placements {layout.param_placements} "
            f"(e.g. with shardnorm.distributed.SequenceParallelNorm) or use the process-group mode "
            f"shardnorm.distributed.process_group_sequence_parallel(module, group)"
        )


def global_normalized_numel(x: DTensor, layout: NormLayout) -> int:
    return int(torch.Size(x.shape[x.dim() - layout.normalized_ndim:]).numel())
