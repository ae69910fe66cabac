"""The norm-grad reducer: one collective per bucket per step (vs layers x micro-batches per layer), launched
during the last backward, every partial sum reduced exactly once; explicit finalize; the Megatron-style
process-group mode; clear errors for unsupported layouts. One 2-rank gloo spawn runs all of it.

Collectives are counted by wrapping `torch.distributed.all_reduce` (the real one runs underneath); the
sequence-parallel stack below issues no other all_reduce, so every call counted is a norm-grad reduction.
"""

import gc
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from conftest import rel_err
from spawn_ranks import DEVICE, rank_device, spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer, process_group_sequence_parallel

pytestmark = pytest.mark.distributed

LAYERS, HIDDEN, MICRO_BATCHES, STEPS = 6, 16, 4, 2
BUCKET_CAP_MB = 300 / 2**20  # two LayerNorms (2 x 32 fp32 values) per bucket: 3 buckets
# fp32 grads against one process: the rows' sums differ in order (per-rank partials, then the all-reduce), and a
# grad of the first norm passes back through up to seven norms (six layers and the reused one), each of which can
# amplify the rounding of its input grad: relative errors of 1e-6 occur with the GPU kernels
TOL = 5e-6


class NormStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(shardnorm.LayerNorm(HIDDEN) for _ in range(LAYERS))

    def forward(self, x, reuse_first: bool = False):
        for norm in self.norms:
            x = norm(x) * 1.5
        return self.norms[0](x) if reuse_first else x


def _random_pair(seed):
    """A reference NormStack with random params (ones/zeros would hide mistakes) and a copy of it."""
    torch.manual_seed(seed)
    ref = NormStack()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    model = NormStack()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _models(mesh, seed):
    ref, model = _random_pair(seed)
    parallelize_module(model, mesh, {"norms.*": SequenceParallelNorm()})
    return ref, model


