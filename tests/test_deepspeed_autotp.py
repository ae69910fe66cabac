"""DeepSpeed AutoTP training: shardnorm owns the q/k-norm replicated-grad all-reduces and coalesces them.

2 ranks = 2-way tensor parallel. The q_norm of each block normalizes the local attention heads
(q_proj column-, o_proj row-parallel) and is marked `grad_allreduce`, as Qwen3's q_norm/k_norm are.
With "grad_reduce": "step" the marked norm grads take one fp32 all-reduce per optimizer step instead
of DeepSpeed's one per parameter per micro-batch; both train like plain torch on one process.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from deepspeed_harness import (HIDDEN, full_params, load_config, loss_fn, micro_batches, rel_err, train_reference,
                               use_test_device)
from spawn_ranks import spawn

deepspeed = pytest.importorskip("deepspeed")

STEPS, GAS, ROWS, HEADS, HEAD_DIM, LR, TOL = 3, 2, 4, 4, 4, 0.1, 1e-5
BLOCKS = 2
PARTITION = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*q_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*o_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
]}


class QKNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.q_norm = nn.RMSNorm(HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        q = self.q_proj(x)
        q = self.q_norm(q.view(*q.shape[:-1], -1, HEAD_DIM))
        return x + self.o_proj(q.flatten(-2))


def qk_norm_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, HIDDEN), *[QKNormBlock() for _ in range(BLOCKS)], nn.LayerNorm(HIDDEN),
                          nn.Linear(HIDDEN, 1))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
                for p in m.parameters():
                    p.add_(0.1 * torch.randn_like(p))
    return model


def _sgd(parameters):
    return torch.optim.SGD(parameters, lr=LR)


def _config(stage: int, grad_reduce: str, world_size: int) -> dict:
    config = load_config("zero1.json")
    config.pop("optimizer")
    config.update(train_micro_batch_size_per_gpu=ROWS, gradient_accumulation_steps=GAS, gradient_clipping=0.0,
                  zero_allow_untested_optimizer=True,
                  tensor_parallel={"autotp_size": world_size, "partition_config": PARTITION})
    config["zero_optimization"]["stage"] = stage
    config["shardnorm"]["grad_reduce"] = grad_reduce
    return config


def _counting_all_reduce(counter: list):
    original = dist.all_reduce

    def all_reduce(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    return original, all_reduce


def _train(rank, world_size, device, seed, stage, grad_reduce) -> int:
    """Train and compare with plain torch; returns the number of all-reduces the training issued."""
    import shardnorm.integrations.deepspeed as sd
    from shardnorm.distributed import reducer_of

    config = _config(stage, grad_reduce, world_size)
    model = qk_norm_model(seed).to(device)
    batches = micro_batches(seed + 1, STEPS, GAS, 1, ROWS, (8,))  # every tensor-parallel rank sees the same data
    reference, ref_losses = train_reference(model, config, batches, device, _sgd)

    engine, *_ = sd.initialize(model=model, config=config, optimizer=_sgd(model.parameters()))
    # the reducer lives on the model like every other source's, where shardnorm.finalize_grads looks
    reducer = reducer_of(engine.module)
    assert (reducer is not None) == (grad_reduce == "step"), reducer
    counter = [0]
    original, dist.all_reduce = _counting_all_reduce(counter)
    try:
        losses = []
        for step in batches:
            for micro in step:
                x, target = (t.to(device) for t in micro[0])
                loss = loss_fn(engine(x), target)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
    finally:
        dist.all_reduce = original

    case = f"stage {stage}, grad_reduce {grad_reduce}"
    if reducer is not None:
        assert reducer.collectives == STEPS, f"{case}: {reducer.collectives} reducer all-reduces in {STEPS} steps"
    for i, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= TOL * abs(want), f"{case}: micro-batch {i} loss {got} vs torch {want}"
    got, want = full_params(engine.module), dict(reference.named_parameters())
    for key in want:
        if "norm" in key or key.startswith(str(BLOCKS + 1)):  # the replicated norms
            assert rel_err(got[key], want[key]) <= TOL, f"{case}: {key} rel err {rel_err(got[key], want[key]):.2e}"
    engine.destroy()
    return counter[0]


def _body(rank, world_size, seed):
    from shardnorm.integrations.deepspeed import ShardnormConfigError

    device = use_test_device(rank)
    by_deepspeed = _train(rank, world_size, device, seed, 1, "deepspeed")
    by_shardnorm = _train(rank, world_size, device, seed, 1, "step")
    micro_batches_run, marked_params, buckets = STEPS * GAS, BLOCKS, 1
    assert by_deepspeed - by_shardnorm == marked_params * micro_batches_run - buckets * STEPS, (by_deepspeed,
                                                                                                by_shardnorm)
    _train(rank, world_size, device, seed + 1, 0, "step")
    with pytest.raises(ShardnormConfigError, match=r"^shardnorm\.grad_reduce: .*ZeRO stage 0 or 1"):
        _train(rank, world_size, device, seed, 2, "step")


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_autotp_qk_norm_grads_coalesced():
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"seed {seed}")  # shown with a failure; _body(rank, 2, seed) reruns it
    spawn(_body, 2, seed)


def test_step_under_zero2_is_refused_before_the_model_changes():
    """AutoTP with ZeRO-2 and "grad_reduce": "step": refused from the config, before conversion and before DeepSpeed
    shards the model (refused from the engine after both, a retry with "deepspeed" on the same model trained with
    its q_norm grads never all-reduced: DeepSpeed does not register its hooks on a model it sharded already)."""
    from shardnorm.integrations.deepspeed import ShardnormConfigError, initialize

    model = qk_norm_model(0)
    before = [type(m) for m in model.modules()]
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "tensor_parallel": {"autotp_size": 2, "partition_config": PARTITION}, "shardnorm": {"grad_reduce": "step"}}
    with pytest.raises(ShardnormConfigError, match='"step" under AutoTP needs ZeRO stage 0 or 1'):
        initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert [type(m) for m in model.modules()] == before
    assert not any(hasattr(p, "_ds_grad_allreduce_registered") for p in model.parameters())
