"""shardnorm under Lightning Fabric's `ModelParallelStrategy` (FSDP2 x tensor parallelism).

`parallelize_fn(tp_plan)` converts the model's norms, applies the user's tensor-parallel plan on Fabric's
"tensor_parallel" dim and shards with `shardnorm.fsdp.shard_model` over "data_parallel". `strategy(tp_plan)`
returns that strategy with Fabric's `no_backward_sync` also entering `shardnorm.accumulate(model)`, so the
norm grads' tp reduction waits for the last micro-batch too (docs/integrations/lightning.md).
"""

from contextlib import contextmanager, nullcontext

try:
    from lightning.fabric.strategies.model_parallel import ModelParallelStrategy, _ParallelBackwardSyncControl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"shardnorm.integrations.lightning needs Lightning 2.4+: pip install 'shardnorm[lightning]' "
                      f"({e})") from e

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import DEFAULT_BUCKET_CAP_MB
from shardnorm.fsdp import shard_model

DATA_DIM, TP_DIM = "data_parallel", "tensor_parallel"  # the dims Fabric's ModelParallelStrategy names

__all__ = ["ShardnormBackwardSyncControl", "parallelize_fn", "strategy"]


def parallelize_fn(tp_plan=None, *, block_classes=None, mp_policy=None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                   dp_dims=DATA_DIM, tp_dim: str = TP_DIM):
    """A `parallelize_fn(model, device_mesh)` for `ModelParallelStrategy` that applies shardnorm. `tp_plan`: None
    (data parallel only), a `parallelize_module` plan dict, or a callable `(model, tp_mesh)`."""
    if tp_plan is not None and not (isinstance(tp_plan, dict) or callable(tp_plan)):
        raise TypeError(f"shardnorm: tp_plan must be a parallelize_module plan dict or a callable "
                        f"(model, tp_mesh), got {type(tp_plan).__name__}")

    def parallelize(model: nn.Module, device_mesh):
        model, _ = shardnorm.convert(model)
        names = device_mesh.mesh_dim_names or ()
        if tp_plan is not None:
            if tp_dim not in names:
                raise ValueError(f"shardnorm: tp_dim={tp_dim!r} is not a dim of Fabric's mesh {names}")
            tp_mesh = device_mesh[tp_dim]
            if tp_mesh.size() > 1:
                tp_plan(model, tp_mesh) if callable(tp_plan) else parallelize_module(model, tp_mesh, tp_plan)
        return shard_model(model, device_mesh, block_classes, mp_policy, bucket_cap_mb=bucket_cap_mb,
                           dp_dims=dp_dims, tp_dim=tp_dim)

    return parallelize


class ShardnormBackwardSyncControl(_ParallelBackwardSyncControl):
    """Fabric's FSDP2 no-sync control plus `shardnorm.accumulate` (tp reduction of the norm grads)."""

    @contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        with super().no_backward_sync(module, enabled), shardnorm.accumulate(module) if enabled else nullcontext():
            yield


def strategy(tp_plan=None, *, data_parallel_size="auto", tensor_parallel_size="auto", block_classes=None,
             mp_policy=None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **kwargs) -> ModelParallelStrategy:
    """`ModelParallelStrategy` with shardnorm's `parallelize_fn` and no-sync control (kwargs go to it)."""
    result = ModelParallelStrategy(parallelize_fn(tp_plan, block_classes=block_classes, mp_policy=mp_policy,
                                                  bucket_cap_mb=bucket_cap_mb),
                                   data_parallel_size=data_parallel_size,
                                   tensor_parallel_size=tensor_parallel_size, **kwargs)
    result._backward_sync_control = ShardnormBackwardSyncControl()
    return result
