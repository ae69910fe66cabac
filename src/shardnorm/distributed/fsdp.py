"""shardnorm models under FSDP: FSDP1 wrap policy and fp32-norm mixed precision, FSDP2 `shard_model`,
gradient accumulation without communication, checkpoints that refuse to drop accumulated grads.

One FSDP unit per transformer block (given, or found as the repeated child modules that contain a
norm) plus the root; a norm is never a unit of its own. Under FSDP2 × TP the sequence-parallel norm
grads are reduced over dp by FSDP, then over tp by shardnorm (see `fsdp_norm_grads`).
"""

from collections import Counter
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (FSDPModule, FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy,
                                    fully_shard)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardnorm._torch_compat import deferred_module_wrap_policy, fsdp1_mixed_precision
from shardnorm.distributed.accumulation import _ATTR as _REDUCER_ATTR
from shardnorm.distributed.accumulation import accumulate
from shardnorm.distributed.fsdp_checkpoint import load, pending_grads, save
from shardnorm.distributed.fsdp_norm_grads import FSDPNormGradReducer
from shardnorm.modules import LayerNorm, RMSNorm

NORM_CLASSES = (nn.LayerNorm, nn.RMSNorm)  # torch's and shardnorm's (which subclass them)
SHARDNORM_CLASSES = (LayerNorm, RMSNorm)

__all__ = ["FSDPNormGradReducer", "auto_wrap_policy", "find_block_classes", "load", "no_sync",
           "norm_mixed_precision", "pending_grads", "save", "shard_model"]


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

    FSDP1 flattens a unit's params into one flat parameter of one dtype, so the only way it keeps norms
    in fp32 inside a bf16 model is `_module_classes_to_ignore`: FSDP then wraps each norm as its own
    full-precision unit (a small extra all-gather and reduce-scatter per norm) and casts its inputs to
    fp32. Opt-in for that reason; `auto_wrap_policy` alone never makes a norm a unit. (FSDP2: use
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: norm grads accumulate and reduce in
    fp32, and shardnorm's math is fp32 whatever the param dtype.)
    """
    return fsdp1_mixed_precision(param_dtype, reduce_dtype, param_dtype, full_precision_classes=NORM_CLASSES)


# ---- FSDP2 ---------------------------------------------------------------------------------------------

def _dp_tp_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    if mesh.ndim == 1:
        return mesh, None
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 2 and set(names) == {"dp", "tp"}:
        return mesh["dp"], mesh["tp"]
    raise ValueError(f"shardnorm: shard_model needs a 1-D data-parallel mesh or a 2-D mesh with dims "
                     f"named ('dp', 'tp'), got {mesh}")


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


def _norm_guard(fqn: str, reducer: FSDPNormGradReducer | None, sequence_parallel: bool):
    """Forward pre-hook: the norm must see FSDP's unsharded params; the reducer takes those over.

    Parameters are told apart by an attribute, not by `id()`: inside a compiled block an `id()` check
    becomes a guard on each layer's own parameter, and dynamo recompiles the block per layer.
    """

    def hook(module: nn.Module, args):
        for name, p in module.named_parameters(recurse=False):
            if getattr(p, _FSDP_SHARDED, False):
                raise RuntimeError(
                    f"shardnorm: {fqn}.{name} is still FSDP-sharded (placements "
                    f"{tuple(getattr(p, 'placements', ()))}) when its norm runs: FSDP all-gathers it only "
                    f"inside the forward of the FSDP unit that holds it; call the norm through that unit")
            if sequence_parallel and reducer is not None:
                reducer.track(p)

    return hook


def shard_model(model: nn.Module, mesh: DeviceMesh, block_classes=None,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True, *,
                bucket_cap_mb: float = 1.0) -> nn.Module:
    """`fully_shard` each transformer block, then the root, over the dp mesh; after tensor parallelism.

    `mesh`: 1-D (dp), or 2-D with dims ("dp", "tp") where norms were parallelized over mesh["tp"] (e.g.
    `SequenceParallelNorm`). Then their grads are reduced over dp by FSDP and over tp by the model's
    `FSDPNormGradReducer` (driven by `shardnorm.accumulate` / `finalize_grads` / `no_sync`). Returns `model`.
    """
    dp_mesh, tp_mesh = _dp_tp_meshes(mesh)
    blocks = _checked_block_classes(model, block_classes)
    old = getattr(model, _REDUCER_ATTR, None)
    if old is not None and old.has_pending:
        raise RuntimeError("shardnorm: the model's norm-grad reducer holds accumulated grads; call "
                           "shardnorm.finalize_grads(model) before shard_model")
    norms = [(fqn, m, any([_sequence_parallel(f"{fqn}.{n}", p, dp_mesh) for n, p in m.named_parameters()]))
             for fqn, m in model.named_modules() if isinstance(m, SHARDNORM_CLASSES)]
    if any(sp for *_, sp in norms) and (tp_mesh is None or tp_mesh.size() == 1):
        raise ValueError("shardnorm: the model has sequence-parallel norms but shard_model got no tp mesh of "
                         "size > 1; pass the 2-D ('dp', 'tp') mesh they were parallelized on")
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    for module in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)

    sp_params = [p for _, m, sp in norms if sp for p in m.parameters(recurse=False)]
    reducer = None
    if sp_params:
        for p in sp_params:  # FSDP's new sharded params: what Megatron-style code inspects
            p.sequence_parallel = True
        reducer = FSDPNormGradReducer(sp_params, tp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb)
        setattr(model, _REDUCER_ATTR, reducer)
    for fqn, module, sp in norms:
        for p in module.parameters(recurse=False):
            setattr(p, _FSDP_SHARDED, True)  # FSDP's sharded params; its unsharded ones lack the mark
        module.register_forward_pre_hook(_norm_guard(fqn, reducer, sp))
    return model


# ---- gradient accumulation -----------------------------------------------------------------------------

@contextmanager
def no_sync(model: nn.Module):
    """Backward passes in this context reduce nothing: not FSDP over dp, not shardnorm over tp.

    The first backward outside it reduces everything accumulated, each reduction once. Works for
    FSDP2 (`set_requires_gradient_sync`), FSDP1 (`no_sync`) and unwrapped models.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            with accumulate(model):
                yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, FullyShardedDataParallel):
        with model.no_sync(), accumulate(model):
            yield
    else:
        with accumulate(model):
            yield
