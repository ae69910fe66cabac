"""DTensor norms against a single-process run on the full tensor, on 2- and 4-rank gloo meshes.

One spawn per world size runs the whole matrix (spawning is the expensive part): Shard(0), Shard(1),
Shard(-1) inputs; LayerNorm with and without bias, RMSNorm, zero-centered gamma, the fused residual;
norm grads through the bucketed reducer, the per-layer reducer, and no reducer (torch's Partial grads).
Each case runs 4 micro-batches of gradient accumulation and an optimizer step, then compares the
outputs, every grad (x, residual, weight, bias) and the updated params. Data is fresh every run.
"""

from contextlib import nullcontext

import pytest
import torch
from conftest import rel_err
from spawn_ranks import DEVICE, rank_device, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer

pytestmark = pytest.mark.distributed

SHAPE = (4, 6, 20)  # batch, sequence, hidden: sequence 6 over 4 ranks is uneven (one rank gets no rows)
MICRO_BATCHES = 4
TOL = 1e-6
NORMS = {  # name -> (module factory, takes a residual)
    "layer_norm": (lambda: shardnorm.LayerNorm(SHAPE[-1]), False),
    "layer_norm_no_bias_residual": (lambda: shardnorm.LayerNorm(SHAPE[-1], bias=False), True),
    "rms_norm_zero_centered": (lambda: shardnorm.RMSNorm(SHAPE[-1], zero_centered_gamma=True), False),
    "rms_norm_residual": (lambda: shardnorm.RMSNorm(SHAPE[-1]), True),
}
PLACEMENTS = (Shard(0), Shard(1), Shard(-1))
REDUCERS = ("bucketed", "per_layer", None)


def _randomized(factory):
    m = factory()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _parallelize(module, mesh, placement):
    """Token shards: shardnorm's ParallelStyle. Hidden shards: weight/bias sharded like the hidden dim."""
    if placement.dim in (0, 1):
        return parallelize_module(module, mesh, SequenceParallelNorm(sequence_dim=placement.dim))
    for name, p in list(module.named_parameters()):
        module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return module


def _run_case(mesh, norm_name, placement, reducer_mode, seed):
    factory, with_residual = NORMS[norm_name]
    torch.manual_seed(seed)
    ref = _randomized(factory)
    dist_model = _parallelize(factory(), mesh, placement)
    with torch.no_grad():  # same random params on both sides
        for (_, p), (_, r) in zip(dist_model.named_parameters(), ref.named_parameters()):
            p.copy_(distribute_tensor(r.detach(), mesh, p.placements))
    if reducer_mode is not None:
        attach_reducer(dist_model, bucket_cap_mb=1e-4, reduce=reducer_mode)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dist_opt = torch.optim.AdamW(dist_model.parameters(), lr=1e-2)

    def check(what, actual, expected):
        err = rel_err(actual.full_tensor(), expected)
        assert err <= TOL, (f"{norm_name} x {placement} x reducer={reducer_mode} (seed {seed}): "
                            f"{what} rel err {err:.2e}")

    for step in range(MICRO_BATCHES):
        x, residual, dy, dz = (torch.randn(SHAPE) for _ in range(4))
        inputs = [x, residual] if with_residual else [x]
        ref_in = [t.clone().requires_grad_() for t in inputs]
        dist_in = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in inputs]
        ref_out = ref(*ref_in)
        last = step == MICRO_BATCHES - 1
        with (shardnorm.accumulate(dist_model) if not last and reducer_mode else nullcontext()):
            dist_out = dist_model(*dist_in)
            outs = dist_out if with_residual else (dist_out,)
            sum((o * distribute_tensor(g, mesh, [placement])).sum() for o, g in zip(outs, (dy, dz))
                ).full_tensor().backward()
        ref_outs = ref_out if with_residual else (ref_out,)
        sum((o * g).sum() for o, g in zip(ref_outs, (dy, dz))).backward()
        for i, (o, r) in enumerate(zip(outs, ref_outs)):
            assert o.placements == dist_in[0].placements, f"output {i}: {o.placements}"
            check(f"output {i} of micro-batch {step}", o, r)
        for i, (d, r) in enumerate(zip(dist_in, ref_in)):
            check(f"grad of input {i} in micro-batch {step}", d.grad, r.grad)
    for (name, p), (_, r) in zip(dist_model.named_parameters(), ref.named_parameters()):
        check(f"{name}.grad after {MICRO_BATCHES} micro-batches", p.grad, r.grad)
    ref_opt.step()
    dist_opt.step()
    for (name, p), (_, r) in zip(dist_model.named_parameters(), ref.named_parameters()):
        check(f"{name} after the optimizer step", p, r)


