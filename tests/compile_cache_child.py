"""One fresh process of test_compile_fusion.py's FX graph cache test: a pre-norm block whose norm feeds three
projections, compiled with shardnorm's passes enabled after a pass of the user's own, forward and backward.
Prints one JSON line: Inductor's FX graph cache counters, what the passes fused, a digest of the pickled pass
slots (torch 2.11 pickles them into the cache key) and the grads."""

import hashlib
import json
import pickle

import torch

import shardnorm
from shardnorm import _torch_compat, compile_fusion


class UserPass(_torch_compat.inductor_graph_pass_base()):
    """A user's own pre-grad pass, set before shardnorm's: counts the graphs it sees."""

    calls = 0

    def __call__(self, graph):
        UserPass.calls += 1

    def uuid(self):
        return "user-pass-1"


class Block(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.norm = shardnorm.RMSNorm(n)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(n, 8 * (i + 1), bias=False) for i in range(3))
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, a, b):
        h = a + b
        y = self.norm(h)
        return torch.cat([head(y) for head in self.heads], dim=-1), h


def main():
    _torch_compat.set_inductor_graph_pass(_torch_compat.INDUCTOR_PRE_GRAD_SLOT, UserPass())
    compile_fusion.enable()
    slots = tuple(_torch_compat.inductor_graph_pass(slot) for slot in _torch_compat.INDUCTOR_PASS_SLOTS)
    torch.manual_seed(0)
    model = Block(32)
    a, b = (torch.randn(2, 3, 32, requires_grad=True) for _ in range(2))  # 3-D: CPU Inductor turns 2-D mm + add into addmm
    out, h = torch.compile(model, fullgraph=True)(a, b)
    (out.square().sum() + h.sum()).backward()
    counters = torch._dynamo.utils.counters["inductor"]
    print(json.dumps({
        "fxgraph_cache_hit": counters["fxgraph_cache_hit"], "fxgraph_cache_miss": counters["fxgraph_cache_miss"],
        "fxgraph_cache_bypass": counters["fxgraph_cache_bypass"],
        "fused_adds": compile_fusion.counts["fused_adds"], "fused_grad_terms": compile_fusion.counts["fused_grad_terms"],
        "user_pass_calls": UserPass.calls, "slots_digest": hashlib.sha256(pickle.dumps(slots)).hexdigest(),
        "grads": [t.grad.double().norm().item() for t in (a, b, model.norm.weight)],
    }))


if __name__ == "__main__":
    main()