class _AllReduceCounter:
    """Counts torch.distributed.all_reduce calls; the real collective runs underneath."""

    def __init__(self):
        self.calls, self._real = 0, dist.all_reduce
        dist.all_reduce = self._counted

    def _counted(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def _micro_batch(model, ref, mesh, x, dy, reuse_first=False, on_input_grad=None):
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    if on_input_grad is not None:
        xd.register_hook(on_input_grad)
    (model(xd, reuse_first) * distribute_tensor(dy, mesh, [Shard(1)])).sum().full_tensor().backward()
    (ref(x, reuse_first) * dy).sum().backward()


def _check_grads(model, ref, what):
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and p.grad.placements == (Replicate(),), f"{what}: {name}.grad {p.grad}"
        err = rel_err(p.grad.full_tensor(), r.grad)
        assert err <= TOL, f"{what}: {name}.grad rel err {err:.2e}"


def _holds_partial_sums(model) -> bool:
    """While partial sums are pending, each norm param's `.grad` holds this rank's own, unreduced sums (where any
    zeroing of the grads reaches them): they differ across the ranks."""
    for p in model.parameters():
        if p.grad is None:
            return False
        local = p.grad.to_local()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        if torch.equal(parts[0], parts[1]):
            return False
    return True


def _data():
    return torch.randn(2, 8, HIDDEN), torch.randn(2, 8, HIDDEN)


def _collectives_per_step(mesh, counter, seed, mode):
    """bucketed: num_buckets all-reduces per step, all launched before backward reaches the input;
    per_layer: norm parameters x micro-batches."""
    ref, model = _models(mesh, seed)
    reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB, reduce=mode)
    launched_at = {"input grad": [], "finalize": []}
    finalize = reducer.finalize
    reducer.finalize = lambda: (launched_at["finalize"].append(counter.calls), finalize())
    for step in range(STEPS):
        for mb in range(MICRO_BATCHES):
            last = mb == MICRO_BATCHES - 1
            hook = (lambda g: launched_at["input grad"].append(counter.calls)) if last else None
            with shardnorm.accumulate(model) if not last else nullcontext():
                _micro_batch(model, ref, mesh, *_data(), on_input_grad=hook)
            if not last and mode == "bucketed":  # per_layer reduced each micro-batch's already
                assert _holds_partial_sums(model), f"{mode}: grads before the last one"
        calls = counter.take()
        if mode == "bucketed":
            assert reducer.num_buckets == 3, reducer.num_buckets
            assert calls == reducer.num_buckets, f"step {step}: {calls} collectives, {reducer.num_buckets} buckets"
            # each bucket launched as its last grad arrived: all before the end of backward, and all but
            # perhaps the last before backward reached the stack's input
            assert launched_at["finalize"][-1] == reducer.num_buckets, launched_at
            assert launched_at["input grad"][-1] >= reducer.num_buckets - 1, launched_at
        else:
            # one per norm parameter (weight, bias) per micro-batch
            assert calls == 2 * LAYERS * MICRO_BATCHES, f"per_layer step {step}: {calls} collectives"
        _check_grads(model, ref, f"{mode} step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def _explicit_finalize(mesh, counter, seed):
    """Megatron-style: every micro-batch accumulates, `finalize_grads` reduces once; calling it again is a
    no-op (no collective, grads unchanged)."""
    ref, model = _models(mesh, seed)
    attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
    with shardnorm.accumulate(model):
        for _ in range(MICRO_BATCHES):
            _micro_batch(model, ref, mesh, *_data())
    assert counter.take() == 0
    assert _holds_partial_sums(model)
    shardnorm.finalize_grads(model)
    assert counter.take() == model._shardnorm_reducer.num_buckets
    _check_grads(model, ref, "finalize_grads")
    shardnorm.finalize_grads(model)
    assert counter.take() == 0
    _check_grads(model, ref, "finalize_grads twice")


def _graph_changes(mesh, counter, seed):
    """A norm used twice in a step where it was used once before: autograd sums its two grads before its grad
    sink takes them, so it is reduced exactly once, in its bucket, with no collective of its own."""
    ref, model = _models(mesh, seed)
    reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
    for step, reuse_first in enumerate([False, True, True]):
        _micro_batch(model, ref, mesh, *_data(), reuse_first=reuse_first)
        calls = counter.take()
        assert calls == reducer.num_buckets, f"step {step}: {calls} all-reduces"
        _check_grads(model, ref, f"reuse step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def _process_group_mode(rank, world_size, seed):
    """Plain tensors in and out, plain params flagged `sequence_parallel`: without a reducer their grads
    are local partial sums (for Megatron's finalize_model_grads), with one they are the full sums."""
    device = rank_device(rank)
    for with_reducer in (False, True):
        ref, model = _random_pair(seed)
        model.to(device)
        for norm in model.norms:
            process_group_sequence_parallel(norm, dist.group.WORLD)  # sequence dim 0: Megatron's [s, b, h]
        if with_reducer:
            attach_reducer(model)
        x, dy = torch.randn(8, 2, HIDDEN), torch.randn(8, 2, HIDDEN)
        x_local = x.chunk(world_size)[rank].to(device).requires_grad_()
        y_local = model(x_local)
        assert type(y_local) is torch.Tensor and y_local.shape == x_local.shape
        (y_local * dy.chunk(world_size)[rank].to(device)).sum().backward()
        xr = x.clone().requires_grad_()
        (ref(xr) * dy).sum().backward()
        assert rel_err(x_local.grad, xr.grad.chunk(world_size)[rank]) <= TOL
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert type(p) is nn.Parameter and p.sequence_parallel is True, name
            grad = p.grad.clone()
            if not with_reducer:
                dist.all_reduce(grad)  # what Megatron's finalize_model_grads does for sequence_parallel params
            assert rel_err(grad, r.grad) <= TOL, f"process-group mode, reducer={with_reducer}: {name}"


def _mixed_precision(mesh, seed):
    """bf16 activations and params: the grads are summed in fp32 over ranks and micro-batches (between the
    micro-batches' backwards too, while the sums wait in `.grad`), then rounded once into `.grad` as bf16 Replicate
    DTensors. Reference: one process on the same device (the same kernels: on another
    backend the bf16 rounding of a norm's output can differ in a last bit, which six norms in a row amplify), the
    same bf16 values kept as fp32 params (the op computes the same bf16 outputs with them), whose grads accumulate
    in fp32."""
    ref, model = _models(mesh, seed)
    model.to(torch.bfloat16)
    device = rank_device(dist.get_rank())
    ref.to(device, torch.bfloat16).float()
    attach_reducer(model)
    for mb in range(MICRO_BATCHES):
        x, dy = _data()
        x = x.bfloat16()
        with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else nullcontext():
            xd = distribute_tensor(x, mesh, [Shard(1)])
            (model(xd).float() * distribute_tensor(dy, mesh, [Shard(1)])).sum().full_tensor().backward()
        (ref(x.to(device)).float() * dy.to(device)).sum().backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.bfloat16 and p.grad.placements == (Replicate(),), name
        # the fp32 sum rounded to bf16 once: within half a bf16 spacing of the reference's fp32 sum (and of the
        # order in which the ranks' and micro-batches' fp32 partials were added); a sum rounded once per
        # micro-batch lands further away
        grad, want = p.grad.full_tensor().double().cpu(), r.grad.double().cpu()
        half_spacing = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 9)
        off = ((grad - want).abs() - half_spacing).max().item()
        assert off <= 1e-5 * want.abs().max().item(), f"bf16: {name}.grad {off:.2e} beyond the once-rounded fp32 sum"


def _multi_dim_normalized_shape(mesh):
    """normalized_shape (seq, hidden): x sharded on seq is a hidden-sharded norm over two dims (weight
    sharded to match), x sharded on batch a token-sharded one (weight replicated)."""
    shape = (8, HIDDEN)
    for placement, weight_placement in ((Shard(1), Shard(0)), (Shard(0), Replicate())):
        x, w, dy = torch.randn(2, *shape), torch.randn(shape), torch.randn(2, *shape)
        wr = w.clone().requires_grad_()
        wd = distribute_tensor(w, mesh, [weight_placement]).requires_grad_()
        y = shardnorm.layer_norm(distribute_tensor(x, mesh, [placement]), shape, wd)
        (y * distribute_tensor(dy, mesh, [placement])).sum().full_tensor().backward()
        expected = torch.nn.functional.layer_norm(x, shape, wr)
        (expected * dy).sum().backward()
        assert y.placements == (placement,)
        assert rel_err(y.full_tensor(), expected) <= TOL, placement
        assert rel_err(wd.grad.full_tensor(), wr.grad) <= TOL, placement


def _errors(mesh):
    h = HIDDEN
    x = distribute_tensor(torch.randn(2, 8, h), mesh, [Shard(1)])
    partial_x = DTensor.from_local(torch.randn(2, 8, h), mesh, [Partial()])
    with pytest.raises(NotImplementedError, match=r"Partial"):
        shardnorm.rms_norm(partial_x, (h,))
    sharded_w = distribute_tensor(torch.randn(h), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"weight has placements \(Shard\(dim=0\),\)"):
        shardnorm.rms_norm(x, (h,), sharded_w)
    replicated = distribute_tensor(torch.randn(h), mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"bias has placements"):
        shardnorm.layer_norm(distribute_tensor(torch.randn(2, 8, h), mesh, [Shard(2)]), (h,),
                             distribute_tensor(torch.randn(h), mesh, [Shard(0)]), replicated)
    with pytest.raises(ValueError, match=r"residual must be a DTensor on x's mesh with x's placements"):
        shardnorm.add_rms_norm(x, distribute_tensor(torch.randn(2, 8, h), mesh, [Shard(0)]), (h,), replicated)
    with pytest.raises(ValueError, match=r"normalized_shape \[32\] does not match the trailing dims"):
        shardnorm.rms_norm(x, (2 * h,))
    with pytest.raises(ValueError, match=r"eps must be >= 0"):
        shardnorm.rms_norm(x, (h,), eps=-1.0)
    with pytest.raises(ValueError, match=r"weight is a plain torch.Tensor"):
        shardnorm.rms_norm(x, (h,), torch.randn(h, device=x.device, requires_grad=True))
    with pytest.raises(ValueError, match=r"x is a plain torch.Tensor but weight is a DTensor"):
        shardnorm.rms_norm(torch.randn(2, 8, h, device=x.device), (h,), replicated)
    two_d = init_device_mesh(DEVICE, (1, mesh.size()), mesh_dim_names=("dp", "tp"))
    sp_norm = parallelize_module(shardnorm.RMSNorm(h), two_d["tp"], SequenceParallelNorm())
    with pytest.raises(ValueError, match=r"SequenceParallelNorm was parallelized on .*its input is a DTensor on"):
        sp_norm(distribute_tensor(torch.randn(2, 8, h), two_d, [Replicate(), Shard(1)]))
    with pytest.raises(TypeError, match=r"accumulate needs the model \(a torch.nn.Module\), got Tensor"):
        with shardnorm.accumulate(torch.randn(2)):
            pass
    with pytest.raises(ValueError, match=r"reduce must be 'bucketed' or 'per_layer'"):
        attach_reducer(NormStack(), reduce="per_param")
    with pytest.raises(ValueError, match=r"1-D"):
        parallelize_module(shardnorm.RMSNorm(h), init_device_mesh(DEVICE, (1, mesh.size())), SequenceParallelNorm())


def _cases(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))
    counter = _AllReduceCounter()
    _collectives_per_step(mesh, counter, seed, "bucketed")
    _collectives_per_step(mesh, counter, seed, "per_layer")
    _explicit_finalize(mesh, counter, seed)
    _graph_changes(mesh, counter, seed)
    _process_group_mode(rank, world_size, seed)
    _mixed_precision(mesh, seed)
    _multi_dim_normalized_shape(mesh)
    _errors(mesh)