def _matrix(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))
    for norm_name in NORMS:
        for placement in PLACEMENTS:
            for reducer_mode in REDUCERS:
                _run_case(mesh, norm_name, placement, reducer_mode, seed)


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtensor_norms_match_single_process(world_size):
    spawn(_matrix, world_size, torch.seed())


LARGE_MEAN_TOL = 1e-5


def _large_mean_rows(rank, world_size, seed):
    """Hidden-sharded LayerNorm of rows whose mean (1e4) is far from zero against their spread (1): E[x^2] -
    mean^2 in fp32 loses the variance there. Output and every grad against a float64 single-process run."""
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(seed)
    shape = (3, 5, 21)  # hidden 21 over 2 ranks: uneven slices
    x = torch.randn(shape) + 1e4 * (1 + 0.1 * torch.rand(shape[:-1] + (1,)))  # fp32 values, a mean per row
    w, b, dy = torch.randn(shape[-1]), torch.randn(shape[-1]), torch.randn(shape)
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    expected = torch.nn.functional.layer_norm(ref[0], shape[-1:], ref[1], ref[2], eps=1e-5)
    (expected * dy.double()).sum().backward()

    xd = distribute_tensor(x, mesh, [Shard(-1)]).requires_grad_()
    wd, bd = (distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for t in (w, b))
    y = shardnorm.layer_norm(xd, shape[-1:], wd, bd, eps=1e-5)
    (y * distribute_tensor(dy, mesh, [Shard(-1)])).sum().full_tensor().backward()
    assert y.dtype == torch.float32
    for what, actual, reference in (("output", y, expected), ("x.grad", xd.grad, ref[0].grad),
                                    ("weight.grad", wd.grad, ref[1].grad), ("bias.grad", bd.grad, ref[2].grad)):
        err = rel_err(actual.full_tensor(), reference)
        assert err <= LARGE_MEAN_TOL, f"rows of mean 1e4, std 1 (seed {seed}): {what} rel err {err:.2e}"


def test_hidden_sharded_layer_norm_rows_with_a_large_mean():
    spawn(_large_mean_rows, 2, torch.seed() % 2**31)


