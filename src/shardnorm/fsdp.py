"""shardnorm models under FSDP: FSDP1 wrap policy and fp32-norm mixed precision, FSDP2 `shard_model`,
checkpoints that refuse to drop accumulated grads (docs/distributed.md).

One FSDP unit per transformer block plus the root; a norm is never a unit of its own.
"""

from collections import Counter

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardnorm._torch_compat import (concatenate_meshes, deferred_module_wrap_policy, flatten_mesh,
                                     fsdp1_mixed_precision)
from shardnorm.distributed.accumulation import attach_reducer, refuse_pending
from shardnorm.distributed.fsdp_checkpoint import load, pending_grads, save
from shardnorm.distributed.fsdp_norm_grads import FSDPShardedGrads
from shardnorm.distributed.reducer import DEFAULT_BUCKET_CAP_MB, NormGradReducer
from shardnorm.modules import LayerNorm, RMSNorm

NORM_CLASSES = (nn.LayerNorm, nn.RMSNorm)  # torch's and shardnorm's (which subclass them)
SHARDNORM_CLASSES = (LayerNorm, RMSNorm)

__all__ = ["auto_wrap_policy", "find_block_classes", "install_norm_grad_reducer", "load", "norm_mixed_precision",
           "pending_grads", "save", "shard_model"]


# ---- which modules become FSDP units -------------------------------------------------------------------

def _has_norm(module: nn.Module) -> bool:
    return any(isinstance(m, NORM_CLASSES) for m in module.modules())


def find_block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of the model's transformer blocks: repeated siblings that contain a norm, outermost only."""
    found: list[type[nn.Module]] = []
    for parent in model.modules():
        children = list(parent.children())
        for cls, count in Counter(type(c) for c in children).items():
            if count >= 2 and cls not in found and not issubclass(cls, NORM_CLASSES) \
                    and any(type(c) is cls and _has_norm(c) for c in children):
                found.append(cls)
    names = {cls: [n for n, m in model.named_modules() if type(m) is cls] for cls in found}
    inner = {cls for cls in found
             if all(any(n.startswith(o + ".") for other in found if other is not cls for o in names[other])
                    for n in names[cls])}
    blocks = tuple(cls for cls in found if cls not in inner)
    if not blocks:
        raise ValueError(f"shardnorm: found no repeated module class containing a norm in "
                         f"{type(model).__name__}; pass block_classes=(YourBlock,)")
    return blocks


def _checked_block_classes(model: nn.Module, classes) -> tuple[type[nn.Module], ...]:
    classes = tuple(classes) if classes else find_block_classes(model)
    for cls in classes:
        if issubclass(cls, NORM_CLASSES):
            raise ValueError(f"shardnorm: {cls.__name__} is a norm; a norm stays inside its block's FSDP "
                             f"unit (a unit per norm costs a tiny all-gather and reduce-scatter each)")
    if not any(isinstance(m, classes) for m in model.modules()):
        raise ValueError(f"shardnorm: no module of {[c.__name__ for c in classes]} in {type(model).__name__}")
    return classes


# ---- FSDP1 ---------------------------------------------------------------------------------------------

def _block_classes_for_fsdp1(given):
    """What FSDP1 wraps, decided when it applies the policy to the model: the transformer blocks."""

    def choose(root_module: nn.Module, root_kwargs: dict):
        if root_kwargs.get("use_orig_params"):
            for fqn, m in root_module.named_modules():
                if isinstance(m, SHARDNORM_CLASSES) and any(isinstance(p, DTensor) for p in m.parameters()):
                    raise NotImplementedError(
                        f"shardnorm: FSDP1 × tensor parallelism with use_orig_params=True is not supported "
                        f"(norm {fqn} has DTensor params; torch's FSDP1 fails on DTensor params in this mode, "
                        f"torch norms too): pass use_orig_params=False, or use shardnorm.fsdp.shard_model")
        return _checked_block_classes(root_module, given)

    return choose


def auto_wrap_policy(block_classes=None) -> ModuleWrapPolicy:
    """For `FullyShardedDataParallel(model, auto_wrap_policy=...)`: one unit per block, the rest at the root.

    The blocks are `block_classes`, or found in the model FSDP wraps."""
    return deferred_module_wrap_policy(_block_classes_for_fsdp1(tuple(block_classes) if block_classes else None))