def test_reducer_collectives_modes_and_errors():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")  # pytest shows it with a failure
    spawn(_cases, 2, seed)


# ---- the reducer's pending partial sums follow the user's grads -------------------------------------------

ZERO_GRADS = {  # every way a training loop drops its grads
    "optimizer, set_to_none": lambda model, opt: opt.zero_grad(set_to_none=True),
    "optimizer, zeros": lambda model, opt: opt.zero_grad(set_to_none=False),
    # built with foreach=True: zeroing DTensor grads with torch._foreach_zero_ bumps no version counter
    "optimizer (foreach), zeros": lambda model, opt: opt.zero_grad(set_to_none=False),
    "module, set_to_none": lambda model, opt: model.zero_grad(set_to_none=True),
    "module, zeros": lambda model, opt: model.zero_grad(set_to_none=False),
    # what Megatron- and DeepSpeed-style loops do to their grad buffers
    "in place, no_grad": lambda model, opt: _each_grad(model, lambda g: g.zero_()),
    "in place, .data": lambda model, opt: _each_grad(model, lambda g: g.data.zero_()),
}


@torch.no_grad()
def _each_grad(model, zero):
    for p in model.parameters():
        if p.grad is not None:
            zero(p.grad)


def _clean_step(model, ref, mesh, what):
    """MICRO_BATCHES micro-batches, the last outside `accumulate`; grads checked against one process."""
    for mb in range(MICRO_BATCHES):
        with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else nullcontext():
            _micro_batch(model, ref, mesh, *_data())
    _check_grads(model, ref, what)