def _hidden_sharded_layouts(rank, world_size, seed):
    """Hidden-sharded norms whose rows are sharded too, on a 2-D (rows x hidden) mesh: weight/bias grads are partial
    sums over the rows' mesh dim, `Partial` there (labelled `Replicate`, `full_tensor()` would be 50-100 % off); and
    a hidden dim too narrow for every rank to hold a column (one rank's slice empty, which must still join the
    statistics' all-gather, or the other ranks wait in it). Output and every grad against a float64 single-process
    run, RMSNorm and LayerNorm with bias, with and without a residual."""
    torch.manual_seed(seed)
    # (mesh, x's placements, shape, eps): a one-element row's x.grad is eps-sized against its output's, which fp32
    # resolves only with a large eps (1e-5 gave a 1e-4 relative error, the cancellation of 1 - xhat^2); its weight
    # and bias grads are single sums over the rows, kept from cancelling (fp32 rounding against a near-zero sum) by
    # dy > 0 and, there, x + residual > 0 and of the order of eps
    cases = [((2, 1), (Shard(0), Shard(-1)), (4, 3, 16), 1e-5), ((1, 2), (Shard(1), Shard(-1)), (2, 4, 16), 1e-5),
             ((2,), (Shard(-1),), (3, 4, 1), 1.0)]
    for mesh_shape, placements, shape, eps in cases:
        mesh = init_device_mesh(DEVICE, mesh_shape)
        param_placements = [Shard(0) if isinstance(p, Shard) and p.dim == -1 else Replicate() for p in placements]
        for rms in (True, False):
            for with_residual in (False, True):
                x, r, w, b = (torch.randn(s) for s in (shape, shape, shape[-1:], shape[-1:]))
                dy = torch.rand(shape) + 0.5
                if shape[-1] == 1:  # x + residual in [0.5, 1.5]: 1 - xhat^2 at least 0.3 with eps 1
                    x, r = torch.rand(shape) * 0.5 + 0.25, torch.rand(shape) * 0.5 + 0.25
                ref = [t.double().requires_grad_() for t in (x, r, w, b)]
                h = ref[0] + ref[1] if with_residual else ref[0]
                expected = torch.nn.functional.rms_norm(h, shape[-1:], ref[2], eps=eps) if rms else \
                    torch.nn.functional.layer_norm(h, shape[-1:], ref[2], ref[3], eps=eps)
                (expected * dy.double()).sum().backward()
                xd, rd = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (x, r))
                wd, bd = (distribute_tensor(t, mesh, param_placements).requires_grad_() for t in (w, b))
                if rms:
                    y = shardnorm.add_rms_norm(xd, rd, shape[-1:], wd, eps=eps)[0] if with_residual else \
                        shardnorm.rms_norm(xd, shape[-1:], wd, eps=eps)
                else:
                    y = shardnorm.add_layer_norm(xd, rd, shape[-1:], wd, bd, eps=eps)[0] if with_residual else \
                        shardnorm.layer_norm(xd, shape[-1:], wd, bd, eps=eps)
                (y * distribute_tensor(dy, mesh, placements)).sum().full_tensor().backward()
                checked = [("output", y, expected), ("x.grad", xd.grad, ref[0].grad), ("weight.grad", wd.grad,
                                                                                        ref[2].grad)]
                if with_residual:
                    checked.append(("residual.grad", rd.grad, ref[1].grad))
                if not rms:
                    checked.append(("bias.grad", bd.grad, ref[3].grad))
                for what, actual, reference in checked:
                    err = rel_err(actual.full_tensor(), reference)
                    assert err <= TOL, (f"mesh {mesh_shape} {placements} rms={rms} residual={with_residual} "
                                        f"(seed {seed}): {what} rel err {err:.2e}")


def test_hidden_sharded_norms_with_sharded_rows_and_empty_slices():
    spawn(_hidden_sharded_layouts, 2, torch.seed() % 2**31)


def _transposed_inputs(rank, world_size, seed):
    """x [b, s, h] sharded over s or h, transposed to [s, b, h] (a non-contiguous local tensor), token-sharded and
    hidden-sharded: the output's global stride is the contiguous one torch's norm gives (x's, over a contiguous
    local tensor, would make a transpose back and a reshape fail), its values and x's grad one process's."""
    torch.manual_seed(seed)
    mesh = init_device_mesh(DEVICE, (world_size,))
    device = rank_device(rank)
    b, s, h = 3, 4, 8
    x, w = torch.randn(b, s, h, device=device), torch.randn(h, device=device)
    # the reshapes merge dims whose first is the only sharded one (torch 2.11's DTensor refuses to flatten a sharded
    # dim into an earlier one)
    for x_placement, w_placement, merged in ((Shard(1), Replicate(), (b, s * h)), (Shard(2), Shard(0), (b * s, h))):
        for name, ours, theirs in (("rms_norm", shardnorm.rms_norm, torch.nn.functional.rms_norm),
                                   ("layer_norm", shardnorm.layer_norm, torch.nn.functional.layer_norm)):
            what = f"{name}, x {x_placement}"
            xd = distribute_tensor(x, mesh, [x_placement]).requires_grad_()
            y = ours(xd.transpose(0, 1), (h,), distribute_tensor(w, mesh, [w_placement]), eps=1e-6)
            out = y.transpose(0, 1).reshape(merged).full_tensor()
            out.square().sum().backward()
            x1 = x.clone().requires_grad_()
            y1 = theirs(x1.transpose(0, 1), (h,), w, eps=1e-6)
            want = y1.transpose(0, 1).reshape(merged)
            want.square().sum().backward()
            assert y.stride() == y1.stride(), f"{what}: global stride {y.stride()}, torch's {y1.stride()}"
            assert rel_err(out, want) < 1e-5 and rel_err(xd.grad.full_tensor(), x1.grad) < 1e-4, what


def test_transposed_dtensor_inputs_give_contiguous_outputs():
    spawn(_transposed_inputs, 2, torch.seed() % 2**31)
