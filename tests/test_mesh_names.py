"""shard_model on meshes named the way torchtitan, Accelerate and Lightning name them (2 ranks: gloo on CPU, or NCCL
with SHARDNORM_TEST_DEVICE=cuda; the single-process reference runs on the CPU)."""

import pytest
from fsdp_harness import assert_grads_match, make_model, rank_rows, step_grads, token_batches
from spawn_ranks import DEVICE, rank_device, spawn
from torch.distributed.device_mesh import init_device_mesh

import shardnorm.fsdp
from parallel.model import Block
from parallel.parallelize import apply_tensor_parallel

SEED = 4321


def _grads_on(device, shape, names, *, tp_dim=None, data_dims=(), **kwargs):
    """Grads of one 2-micro-batch step on `mesh`, tensor-parallel over `tp_dim` if given, vs one process."""
    mesh = init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    dp = 1
    for name in data_dims:
        dp *= mesh[name].size()
    dp_rank = 0
    for name in data_dims:  # row-major rank over the data dims, as FSDP flattens them
        dp_rank = dp_rank * mesh[name].size() + mesh[name].get_local_rank()
    step = token_batches(SEED, dp, steps=1)[0]
    model = make_model(SEED, device)
    if tp_dim is not None:
        apply_tensor_parallel(model, mesh[tp_dim], "shardnorm")
    shardnorm.fsdp.shard_model(model, mesh, block_classes=(Block,), tp_dim=tp_dim, **kwargs)
    grads = step_grads(model, rank_rows(step, dp_rank, device))
    assert_grads_match(f"mesh {names} {kwargs}", grads, step_grads(make_model(SEED, "cpu"), step))


def _names_body(rank, world_size):
    device = rank_device(rank)
    # torchtitan: dp_shard x tp (tp=2); Accelerate's names are the same ("dp_shard", "tp")
    _grads_on(device, (1, 2), ("dp_shard", "tp"), tp_dim="tp", dp_dims="dp_shard", data_dims=("dp_shard",))
    # HSDP: replicate x shard
    _grads_on(device, (2, 1), ("dp_replicate", "dp_shard"), dp_dims="dp_shard", replicate_dim="dp_replicate",
              data_dims=("dp_replicate", "dp_shard"))
    # context parallel: FSDP shards over (dp_shard, cp) flattened, so it sums the norm grads over cp too
    _grads_on(device, (1, 2), ("dp_shard", "cp"), dp_dims=("dp_shard", "cp"), data_dims=("dp_shard", "cp"))

    mesh = init_device_mesh(DEVICE, (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    sp_model = make_model(SEED, device)
    apply_tensor_parallel(sp_model, mesh["tensor_parallel"], "shardnorm")
    with pytest.raises(ValueError, match=r"dp_dims='dp' is not a dim of the mesh"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,))  # defaults dp/tp: not Lightning's
    with pytest.raises(ValueError, match=r"\['tensor_parallel'\] are neither .*tp_dim='tp'"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,), dp_dims="data_parallel")
    with pytest.raises(ValueError, match=r"tp_dim='model' is not a dim of the mesh"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,), dp_dims="data_parallel",
                                   tp_dim="model")
    with pytest.raises(ValueError, match=r"no tp mesh .*tp_dim=None"):
        shardnorm.fsdp.shard_model(sp_model, mesh["data_parallel"], block_classes=(Block,), tp_dim=None)
    with pytest.raises(TypeError, match=r"shard_model needs mesh, a DeviceMesh, got str"):
        shardnorm.fsdp.shard_model(sp_model, "data_parallel", block_classes=(Block,))
    with pytest.raises(ValueError, match=r"\['tensor_parallel'\] are neither data-parallel"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,), dp_dims="data_parallel", tp_dim=None)
    with pytest.raises(ValueError, match=r"tp_dim='tensor_parallel' is also a data-parallel dim"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,),
                                   dp_dims=("data_parallel", "tensor_parallel"), tp_dim="tensor_parallel")
    with pytest.raises(ValueError, match=r"no data-parallel dim \(dp_dims=\(\)\)"):
        shardnorm.fsdp.shard_model(sp_model, mesh, block_classes=(Block,), dp_dims=(), tp_dim="tensor_parallel")
    tp_only = init_device_mesh(DEVICE, (2,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match=r"dp_dims='dp' is not a dim"):  # a mesh without a data dim
        shardnorm.fsdp.shard_model(make_model(SEED, device), tp_only, block_classes=(Block,))


@pytest.mark.distributed
def test_shard_model_with_torchtitan_lightning_hsdp_and_cp_names():
    """Grads equal one process on ("dp_shard", "tp"), HSDP ("dp_replicate", "dp_shard") and
    ("dp_shard", "cp"); a missing, uncovered or doubly used dim name raises naming its setting."""
    spawn(_names_body, 2)