def _abandoned_step(model, mesh):
    """Two micro-batches inside `accumulate`, then no last backward (a NaN loss skipped it)."""
    for _ in range(2):
        with shardnorm.accumulate(model):
            xd = distribute_tensor(torch.randn(2, 8, HIDDEN), mesh, [Shard(1)])
            (model(xd) * 1e3).sum().full_tensor().backward()


def _zero_grad_discards_pending(mesh, seed):
    """A step whose last backward never ran, then zero_grad (module's or optimizer's, set_to_none either way):
    the next step's norm grads are that step's alone, as every other parameter's are."""
    for case, zero in ZERO_GRADS.items():
        ref, model = _models(mesh, seed)
        reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.0, foreach="foreach" in case)
        _clean_step(model, ref, mesh, f"{case}: first step")  # with zeros, .grad exists before the next step
        opt.step()
        zero(model, opt)
        ref.zero_grad(set_to_none=True)
        _abandoned_step(model, mesh)
        assert reducer.has_pending, case
        zero(model, opt)
        assert not reducer.has_pending, f"{case}: zero_grad left partial sums pending"
        opt.step()  # zeroed: nothing to refuse (torch.distributed.checkpoint steps over zero grads to build its state)
        _clean_step(model, ref, mesh, f"{case}: step after the abandoned one")


def _nan_step_given_up(mesh, seed):
    """A micro-batch whose grads are NaN (an overflow) inside `accumulate`, the step given up with each zero_grad:
    the next step's grads are its own, not NaN (a `.grad` of zeros kept from the step before gave the NaN no ratio
    to be scaled by: 0 x NaN)."""
    for case, zero in ZERO_GRADS.items():
        ref, model = _models(mesh, seed)
        reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.0, foreach="foreach" in case)
        _clean_step(model, ref, mesh, f"{case}: first step")
        zero(model, opt)
        ref.zero_grad(set_to_none=True)
        x = torch.randn(2, 8, HIDDEN)
        x[0, 0, 0] = float("nan")
        with shardnorm.accumulate(model):
            model(distribute_tensor(x, mesh, [Shard(1)])).sum().full_tensor().backward()
        zero(model, opt)
        assert not reducer.has_pending, f"{case}: zero_grad left the NaN step's sums pending"
        _clean_step(model, ref, mesh, f"{case}: step after a NaN step given up")


