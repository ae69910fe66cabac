"""`sequence_gather.gather_sequence`: a sequence-sharded norm output all-gathered on the local tensors. Outputs and
grads bitwise `DTensor.redistribute`'s for every grad layout it takes itself (a `Partial` sum, `Replicate`) and every
sharded dim; what it does not take (another grad layout, uneven shards, a backward that builds a graph, a dispatch
mode) goes through the redistribute, with the same values."""

import pytest
import torch

D, H = 3, 4


def _gathers(rank, world_size):
    from spawn_ranks import DEVICE, rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardnorm.distributed import sequence_gather

    device = rank_device(rank)
    mesh = init_device_mesh(DEVICE, (world_size,))
    local_path = []
    apply = sequence_gather._GatherSequence.apply

    def counted(*args):
        local_path.append(1)
        return apply(*args)

    sequence_gather._GatherSequence.apply = counted

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(7)
    cases = [(1, (2, 8 * world_size, H), "partial"), (1, (1, 4 * world_size, H), "replicate"),
             (2, (2, D, 4 * world_size, H), "partial"), (0, (4 * world_size, H), "partial"),
             (1, (2, 8 * world_size, H), "shard"), (1, (2, 8 * world_size + 1, H), "partial"),
             (1, (2, 8 * world_size, H), "create_graph"), (1, (2, 8 * world_size, H), "dispatch_mode")]
    for dim, shape, grad_layout in cases:
        full = torch.randn(shape, generator=g, dtype=torch.float64).to(device, torch.bfloat16)
        grads = [torch.randn(shape, generator=g, dtype=torch.float64).to(device, torch.bfloat16)
                 for _ in range(world_size)]
        results = []
        for lean in (False, True):
            y = distribute_tensor(full, mesh, (Shard(dim),)).detach().requires_grad_()
            taken = len(local_path)
            mode = Passing() if grad_layout == "dispatch_mode" else None
            if mode is not None:
                mode.__enter__()
            h = y * 1
            if lean:
                out = sequence_gather.gather_sequence(h, torch.nn.Module())
            else:
                out = h.redistribute(placements=(Replicate(),))
            if mode is not None:
                mode.__exit__(None, None, None)
            expect_local = lean and grad_layout != "dispatch_mode" and shape[dim] % world_size == 0 and world_size > 1
            assert len(local_path) - taken == expect_local, (shape, dim, grad_layout)
            assert out.placements == (Replicate(),) and out.shape == full.shape and out.stride() == full.stride()
            if grad_layout == "replicate":
                grad = DTensor.from_local(grads[0], mesh, (Replicate(),))
            elif grad_layout == "shard":
                grad = DTensor.from_local(grads[0].chunk(world_size, 0)[rank].contiguous(), mesh, (Shard(0),))
            else:
                grad = DTensor.from_local(grads[rank], mesh, (Partial(),))
            create_graph = grad_layout == "create_graph"
            if create_graph:  # a backward that records a graph: the redistribute's own backward
                grad = grad.detach().requires_grad_()
            (dy,) = torch.autograd.grad(out, y, grad, create_graph=create_graph)
            assert dy.placements == y.placements and dy.shape == y.shape
            results.append((out.to_local(), dy))
        (out_ref, dy_ref), (out_lean, dy_lean) = results
        assert torch.equal(out_ref, out_lean)
        assert torch.equal(dy_ref.to_local(), dy_lean.to_local()), (shape, dim, grad_layout)
        assert dy_ref.requires_grad == dy_lean.requires_grad  # create_graph: differentiable where torch's is
        assert torch.equal(out_lean, full)
        if grad_layout == "partial" and shape[dim] % world_size == 0:  # the sum itself, against float64
            expect = torch.stack([t.double() for t in grads]).sum(0).chunk(world_size, dim)[rank]
            torch.testing.assert_close(dy_lean.to_local().double(), expect, rtol=2e-2, atol=2e-2)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 1])
def test_gather_matches_redistribute_bitwise(world_size):
    """Two ranks: the local path. One rank: DTensor's redistribute, which gathers nothing."""
    from spawn_ranks import spawn

    spawn(_gathers, world_size)
