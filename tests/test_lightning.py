"""shardnorm under Lightning Fabric's ModelParallelStrategy: Fabric's own strategy, mesh and no_backward_sync."""

import pytest
import torch

import shardnorm

pytest.importorskip("lightning")

from conftest import rel_err  # noqa: E402
from fsdp_harness import CFG, make_model, token_batches  # noqa: E402
from spawn_ranks import DEVICE, rank_device, spawn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from parallel.engines import cross_entropy  # noqa: E402
from parallel.model import Block  # noqa: E402
from parallel.parallelize import apply_tensor_parallel  # noqa: E402
from shardnorm.integrations import lightning as sn_lightning  # noqa: E402

TOL = 1e-5


def _reference_grads(seed: int, micro_batches) -> dict[str, torch.Tensor]:
    """One process, torch's norms, no parallelism: the grads of the same micro-batches."""
    model = make_model(seed, torch.device("cpu"), norm="torch")
    for x, y in micro_batches:
        (cross_entropy(model(x), y) / len(micro_batches)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _fabric_body(rank, world_size, seed, dp, tp):
    from lightning.fabric import Fabric

    tp_plan = (lambda model, mesh: apply_tensor_parallel(model, mesh, "shardnorm")) if tp > 1 else None
    strategy = sn_lightning.strategy(tp_plan, data_parallel_size=dp, tensor_parallel_size=tp, block_classes=(Block,))
    device = rank_device(rank)
    fabric = Fabric(accelerator=DEVICE, devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_model(seed, device, norm="torch"))
    inner = model.module
    assert sum(isinstance(m, (shardnorm.RMSNorm, shardnorm.LayerNorm)) for m in inner.modules()) == 2 * CFG.n_layers + 1
    step = token_batches(seed, dp, steps=1)[0]
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    rows = slice(dp_rank * (step[0][0].shape[0] // dp), (dp_rank + 1) * (step[0][0].shape[0] // dp))
    reducer = getattr(inner, "_shardnorm_reducer", None)
    for i, (x, y) in enumerate(step):
        last = i == len(step) - 1
        with fabric.no_backward_sync(model, enabled=not last):
            if reducer is not None:
                assert reducer.accumulating == (not last)  # Fabric's no-sync entered shardnorm.accumulate
            fabric.backward(cross_entropy(model(x[rows].to(device)), y[rows].to(device)) / len(step))
    if tp > 1:
        assert reducer is not None and reducer.collectives == 1  # one fp32 tp all-reduce for the step
    reference = _reference_grads(seed, step)
    for name, p in inner.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        err = rel_err(grad, reference[name])
        assert err <= TOL, f"{name}: rel err {err:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("dp,tp", [(1, 2)])  # dp=2 alone also passes (~30 s more); shard_model at dp=2: test_fsdp
def test_fabric_model_parallel_accumulation_matches_one_process(dp, tp):
    """Fabric ModelParallelStrategy (2 ranks: gloo, or NCCL with SHARDNORM_TEST_DEVICE=cuda), 2 micro-batches
    under fabric.no_backward_sync: every grad equals the single-process grad of the same global batch."""
    spawn(_fabric_body, dp * tp, 1234, dp, tp)


def test_parallelize_fn_rejects_a_bad_plan():
    with pytest.raises(TypeError, match="tp_plan must be"):
        sn_lightning.parallelize_fn(tp_plan=["attention_norm"])