def _in_place_zero_after_bucket_stash(mesh, seed):
    """Grads zeroed in place between the micro-batches of a step whose sums the reducer stashed a bucket at a time
    (`.grad`s all None before it: views of one tensor per bucket): the zeroing reaches every one of them."""
    for case in ("in place, no_grad", "in place, .data"):
        ref, model = _models(mesh, seed)
        reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        _abandoned_step(model, mesh)
        assert all(b.stashed is not None for b in reducer.buckets), f"{case}: no bucket stashed as one piece"
        ZERO_GRADS[case](model, None)
        _clean_step(model, ref, mesh, f"{case}, after a stash a bucket at a time")


class _Raised(Exception):
    pass


def _backward_that_raises(mesh, seed):
    """A backward that raises midway (an OOM, a failing hook) after some norms gave their grads, inside `accumulate`
    or as the step's last one, the step given up with each zero_grad: the next step's grads are its own (the sums
    of the failed backward left behind would be off by 0.9-1.4 relative), and nothing stays pending."""
    for where in ("inside accumulate", "the step's last"):
        for case in ("optimizer, set_to_none", "module, zeros"):
            ref, model = _models(mesh, seed)
            reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            _clean_step(model, ref, mesh, f"{where}, {case}: first step")
            opt.step()
            ZERO_GRADS[case](model, opt)
            with shardnorm.accumulate(model):
                _micro_batch(model, ref, mesh, *_data())
            xd = distribute_tensor(torch.randn(2, 8, HIDDEN), mesh, [Shard(1)]).requires_grad_()
            h = model.norms[0](xd)
            h.register_hook(lambda grad: (_ for _ in ()).throw(_Raised()))  # after the later norms' grads
            for norm in model.norms[1:]:
                h = norm(h * 1.5)
            with pytest.raises(_Raised), shardnorm.accumulate(model) if where == "inside accumulate" \
                    else nullcontext():
                h.sum().full_tensor().backward()
            assert reducer._backward_task is None, f"{where}, {case}: the failed backward is still running"
            ZERO_GRADS[case](model, opt)
            ref.zero_grad(set_to_none=True)
            assert not reducer.has_pending, f"{where}, {case}: the zeroing left sums pending"
            shardnorm.discard_pending(model)
            _clean_step(model, ref, mesh, f"{where}, {case}: the step after the failed backward")


def _carried_grads_changed_mid_step(mesh, seed):
    """`.grad` kept from the last step (no zero_grad between steps), then zeroed or scaled in place between the
    micro-batches: the grads are torch's, the kept part counted once (not once per rank: zeroing would give minus
    it)."""
    changes = {"zeroed": lambda g: g.zero_(), "halved": lambda g: g.mul_(0.5)}
    for case, change in changes.items():
        ref, model = _models(mesh, seed)
        attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
        _clean_step(model, ref, mesh, f"{case}: first step")
        with shardnorm.accumulate(model):
            _micro_batch(model, ref, mesh, *_data())
        _each_grad(model, change)
        _each_grad(ref, change)
        _clean_step(model, ref, mesh, f"{case}: .grad kept from the last step, {case} mid-step")


def _deepcopy_with_grads(mesh, seed):
    """A deep copy of the model (an EMA copy, `AveragedModel`) after a step and between micro-batches: the copy's
    grads are the model's (`.grad`s that are views of one bucket at offsets, torch cannot copy)."""
    import copy

    ref, model = _models(mesh, seed)
    attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
    _clean_step(model, ref, mesh, "before the copies")
    for when in ("after a step", "between micro-batches"):
        copied = copy.deepcopy(model)
        for (name, p), q in zip(model.named_parameters(), copied.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{when}: {name}.grad"
        model.zero_grad(set_to_none=True)
        with shardnorm.accumulate(model):
            _micro_batch(model, ref, mesh, *_data())
    shardnorm.discard_pending(model)


def _step_with_pending_partials(mesh, seed, counter):
    """Every backward of a step inside `accumulate`: optimizer.step() refuses (the norm grads are not reduced);
    finalize_grads makes them right; discard_pending drops them, and the grads are as before."""
    ref, model = _models(mesh, seed)
    reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with shardnorm.accumulate(model):
        for _ in range(MICRO_BATCHES):
            _micro_batch(model, ref, mesh, *_data())
    assert _step_checks() == 1, "grads pending and no step check"
    with pytest.raises(RuntimeError, match=r"norm grads are not reduced yet.*shardnorm\.finalize_grads\(model\)"):
        opt.step()
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.0)
    other.step()  # an optimizer that holds none of the reducer's parameters is not concerned
    shardnorm.finalize_grads(model)
    # gone with the pending sums, before any step: a compiled optimizer step breaks its graph on a global hook
    assert _step_checks() == 0, "the step check stayed after finalize_grads"
    _check_grads(model, ref, "finalize_grads after the refused step")
    opt.step()
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    with shardnorm.accumulate(model):
        _micro_batch(model, ref, mesh, *_data())
    assert _step_checks() == 1, "grads pending and no step check"
    _micro_batch(model, ref, mesh, *_data())  # the step's last backward reduces the grads at its end
    assert _step_checks() == 0, "the step check stayed after the step's last backward reduced the grads"
    _check_grads(model, ref, "the step's last backward outside accumulate")
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    counter.take()
    _abandoned_step(model, mesh)
    shardnorm.discard_pending(model)
    assert not reducer.has_pending and all(p.grad is None for p in model.parameters())
    shardnorm.finalize_grads(model)
    assert counter.take() == 0, "finalize after discard_pending reduced something"
    opt.step()  # nothing pending: allowed
    _clean_step(model, ref, mesh, "step after discard_pending")


