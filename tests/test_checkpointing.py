"""Selective activation checkpointing (SAC) over shardnorm's norms: `torch.utils.checkpoint` with a per-op policy
(`create_selective_checkpoint_contexts`) and torchtitan's own SelectiveAC recompute the norms correctly, eager and
under torch.compile: every grad equals the one without checkpointing, in a pre-norm block with RMSNorm and LayerNorm,
the residual form included.

A policy sees the norm as one op, `torch.ops.shardnorm.norm_fwd.default`, in both modes: compiled, that is the op
in the graph Dynamo traces from the norm's autograd.Function (AOTAutograd then decomposes it, a Triton op, into its
kernels or, on CPU, the reference's aten ops, each tagged with the policy's word for the norm); eager, a call made
under a TorchDispatchMode (SAC's) reaches the kernels through that op rather than directly, so the policy decides
for the norm as a whole and never sees the kernels' output allocations.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import shardnorm
from shardnorm import ops

N = 48
NORM_FWD = torch.ops.shardnorm.norm_fwd.default
NORMS_PER_BLOCK = 3


class PreNormBlock(torch.nn.Module):
    """Attention-like and MLP-like halves behind norms: a plain RMSNorm, then LayerNorm and RMSNorm in the residual
    form (norm(x + residual), x + residual). Returns (y, residual)."""

    def __init__(self, n: int):
        super().__init__()
        self.attn_norm = shardnorm.RMSNorm(n, eps=1e-5)
        self.wqkv = torch.nn.Linear(n, 3 * n)
        self.wo = torch.nn.Linear(n, n)
        self.ffn_norm = shardnorm.LayerNorm(n)
        self.w1 = torch.nn.Linear(n, 2 * n)
        self.w2 = torch.nn.Linear(2 * n, n)
        self.out_norm = shardnorm.RMSNorm(n, eps=1e-5)
        with torch.no_grad():
            for norm in (self.attn_norm, self.ffn_norm, self.out_norm):
                for p in norm.parameters():
                    p.normal_()

    def forward(self, x):
        return self._forward(x, self.attn_norm, self.ffn_norm, self.out_norm)

    def reference(self, x):
        """The same math in float64 with torch's own norms."""
        double = {name: p.detach().double().requires_grad_() for name, p in self.named_parameters()}

        def norm(key, rms):
            def apply(h, residual=None):
                if residual is not None:
                    h = h + residual
                if rms:
                    y = F.rms_norm(h, (h.shape[-1],), double[f"{key}.weight"], 1e-5)
                else:
                    y = F.layer_norm(h, (h.shape[-1],), double[f"{key}.weight"], double[f"{key}.bias"], 1e-5)
                return y if residual is None else (y, h)
            return apply

        linears = {name: functools.partial(F.linear, weight=double[f"{name}.weight"], bias=double[f"{name}.bias"])
                   for name in ("wqkv", "wo", "w1", "w2")}
        return self._forward(x, norm("attn_norm", True), norm("ffn_norm", False), norm("out_norm", True),
                             linears), double

    def _forward(self, x, attn_norm, ffn_norm, out_norm, linears=None):
        wqkv, wo, w1, w2 = (linears[k] for k in ("wqkv", "wo", "w1", "w2")) if linears else \
            (self.wqkv, self.wo, self.w1, self.w2)
        q, k, v = wqkv(attn_norm(x)).chunk(3, dim=-1)
        attn = wo(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v)
        h, residual = ffn_norm(attn, x)
        return out_norm(w2(F.silu(w1(h))), residual)


def _policy(norm_policy: CheckpointPolicy, other_policy: CheckpointPolicy, seen: list):
    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(func)
        return norm_policy if func is NORM_FWD else other_policy
    return policy


def _checkpointed(block, norm_policy, other_policy, seen):
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy(norm_policy, other_policy, seen))
    return lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


def _torchtitan_sac(block):
    """torchtitan's SelectiveAC applied to a model whose `layers` hold the block: matmuls and attention saved (every
    second matmul recomputed), everything else, shardnorm's norms included, recomputed."""
    activation_checkpoint = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": block})
    activation_checkpoint.SelectiveAC(activation_checkpoint.SelectiveAC.Config()).apply(model)
    return model.layers["0"]


@pytest.fixture
def dynamo_lru_cache_restored():
    """torchtitan's SelectiveAC.apply turns Dynamo's LRU cache off for the process: on again afterwards."""
    yield
    torch._C._dynamo.eval_frame._set_lru_cache(True)


def _grads(fn, block, x, g_y, g_r):
    y, residual = fn(x)
    loss = (y * g_y).sum() + (residual * g_r).sum()
    return torch.autograd.grad(loss, [x, *block.parameters()])


