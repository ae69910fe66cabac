"""The compiled norm's host time by how it is compiled: torch.compile(module) (Dynamo inlines torch.nn classes'
_call_impl, runs a user class's in Python), module.compile(), a plain user module around the norm, the functional."""
import json, os
from pathlib import Path
import torch
import torch.nn.functional as F
import shardnorm
from benchmarks.host_time import host_us_interleaved

OUT = Path(os.environ.get("OUT", "/tmp/out")) / "compiled_gap2"
OUT.mkdir(parents=True, exist_ok=True)
dev, dt = "cuda", torch.bfloat16


class Wrap(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


res = {}
for rms, (m, n) in ((True, (8, 4096)), (False, (8, 1024)), (False, (8, 4096)), (True, (4096, 128))):
    mods = {}
    for who, cls in (("ours", shardnorm.RMSNorm if rms else shardnorm.LayerNorm),
                     ("torch", torch.nn.RMSNorm if rms else torch.nn.LayerNorm)):
        torch.manual_seed(0)
        a, b, c = (cls(n, device=dev, dtype=dt) for _ in range(3))
        b.compile(fullgraph=True)
        w = a.weight
        bias = getattr(a, "bias", None)
        if who == "ours":
            fn = (lambda x, w=w: shardnorm.rms_norm(x, (n,), w)) if rms else \
                (lambda x, w=w, bias=bias: shardnorm.layer_norm(x, (n,), w, bias))
        else:
            fn = (lambda x, w=w: F.rms_norm(x, (n,), w)) if rms else \
                (lambda x, w=w, bias=bias: F.layer_norm(x, (n,), w, bias))
        mods[f"{who}_torch.compile(module)"] = torch.compile(a, fullgraph=True)
        mods[f"{who}_module.compile()"] = b
        mods[f"{who}_torch.compile(Wrap(module))"] = torch.compile(Wrap(c), fullgraph=True)
        mods[f"{who}_torch.compile(functional)"] = torch.compile(fn, fullgraph=True)
    x = torch.randn(m, n, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    label = f"{'rms' if rms else 'ln'} {m}x{n}"
    fwd = host_us_interleaved({k: (lambda f=f: f(x)) for k, f in mods.items()})
    fb = host_us_interleaved({k: (lambda f=f: f(x).backward(dy)) for k, f in mods.items()})
    res[label] = {k: [fwd[k], fb[k]] for k in mods}
    for k in mods:
        print(f"{label:14s} {k:36s} {fwd[k]:7.1f} {fb[k]:7.1f}", flush=True)
    json.dump(res, open(OUT / "compiled_gap2.json", "w"), indent=1)