def _accumulate_without_reducer(mesh, seed):
    """Sequence-parallel (DTensor) norms and no reducer: nothing would reduce the accumulated grads'
    `Partial` sums, so `accumulate` refuses, naming the fix."""
    _, model = _models(mesh, seed)
    with pytest.raises(RuntimeError, match=r"norms\.0\.weight .*attach_reducer\(model\)"):
        with shardnorm.accumulate(model):
            pass


def _grads_of_chosen_inputs(mesh, seed, counter):
    """`torch.autograd.grad(loss, params)` and `backward(inputs=params)` with a reducer attached: no step's backward
    (nothing accumulates into the reducer's sinks), so the norms' parameters get their grads themselves, the
    `Partial` sums a model without a reducer gets, and nothing is reduced or left pending (handed to the sinks,
    they would reach nothing: the grads silently None)."""
    ref, model = _models(mesh, seed)
    _, plain = _models(mesh, seed)
    reducer = attach_reducer(model, bucket_cap_mb=BUCKET_CAP_MB)
    x, dy = _data()

    def loss(m):
        out = m(distribute_tensor(x, mesh, [Shard(1)]))
        return (out * distribute_tensor(dy, mesh, [Shard(1)])).sum().full_tensor()

    want = torch.autograd.grad((ref(x) * dy).sum(), list(ref.parameters()))
    without = torch.autograd.grad(loss(plain), list(plain.parameters()))
    counter.take()
    got = torch.autograd.grad(loss(model), list(model.parameters()))
    params = list(model.parameters())
    loss(model).backward(inputs=params[:2])  # the first norm's weight and bias
    assert counter.take() == 0, "a backward that reaches no sink reduced something"
    for g, g_plain, w in zip(got, without, want):
        assert g.placements == g_plain.placements == (Partial(),), g
        assert torch.equal(g.to_local(), g_plain.to_local())
        assert rel_err(g.full_tensor(), w) <= TOL
    for p, g in zip(params[:2], got):
        assert torch.equal(p.grad.to_local(), g.to_local())
    assert all(p.grad is None for p in params[2:])
    assert not reducer.has_pending


def _partial_grads_source(rank, world_size, seed):
    """A hook's partial sums in `.grad` (DeepSpeed AutoTP's source): the framework's boundary ends the step, also
    inside `accumulate`; a zero_grad after a given-up step leaves nothing pending."""
    from shardnorm.distributed.grad_sources import PartialGrads
    from shardnorm.distributed.reducer import release_step_check

    ref, model = _random_pair(seed)
    model.to(rank_device(rank))
    boundary = [False]
    reducer = attach_reducer(model, source=PartialGrads(list(model.parameters()), dist.group.WORLD,
                                                        boundary=lambda: boundary[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def micro_batch(last: bool, scale: float = 1.0):
        x, dy = torch.randn(2 * world_size, 4, HIDDEN), torch.randn(2 * world_size, 4, HIDDEN)
        boundary[0] = last
        (model(x.chunk(world_size)[rank].to(rank_device(rank))) * dy.chunk(world_size)[rank].to(rank_device(rank))
         * scale).sum().backward()
        if scale == 1.0:
            (ref(x) * dy).sum().backward()

    for mb in range(MICRO_BATCHES):  # a loop that wraps every micro-batch in accumulate
        with shardnorm.accumulate(model):
            micro_batch(last=mb == MICRO_BATCHES - 1)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad.cpu(), r.grad) <= TOL, f"partial grads, boundary inside accumulate: {name}"
    gc.collect()  # the earlier cases' models, and their reducers
    assert _step_checks() == 0, "partial grads: the step check stayed after the boundary reduced the sums"
    opt.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    micro_batch(last=False, scale=1e3)  # a step given up after its first micro-batch
    assert reducer.has_pending
    release_step_check()  # as another model's reducer does when its step's sums are reduced
    assert _step_checks() == 1, "partial grads pending between boundaries and no step check"
    opt.zero_grad(set_to_none=True)
    assert not reducer.has_pending, "partial grads: zero_grad left the step pending"
    for mb in range(MICRO_BATCHES):
        micro_batch(last=mb == MICRO_BATCHES - 1)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad.cpu(), r.grad) <= TOL, f"partial grads, step after a given-up one: {name}"


# allocations launch no kernel (the reducer allocates each `.grad` it writes)
ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default)