def _inputs(seed: int, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x, g_y, g_r = (torch.randn(2, 5, N, generator=gen).to(device) for _ in range(3))
    return x.requires_grad_(), g_y, g_r


POLICIES = {
    "norms recomputed, others must-save": (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE),
    "norms recomputed, others prefer-save": (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.PREFER_SAVE),
    "torchtitan SelectiveAC": None,
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("policy", POLICIES)
def test_selective_checkpointing_grads_equal_no_checkpointing(device, policy, compiled, dynamo_lru_cache_restored):
    """Grads of x and every parameter under SAC equal the uncheckpointed block's: bitwise eager (the recomputed
    norm is the same kernel on the same input), to 1e-5 compiled; both match float64 to 1e-5."""
    torch.manual_seed(1)
    block = PreNormBlock(N).to(device)
    x, g_y, g_r = _inputs(seed=2, device=device)
    want = _grads(block, block, x, g_y, g_r)
    x64 = x.detach().double().requires_grad_()
    (y64, r64), double = block.reference(x64)
    want64 = torch.autograd.grad((y64 * g_y.double()).sum() + (r64 * g_r.double()).sum(), [x64, *double.values()])

    seen = []
    if POLICIES[policy] is None:
        fn = _torchtitan_sac(block)
    else:
        fn = _checkpointed(block, *POLICIES[policy], seen)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    got = _grads(fn, block, x, g_y, g_r)
    if compiled:
        torch._dynamo.reset()

    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, got_grad, want_grad, want_grad64 in zip(names, got, want, want64):
        if compiled:
            assert rel_err(got_grad, want_grad) < 1e-5, name
        else:
            assert torch.equal(got_grad, want_grad), name
        assert rel_err(got_grad, want_grad64) < 1e-5, name
    if POLICIES[policy] is not None:  # compiled, the policy runs at each trace of the forward: each norm, once a trace
        assert seen.count(NORM_FWD) % NORMS_PER_BLOCK == 0 and (compiled or seen.count(NORM_FWD) == NORMS_PER_BLOCK)
        assert seen.count(NORM_FWD) > 0, "the policy sees each norm as one shardnorm op"


@pytest.mark.parametrize("norm_policy, runs", [(CheckpointPolicy.PREFER_RECOMPUTE, 2),
                                               (CheckpointPolicy.MUST_SAVE, 1)], ids=["recompute", "save"])
def test_eager_policy_decides_for_the_norm(device, monkeypatch, norm_policy, runs):
    """Eager, the policy's word on `shardnorm.norm_fwd` is what happens: recomputed, the norm's forward runs again in
    the backward; saved, it runs once. The policy never sees the kernels' output allocations (aten.empty*)."""
    calls = []
    forward = ops._forward

    def counted_forward(*args):
        calls.append(1)
        return forward(*args)

    monkeypatch.setattr(ops, "_forward", counted_forward)
    torch.manual_seed(3)
    block = PreNormBlock(N).to(device)
    x, g_y, g_r = _inputs(seed=4, device=device)
    seen = []
    _grads(_checkpointed(block, norm_policy, CheckpointPolicy.MUST_SAVE, seen), block, x, g_y, g_r)
    assert len(calls) == runs * NORMS_PER_BLOCK
    assert seen.count(NORM_FWD) == NORMS_PER_BLOCK
    assert not [f for f in seen if "empty" in str(f)], seen


@pytest.mark.parametrize("norm_policy, recomputed", [(CheckpointPolicy.PREFER_RECOMPUTE, NORMS_PER_BLOCK),
                                                     (CheckpointPolicy.MUST_SAVE, 0)], ids=["recompute", "save"])
def test_compiled_policy_decides_for_the_norm(norm_policy, recomputed):
    """Compiled, the partitioner follows the policy: the backward graph recomputes each norm's forward, or none. In
    the graphs a norm's forward on CPU is the reference's aten ops (the op decomposed), one rsqrt of its statistics
    each: nothing else in the block takes an rsqrt, and the norms' backwards read the saved one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(5)
    block = PreNormBlock(N)
    x, g_y, g_r = _inputs(seed=6)
    torch._dynamo.reset()
    fn = torch.compile(_checkpointed(block, norm_policy, CheckpointPolicy.MUST_SAVE, []), fullgraph=True,
                       backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    _grads(fn, block, x, g_y, g_r)
    torch._dynamo.reset()
    forward_graph, backward_graph = graphs
    count = lambda gm: sum(node.target is torch.ops.aten.rsqrt.default for node in gm.graph.nodes)  # noqa: E731
    assert count(forward_graph) == NORMS_PER_BLOCK
    assert count(backward_graph) == recomputed