def norm_mixed_precision(param_dtype: torch.dtype = torch.bfloat16,
                         reduce_dtype: torch.dtype = torch.float32) -> MixedPrecision:
    """FSDP1 `MixedPrecision` that keeps norm params, their grads and their reduction in fp32.

    Opt-in: FSDP1 keeps them in fp32 only by making each norm its own full-precision unit (a small extra
    all-gather and reduce-scatter per norm; docs/distributed.md). Under FSDP2 use `MixedPrecisionPolicy`.
    """
    return fsdp1_mixed_precision(param_dtype, reduce_dtype, param_dtype, full_precision_classes=NORM_CLASSES)


# ---- FSDP2 ---------------------------------------------------------------------------------------------

DimNames = str | tuple[str, ...] | list[str]


def _names(setting: str, value: DimNames | None) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value or ())
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"shardnorm: {setting} must be a mesh dim name or a tuple of them, got {value!r}")
    return names


def _submesh(mesh: DeviceMesh, setting: str, names: tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]` (flattened dims such as torchtitan's "fsdp" included), or an error naming `setting`."""
    try:
        return mesh[names[0] if len(names) == 1 else names]
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"shardnorm: {setting}={names if len(names) > 1 else names[0]!r} is not a dim of the "
                         f"mesh (dims {mesh.mesh_dim_names}): {e}") from None


def _dp_tp_meshes(mesh: DeviceMesh, dp_dims: DimNames | None = "dp", tp_dim: str | None = "tp",
                  replicate_dim: str | None = None) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The mesh FSDP shards over (1-D, or 2-D replicate x shard for HSDP) and the tensor-parallel mesh.

    A 1-D mesh is the data-parallel mesh whatever its name. Several `dp_dims` (torchtitan's ("dp_shard",
    "cp")) are flattened into one shard dim, so FSDP reduces the norm grads over context parallelism too.
    """
    names = mesh.mesh_dim_names or ()
    shard = _names("dp_dims", dp_dims)
    if mesh.ndim == 1 and (not names or names[0] != tp_dim) and replicate_dim is None:
        return mesh, None
    if not shard:
        raise ValueError(f"shardnorm: shard_model got no data-parallel dim (dp_dims={dp_dims!r}) for the mesh "
                         f"with dims {names}; name the dim(s) FSDP shards over, e.g. dp_dims='dp_shard'")
    if not names:
        raise ValueError(f"shardnorm: shard_model needs a 1-D mesh or a mesh with named dims, got {mesh}")
    if tp_dim is not None and tp_dim in shard + ((replicate_dim,) if replicate_dim else ()):
        raise ValueError(f"shardnorm: tp_dim={tp_dim!r} is also a data-parallel dim (dp_dims={shard}, "
                         f"replicate_dim={replicate_dim!r})")
    shard_mesh = _submesh(mesh, "dp_dims", shard)
    if len(shard) > 1:
        shard_mesh = flatten_mesh(shard_mesh, "_".join(shard))
    dp_mesh = shard_mesh
    if replicate_dim is not None:
        _submesh(mesh, "replicate_dim", (replicate_dim,))
        dp_mesh = mesh[(replicate_dim, shard[0])] if len(shard) == 1 else \
            concatenate_meshes([mesh[replicate_dim], shard_mesh])
    tp_mesh = None
    if tp_dim is not None and (tp_dim in names or tp_dim != "tp"):
        tp_mesh = _submesh(mesh, "tp_dim", (tp_dim,))
    covered = set(shard) | {replicate_dim, tp_dim}
    if mesh.ndim > 1 and not set(names) <= covered:
        raise ValueError(f"shardnorm: mesh dims {[n for n in names if n not in covered]} are neither data-parallel "
                         f"(dp_dims={shard}, replicate_dim={replicate_dim!r}) nor tensor-parallel "
                         f"(tp_dim={tp_dim!r}); name them in one of these settings")
    return dp_mesh, tp_mesh


def _sequence_parallel(fqn: str, param: nn.Parameter, dp_mesh: DeviceMesh) -> bool:
    """Whether a norm param's grads are partial sums over tp; raise for shardings shardnorm cannot reduce."""
    if isinstance(param, DTensor):
        mesh, placements = param.device_mesh, tuple(param.placements)
        if mesh.ndim != 1 or mesh.mesh_dim_names and mesh.mesh_dim_names == dp_mesh.mesh_dim_names:
            raise ValueError(f"shardnorm: norm parameter {fqn} is already a DTensor on {mesh} with placements "
                             f"{placements}; parallelize norms over the tp mesh only (mesh['tp']) and let "
                             f"shard_model shard them over dp")
        if not isinstance(placements[0], Replicate) and type(placements[0]) is not Shard:
            raise ValueError(f"shardnorm: norm parameter {fqn} has placements {placements} on the tp mesh; "
                             f"shardnorm reduces Replicate (sequence-parallel) and Shard (hidden-sharded) norm "
                             f"params only")
        return isinstance(placements[0], Replicate)
    return bool(getattr(param, "sequence_parallel", False))


_FSDP_SHARDED = "_shardnorm_fsdp_sharded"


def _norm_guard(fqn: str, source: FSDPShardedGrads | None, sequence_parallel: bool):
    """Forward pre-hook: the norm must see FSDP's unsharded params; the reducer takes those over. Parameters
    are told apart by an attribute: inside a compiled block an `id()` check would recompile it per layer."""

    def hook(module: nn.Module, args):
        for name, p in module.named_parameters(recurse=False):
            if getattr(p, _FSDP_SHARDED, False):
                raise RuntimeError(
                    f"shardnorm: {fqn}.{name} is still FSDP-sharded (placements "
                    f"{tuple(getattr(p, 'placements', ()))}) when its norm runs: FSDP all-gathers it only "
                    f"inside the forward of the FSDP unit that holds it; call the norm through that unit")
            if sequence_parallel:
                source.track(p)

    return hook


def shard_model(model: nn.Module, mesh: DeviceMesh, block_classes=None,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True, *,
                bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, dp_dims: DimNames = "dp", tp_dim: str | None = "tp",
                replicate_dim: str | None = None) -> nn.Module:
    """`fully_shard` each transformer block, then the root, over the dp mesh; after tensor parallelism.

    `mesh`: 1-D (dp), or named dims: `dp_dims` the dim(s) FSDP shards over (several are flattened into one),
    `replicate_dim` HSDP's replicate dim, `tp_dim` the dim norms were parallelized over. Sequence-parallel
    norm grads are reduced over dp by FSDP and over tp by the model's reducer. Returns `model`.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shardnorm: shard_model needs mesh, a DeviceMesh, got {type(mesh).__name__}")
    dp_mesh, tp_mesh = _dp_tp_meshes(mesh, dp_dims, tp_dim, replicate_dim)
    blocks = _checked_block_classes(model, block_classes)
    refuse_pending(model, "shard_model")
    norms = [(fqn, m, any([_sequence_parallel(f"{fqn}.{n}", p, dp_mesh) for n, p in m.named_parameters()]))
             for fqn, m in model.named_modules() if isinstance(m, SHARDNORM_CLASSES)]
    if any(sp for *_, sp in norms) and tp_mesh is None:
        raise ValueError(f"shardnorm: the model has sequence-parallel norms but shard_model got no tp mesh "
                         f"(tp_dim={tp_dim!r}, mesh dims {mesh.mesh_dim_names}); pass the mesh they were "
                         f"parallelized on and name its tensor-parallel dim in tp_dim")
    if any(sp for *_, sp in norms) and tp_mesh.size() == 1:
        raise ValueError(f"shardnorm: the model's norms are sequence-parallel over the tp dim {tp_dim!r} of size 1; "
                         f"at tp=1 leave them unparallelized (no SequenceParallelNorm in the plan) and shard_model "
                         f"shards them over dp like any other module")
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    for module in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)

    install_norm_grad_reducer(model, norms, tp_mesh, bucket_cap_mb=bucket_cap_mb)
    return model


def install_norm_grad_reducer(model: nn.Module, norms, tp_mesh: DeviceMesh | None, *,
                              bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> NormGradReducer | None:
    """After FSDP2 wrapped `model`: give its sequence-parallel norms the tp reducer and the sharding guard.

    `norms`: (fqn, module, sequence_parallel) for each shardnorm norm, decided before FSDP swapped the
    params (for frameworks that call `fully_shard` themselves: torchtitan).
    """
    sp_params = [p for _, m, sp in norms if sp for p in m.parameters(recurse=False)]
    reducer = source = None
    if sp_params:
        for p in sp_params:  # FSDP's new sharded params: what Megatron-style code inspects
            p.sequence_parallel = True
        source = FSDPShardedGrads(sp_params, tp_mesh.get_group())
        reducer = attach_reducer(model, source=source, bucket_cap_mb=bucket_cap_mb)
    for fqn, module, sp in norms:
        for p in module.parameters(recurse=False):
            setattr(p, _FSDP_SHARDED, True)  # FSDP's sharded params; its unsharded ones lack the mark
        module.register_forward_pre_hook(_norm_guard(fqn, source, sp))
    return reducer