def _step_boundary_kernels(mesh, norms: int, micro_batches: int = 3) -> list[int]:
    """Tensor ops other than views (each a kernel on a GPU) the reducer runs at each backward's start and end over
    one step of `micro_batches` (the pending sums stashed into `.grad`, taken back, reduced and written), for
    `norms` LayerNorms in one bucket."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view and func not in ALLOCATIONS  # views run no kernel
            return func(*args, **(kwargs or {}))

    model = nn.Sequential(*[shardnorm.LayerNorm(HIDDEN) for _ in range(norms)])
    parallelize_module(model, mesh, {str(i): SequenceParallelNorm() for i in range(norms)})
    reducer = attach_reducer(model, bucket_cap_mb=1.0)
    counts = []

    def counted(method):
        def run(*args):
            with Count() as count:
                method(*args)
            counts.append(count.ops)
        return run

    reducer._begin_backward = counted(reducer._begin_backward)
    reducer._end_backward = counted(reducer._end_backward)
    for step in range(2):  # the first step lays the bucket out
        counts.clear()
        for mb in range(micro_batches):
            with shardnorm.accumulate(model) if mb < micro_batches - 1 else nullcontext():
                model(distribute_tensor(torch.randn(2, 8, HIDDEN), mesh, [Shard(1)])).sum().full_tensor().backward()
        model.zero_grad(set_to_none=True)
    assert reducer.num_buckets == 1
    return counts


def _step_boundary_kernels_per_bucket(mesh):
    """The pending sums of an accumulating step are stashed, taken back and written to `.grad` a bucket at a time:
    the reducer's tensor ops at the backward passes' boundaries do not grow with the number of norms."""
    few, many = _step_boundary_kernels(mesh, 3), _step_boundary_kernels(mesh, 12)
    assert few == many, f"ops at each backward's start and end, 3 norms {few} against 12 norms {many}"


def _lifecycle(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))
    _step_boundary_kernels_per_bucket(mesh)
    counter = _AllReduceCounter()
    _zero_grad_discards_pending(mesh, seed)
    _nan_step_given_up(mesh, seed)
    _in_place_zero_after_bucket_stash(mesh, seed)
    _backward_that_raises(mesh, seed)
    _carried_grads_changed_mid_step(mesh, seed)
    _deepcopy_with_grads(mesh, seed)
    _step_with_pending_partials(mesh, seed, counter)
    _accumulate_without_reducer(mesh, seed)
    _grads_of_chosen_inputs(mesh, seed, counter)
    _partial_grads_source(rank, world_size, seed)


def test_pending_partial_sums_follow_zero_grad_and_step():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    spawn(_lifecycle, 2, seed)


def _step_checks() -> int:
    """shardnorm's hooks among torch.optim's global step pre-hooks."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return sum(getattr(h, "__module__", "").startswith("shardnorm") for h in _global_optimizer_pre_hooks.values())


