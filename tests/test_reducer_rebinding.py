"""Norm parameters replaced after `attach_reducer(model)`: `model.to(dtype)`, `.half()`, `.float()` (nn.Module._apply
swaps DTensor parameters with `torch.utils.swap_tensors`, `__dict__` included) and `load_state_dict(assign=True)` (new
Parameter objects) leave them without the reducer's grad sinks. The norm's next forward raises, naming the fix;
`attach_reducer(model)` again gives them back to a reducer, which then reduces their grads (one collective per
bucket per step) as torch's norms compute them. Run unbound, their grads would come back `Partial`, reduced by
DTensor in the param dtype, with no error and no collective of the reducer. One 2-rank gloo spawn runs all of it.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from conftest import rel_err
from spawn_ranks import DEVICE, rank_device, spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer, process_group_sequence_parallel, reducer_of

pytestmark = pytest.mark.distributed

HIDDEN, MICRO_BATCHES, STEPS = 16, 3, 2
BUCKET_CAP_MB = 300 / 2**20  # two LayerNorms (2 x 32 fp32 values) per bucket
REPLACED = r"LayerNorm's parameters were replaced after attach_reducer\(model\).*attach_reducer\(model\) again"
# fp32: the ranks' partial sums add in another order than one process's; bf16 / fp16: the fp32 sums rounded once
TOL = {torch.float32: 5e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}


class Fan(nn.Module):
    """Norms side by side on the same input, their outputs scaled by powers of two and added: every norm's output
    grad is the loss's, exact in bf16 / fp16, so the grads differ from fp32 torch norms' only by the rounding of the
    result."""

    def __init__(self, norm_class, layers: int = 4):
        super().__init__()
        self.norms = nn.ModuleList(norm_class(HIDDEN) for _ in range(layers))

    def forward(self, x):
        y = self.norms[0](x)
        for i, norm in enumerate(self.norms[1:], 1):
            y = y + norm(x) * 2.0**i
        return y


def _pair(seed, dtype):
    """(torch-norm reference in fp32 holding `dtype`'s values, shardnorm copy of it in fp32)."""
    torch.manual_seed(seed)
    ref = Fan(nn.LayerNorm)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p).to(dtype))
    model = Fan(shardnorm.LayerNorm)
    model.load_state_dict(ref.state_dict())
    device = rank_device(dist.get_rank())
    return ref.to(device), model.to(device)


def _data(dtype, shape):
    """x and dy holding `dtype`'s values, in fp32."""
    return tuple(torch.randn(shape).to(dtype).float().to(rank_device(dist.get_rank())) for _ in range(2))


def _replace(model, how: str, dtype) -> None:
    if how == "to":
        model.to(dtype)
    elif how == "half":
        model.half()
    elif how == "float":  # changes no dtype, still swaps the DTensor parameters
        model.float()
    else:  # new Parameter objects
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)


def _train(model, ref, reducer, dtype, what, shard, shape):
    """STEPS steps of MICRO_BATCHES micro-batches (`shard`: this rank's part of the input, as the model takes it):
    the reducer's one collective per bucket per step, its grads the fp32 torch norms' rounded to the param dtype."""
    for step in range(STEPS):
        before = reducer.collectives
        for mb in range(MICRO_BATCHES):
            x, dy = _data(dtype, shape)
            with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else nullcontext():
                y = model(shard(x.to(dtype)))
                loss = (y.float() * shard(dy)).sum()
                (loss.full_tensor() if isinstance(loss, DTensor) else loss).backward()
            (ref(x) * dy).sum().backward()
        calls = reducer.collectives - before
        assert calls == reducer.num_buckets == 2, \
            f"{what} step {step}: {calls} collectives, {reducer.num_buckets} buckets"
        assert len(reducer.params) == 2 * len(model.norms), f"{what}: the reducer owns {len(reducer.params)} params"
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            if isinstance(p, DTensor):
                assert p.grad.placements == (Replicate(),), f"{what}: {name}.grad {p.grad.placements}"
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert grad.dtype == dtype, f"{what}: {name}.grad {grad.dtype}"
            err = rel_err(grad, r.grad)
            assert err <= TOL[dtype], f"{what} step {step}: {name}.grad rel err {err:.2e}"
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def _dtensor_cases(mesh, seed):
    """SequenceParallelNorm: DTensor parameters, which `_apply` swaps (`.float()` of fp32 ones too)."""
    def shard(t):
        return distribute_tensor(t, mesh, [Shard(1)])

    shape = (2, 8, HIDDEN)
    for how, dtype in (("to", torch.bfloat16), ("half", torch.float16), ("float", torch.float32),
                       ("assign", torch.float32)):
        what = f"SequenceParallelNorm, {how} {dtype}"
        ref, model = _pair(seed, dtype)
        parallelize_module(model, mesh, {"norms.*": SequenceParallelNorm()})
        old = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        _replace(model, how, dtype)
        x = shard(_data(dtype, shape)[0].to(dtype))
        with torch.no_grad():  # no grads to skip the reducer: an evaluation runs
            model(x)
        with pytest.raises(RuntimeError, match=REPLACED):
            model(x)
        reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        assert reducer_of(model) is reducer
        assert all(p.sequence_parallel is True for p in model.parameters()), f"{what}: marks not put back"
        _train(model, ref, reducer, dtype, what, shard, shape)
        assert old.collectives == 0, f"{what}: the replaced reducer reduced"


def _process_group_cases(rank, world_size, seed):
    """process_group_sequence_parallel: plain parameters, replaced by `load_state_dict(assign=True)`, which drops
    their sequence-parallel marks too (attach_reducer puts them back); `.to(dtype)` sets their `.data`, keeping
    the objects and their marks: the reducer goes on without a new binding."""
    def shard(t):
        return t.chunk(world_size)[rank]

    shape = (8, 2, HIDDEN)  # sequence dim 0
    for how, dtype in (("assign", torch.float32), ("to", torch.bfloat16)):
        what = f"process_group_sequence_parallel, {how} {dtype}"
        ref, model = _pair(seed, dtype)
        for norm in model.norms:
            process_group_sequence_parallel(norm, dist.group.WORLD)
        reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        _replace(model, how, dtype)
        if how == "assign":
            with pytest.raises(RuntimeError, match=REPLACED):
                model(shard(_data(dtype, shape)[0]))
            reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
            for name, p in model.named_parameters():
                assert type(p) is nn.Parameter and p.sequence_parallel is True, f"{what}: {name} marks not put back"
        _train(model, ref, reducer, dtype, what, shard, shape)


def _cases(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))
    _dtensor_cases(mesh, seed)
    _process_group_cases(rank, world_size, seed)


def test_replaced_norm_params_refuse_to_run_until_attach_reducer_again():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")  # pytest shows it with a failure
    spawn(_cases, 2, seed)


def test_a_norm_never_bound_runs_after_to_and_assign():
    """Without a reducer nothing is recorded: conversions and `assign=True` loads change nothing in how it runs."""
    torch.manual_seed(0)
    model = Fan(shardnorm.LayerNorm)
    model.to(torch.bfloat16).float()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    model(torch.randn(3, HIDDEN)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
