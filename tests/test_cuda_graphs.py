"""CUDA graphs: a block of shardnorm norms and linears gives eager's outputs and grads under
torch.compile(mode="reduce-overhead") (cudagraph trees) and under manual torch.cuda.graph capture of
forward+backward, each checked against a float64 reference on fresh random data.

What could break a capture on our path: a host sync (.item(), .cpu(), synchronize) or a first-call
Triton compile inside the capture (the Launcher's first call per key goes through kernel[grid]).
The eager path has no sync; the warm-up on a side stream compiles every kernel first, as torch's
docs prescribe. No reducer is attached, so no collective code runs.
"""

import copy

import pytest
import torch
from torch import nn

import shardnorm
from conftest import reference_norm, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

D = 256
OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32 against float64, through three linears
SAME_TOL = 1e-5  # against eager fp32 on the same data: rounding only (compile may fuse a bias add)


class Block(nn.Module):
    """Linear -> RMSNorm -> Linear -> fused residual add + RMSNorm (module) -> fused add + LayerNorm
    (functional)."""

    def __init__(self, d=D):
        super().__init__()
        self.inp, self.mid = nn.Linear(d, d), nn.Linear(d, d)
        self.norm1 = shardnorm.RMSNorm(d, eps=1e-6)
        self.norm2 = shardnorm.RMSNorm(d, eps=1e-6)
        self.out_norm = shardnorm.LayerNorm(d)

    def forward(self, x):
        h = self.inp(x)
        y, res = self.norm2(self.mid(self.norm1(h)), residual=h)
        out, _ = shardnorm.functional.add_layer_norm(y, res, D, self.out_norm.weight, self.out_norm.bias)
        return out


def reference(block, x):
    """The block in float64 (torch ops only): output and grads of (x, *parameters) for sum(out * dy)."""
    params = {n: p.detach().double().requires_grad_() for n, p in block.named_parameters()}
    xd = x.detach().double().requires_grad_()
    h = xd @ params["inp.weight"].T + params["inp.bias"]
    m = reference_norm(h, params["norm1.weight"], None, None, 1e-6, True) @ params["mid.weight"].T + params["mid.bias"]
    y = reference_norm(m, params["norm2.weight"], None, h, 1e-6, True)
    out = reference_norm(y, params["out_norm.weight"], params["out_norm.bias"], m + h, 1e-5, False)
    return out, xd, params


def make_block(seed):
    torch.manual_seed(seed)
    block = Block().cuda()
    with torch.no_grad():  # random norm parameters: ones/zeros would hide a wrong weight or bias
        for name, p in block.named_parameters():
            if "norm" in name:
                p.normal_()
    return block


def fresh_inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4, 8, D, device="cuda", generator=g)
    dy = torch.randn(4, 8, D, device="cuda", generator=g)
    return x, dy


def check_against_reference(block, x, dy, out, x_grad, grads):
    ref, xd, params = reference(block, x)
    ref.backward(dy.double())
    assert rel_err(out, ref) < OUT_TOL
    assert rel_err(x_grad, xd.grad) < GRAD_TOL
    for name, p in params.items():
        assert rel_err(grads[name], p.grad) < GRAD_TOL, name


def eager_step(block, x, dy):
    block.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    out = block(xg)
    out.backward(dy)
    return out.detach(), xg.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def test_eager_block_matches_float64():
    block = make_block(0)
    x, dy = fresh_inputs(1)
    check_against_reference(block, x, dy, *eager_step(block, x, dy))


def test_compile_reduce_overhead_matches_eager():
    """Several steps with new data each, so cudagraph trees warm up, record and then replay."""
    torch._dynamo.reset()
    block = make_block(2)
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    from torch._dynamo.utils import counters

    skips_before = counters["inductor"]["cudagraph_skips"]
    for step in range(5):
        x, dy = fresh_inputs(10 + step)
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = compiled(xg)
        out.backward(dy)
        got = (out.detach().clone(), xg.grad.clone(), {n: p.grad.clone() for n, p in block.named_parameters()})
        want = eager_step(eager, x, dy)
        assert rel_err(got[0], want[0]) < SAME_TOL and rel_err(got[1], want[1]) < SAME_TOL
        for name in want[2]:
            assert rel_err(got[2][name], want[2][name]) < SAME_TOL, name
        check_against_reference(block, x, dy, *got)
    assert counters["inductor"]["cudagraph_skips"] == skips_before, "cudagraph trees skipped the block"


def test_manual_capture_of_forward_and_backward_matches_eager():
    block = make_block(3)
    eager = copy.deepcopy(block)
    x0, dy0 = fresh_inputs(20)
    static_x, static_dy = x0.clone().requires_grad_(), dy0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: every kernel compiled and cached before the capture
        for _ in range(3):
            block.zero_grad(set_to_none=True)
            static_x.grad = None
            block(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    block.zero_grad(set_to_none=True)  # grads allocated inside the capture, from the graph's pool
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_x)
        static_out.backward(static_dy)
    for step in range(3):
        x, dy = fresh_inputs(21 + step)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        graph.replay()
        got = (static_out.detach().clone(), static_x.grad.clone(),
               {n: p.grad.clone() for n, p in block.named_parameters()})
        want = eager_step(eager, x, dy)
        assert rel_err(got[0], want[0]) < SAME_TOL and rel_err(got[1], want[1]) < SAME_TOL
        for name in want[2]:
            assert rel_err(got[2][name], want[2][name]) < SAME_TOL, name
        check_against_reference(block, x, dy, *got)