def test_optimizer_step_check_only_while_grads_are_pending():
    """torch.optim's global step pre-hook (no step over norm grads still pending) is there only while a reducer
    holds grads accumulated for a step (`_step_with_pending_partials` sees it come and go): importing shardnorm and
    attaching a reducer leave every optimizer as torch leaves it."""
    import subprocess
    import sys

    code = ("import torch, torch.optim.optimizer as o, shardnorm, shardnorm.distributed as d;"
            "d.attach_reducer(torch.nn.Sequential(shardnorm.LayerNorm(4)));"
            "m = torch.nn.Sequential(shardnorm.LayerNorm(4)); d.attach_reducer(m);"
            "m(torch.randn(2, 4)).sum().backward(); torch.optim.SGD(m.parameters()).step();"
            "print(len(o._global_optimizer_pre_hooks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1:] == ["0"], out.stdout


def test_accumulate_and_finalize_leave_a_model_without_a_reducer_as_it_was():
    """Looking the reducer up never creates one: on a model without shardnorm norms, and on one with norms
    but no reducer attached, `shardnorm.accumulate` and `finalize_grads` add no reducer to the model and tag
    no parameter; its grads are the plain sums over the micro-batches, as without them."""
    from shardnorm.distributed import reducer_of

    for make in (lambda: nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4)), NormStack):
        torch.manual_seed(0)
        model, ref = make(), make()
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p.normal_()
                r.copy_(p)
        model_state = set(vars(model))
        param_state = {n: set(vars(p)) for n, p in model.named_parameters()}
        for mb in range(MICRO_BATCHES):
            x = torch.randn(3, HIDDEN)
            with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else nullcontext() as reducer:
                assert reducer is None
                model(x).square().sum().backward()
            ref(x).square().sum().backward()
        shardnorm.finalize_grads(model)
        assert reducer_of(model) is None and set(vars(model)) == model_state, set(vars(model)) - model_state
        for name, p in model.named_parameters():
            assert set(vars(p)) == param_state[name], f"{name} gained {set(vars(p)) - param_state[name]}"
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, r.grad) <= TOL, name


def test_attach_reducer_tags_only_the_norm_params():
    """The reducer's name is carried by the model and by the norm parameters it owns, by nothing else."""
    from shardnorm.distributed import reducer_of
    from shardnorm.distributed.grad_sources import REDUCER_ATTR

    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), NormStack(), nn.Linear(HIDDEN, 2))
    # not parallelized: its norm parameters are no sequence-parallel ones (attached before parallelize_module, the
    # reducer would reduce nothing, silently)
    with pytest.warns(UserWarning, match="found no sequence-parallel norm parameter .* Call attach_reducer after"):
        reducer = attach_reducer(model)
    assert reducer_of(model) is reducer
    for name, p in model.named_parameters():
        owned = name.startswith("1.norms.")
        assert (getattr(p, REDUCER_ATTR, None) is reducer) == owned, f"{name}: {vars(p)}"
    assert not any(hasattr(m, REDUCER_ATTR) for m in model.modules() if m is not model)


class _GatheredBlock(nn.Module):
    """x + out(up(norm(x))): the README's sequence-parallel recipe in one block, the norm gathering its output for
    a `RegatherColwiseParallel` consumer."""

    def __init__(self):
        super().__init__()
        self.norm = shardnorm.RMSNorm(HIDDEN)
        self.up, self.out = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.out(torch.relu(self.up(self.norm(x))))


def _deep_copies(rank, world_size, seed):
    import copy

    from torch.distributed.tensor.parallel import RowwiseParallel

    from shardnorm.distributed import RegatherColwiseParallel, reducer_of

    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(seed)
    for keep_output in (True, False):
        model = _GatheredBlock().to(rank_device(rank))
        model.norm.keep_output = keep_output
        parallelize_module(model, mesh, {"norm": SequenceParallelNorm(output_layouts=Replicate()),
                                         "up": RegatherColwiseParallel(),
                                         "out": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attach_reducer(model)
        assert not [w for w in caught if "no sequence-parallel" in str(w.message)], [str(w.message) for w in caught]
        x = distribute_tensor(torch.randn(2, 4 * world_size, HIDDEN, device=rank_device(rank)), mesh, [Shard(1)])

        def step(m):
            m.zero_grad()
            m(x).square().sum().backward()
            return {n: p.grad.full_tensor() for n, p in m.named_parameters()}

        first = step(model)
        twin = copy.deepcopy(model)  # an EMA copy, torch.optim.swa_utils.AveragedModel: deepcopy(model)
        assert reducer_of(twin) is None and reducer_of(model) is not None
        attach_reducer(twin)
        theirs, again = step(twin), step(model)
        for name, grad in first.items():
            assert torch.equal(theirs[name], grad) and torch.equal(again[name], grad), (keep_output, name)


def test_deep_copy_of_a_model_with_a_reducer():
    """copy.deepcopy of a sequence-parallel model with a reducer (and a gathering keep_output=False norm): the copy
    has no reducer (a reducer holds process groups, which do not copy) until `attach_reducer(copy)`, then trains
    as the original does, which keeps its own. Failed with `cannot pickle ProcessGroup`."""
    spawn(_deep_copies, 2, 11)
