"""Where the compiled forward's extra host time goes: shardnorm's compiled norm vs Inductor's own, forward only."""
import json, os
from pathlib import Path
import torch
import shardnorm
from benchmarks.host_time import host_us_interleaved, profile_text

OUT = Path(os.environ.get("OUT", "/tmp/out")) / "compiled_gap"
OUT.mkdir(parents=True, exist_ok=True)
dev, dt = "cuda", torch.bfloat16
res = {}
for rms, (m, n) in ((True, (8, 4096)), (False, (8, 1024))):
    ours = (shardnorm.RMSNorm if rms else shardnorm.LayerNorm)(n, device=dev, dtype=dt)
    theirs = (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(n, device=dev, dtype=dt)
    co, ct = torch.compile(ours, fullgraph=True), torch.compile(theirs, fullgraph=True)
    x = torch.randn(m, n, device=dev, dtype=dt, requires_grad=True)
    xi = x.detach()
    label = f"{'rms' if rms else 'ln'}_{m}x{n}"
    fns = {"ours_fwd": lambda: co(x), "torch_fwd": lambda: ct(x),
           "ours_nograd": lambda: co(xi), "torch_nograd": lambda: ct(xi),
           "ours_eager": lambda: ours(x), "torch_eager": lambda: theirs(x)}
    us = host_us_interleaved(fns)
    res[label] = us
    print(label, {k: round(v, 2) for k, v in us.items()}, flush=True)
    for name in ("ours_fwd", "torch_fwd", "ours_nograd", "torch_nograd"):
        (OUT / f"{label}-{name}.prof.txt").write_text(profile_text(fns[name], calls=500, top=40))
    json.dump(res, open(OUT / "us.json", "w"), indent=1)
