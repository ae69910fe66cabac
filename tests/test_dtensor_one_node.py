"""The eager sequence-parallel norm is the norm's one autograd node (`ops._NormFunction` taking the DTensors,
`distributed/dtensor.py`): the graph it records, and second-order grads through it against torch's norm on the whole
tensor (2 gloo ranks, fresh data)."""

import pytest
import torch
from spawn_ranks import DEVICE, rank_device, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import SequenceParallelNorm

pytestmark = pytest.mark.distributed
TOL = 1e-5


def _body(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(seed)  # the same data on every rank
    hidden = 8
    weight, x_full, r_full = torch.randn(hidden), torch.randn(2, 4, hidden), torch.randn(2, 4, hidden)
    for residual in (False, True):
        norm = parallelize_module(shardnorm.RMSNorm(hidden, device=rank_device(rank)), mesh, SequenceParallelNorm())
        with torch.no_grad():
            norm.weight.copy_(distribute_tensor(weight, mesh, norm.weight.placements))
        x = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
        r = distribute_tensor(r_full, mesh, [Shard(1)]).requires_grad_()
        y = norm(x, r)[0] if residual else norm(x)
        # one node between the norm's output and its DTensor inputs / weight (the composed path had to_local,
        # the kernel's Function and from_local between them)
        node = y.grad_fn
        assert type(node).__name__ == "_NormFunctionBackward", (residual, type(node).__name__)
        leaves = {type(f).__name__ for f, _ in node.next_functions if f is not None}
        assert leaves == {"AccumulateGrad"}, (residual, leaves)
        # second order: d/dx of sum(y^2), then backward of its square, against torch on the whole tensor
        (gx,) = torch.autograd.grad((y * y).sum().full_tensor(), x, create_graph=True)
        (gx * gx).sum().full_tensor().backward()
        ref_w = weight.double().requires_grad_()
        ref_x, ref_r = x_full.double().requires_grad_(), r_full.double().requires_grad_()
        src = ref_x + ref_r if residual else ref_x
        ref_y = torch.nn.functional.rms_norm(src, (hidden,), ref_w)
        (ref_gx,) = torch.autograd.grad((ref_y * ref_y).sum(), ref_x, create_graph=True)
        (ref_gx * ref_gx).sum().backward()
        for what, got, want in (("x.grad", x.grad, ref_x.grad), ("weight.grad", norm.weight.grad, ref_w.grad)) + \
                ((("residual.grad", r.grad, ref_r.grad),) if residual else ()):
            got = got.full_tensor().double().cpu()
            err = ((got - want).norm() / want.norm()).item()
            assert err <= TOL, f"residual={residual} (seed {seed}): second-order {what} rel err {err:.2e}"


def test_one_node_and_second_order_grads_match_torch():
    spawn(_body, 2, torch.seed() % 2**31)
