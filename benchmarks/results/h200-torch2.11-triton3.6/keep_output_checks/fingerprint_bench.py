"""The hashed fingerprint kernel against the plain int32 sum it replaces: GPU time (do_bench, best of 3)
and host time per call (a loop of calls, one sync), on the cases of checksum_bench.py; and a tile sweep."""
import json, os, time, statistics
from pathlib import Path
import torch, triton.testing as tt
from shardnorm import output_checks
from shardnorm.kernels import fingerprint as K
from shardnorm.kernels.launch import Launcher

OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
cases = {"bf16 8192x4096": torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16),
         "bf16 q 2x4096x32x128 view": torch.randn(2, 4096, 32 * 128, device="cuda", dtype=torch.bfloat16).view(2, 4096, 32, 128).transpose(1, 2),
         "bf16 k^T 2x32x128x4096 view": torch.randn(2, 32, 4096, 128, device="cuda", dtype=torch.bfloat16).transpose(2, 3),
         "fp32 8192x4096": torch.randn(8192, 4096, device="cuda"),
         "bf16 8192x1024": torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16),
         "bf16 8x4096": torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)}
def old_sum(t):
    return output_checks._words(t).sum(dtype=torch.int32)
def host_us(fn, calls=200, rounds=7):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(rounds):
        s = time.perf_counter()
        for _ in range(calls): fn()
        xs.append((time.perf_counter() - s) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(xs)
res = {}
for name, t in cases.items():
    nbytes = t.numel() * t.element_size()
    row = {}
    for label, fn in (("old int32 sum", old_sum), ("fingerprint", output_checks.fingerprint)):
        ms = min(tt.do_bench(lambda: fn(t), warmup=50, rep=200) for _ in range(3))
        row[label] = {"gpu_us": ms * 1e3, "GBps": nbytes / ms / 1e6, "host_us": host_us(lambda: fn(t))}
    words = output_checks._words_4d(output_checks._words(t))
    for rpb, bn, w in (() if os.environ.get('NO_SWEEP') else ((4, 1024, 4), (8, 512, 4), (2, 1024, 4), (8, 1024, 8), (16, 256, 4), (1, 1024, 4), (4, 1024, 8), (32, 128, 4))):
        if bn > 2 * words.shape[-1] and bn > 128: continue
        launch = Launcher(K.fingerprint_kernel, w, BLOCK_R=rpb, BLOCK_N=bn, WORD_BITS=8 * words.element_size())
        d0, d1, d2, n = words.shape; r = d0 * d1 * d2
        out = torch.empty(-(-r // rpb), dtype=torch.int32, device="cuda")
        f = lambda: launch((out.numel(),), words, out, r, n, d1, d2, *words.stride())
        ms = min(tt.do_bench(f, warmup=50, rep=200) for _ in range(3))
        row[f"tile {rpb}x{bn} w{w}"] = {"gpu_us": ms * 1e3, "GBps": nbytes / ms / 1e6}
    res[name] = row
    print(name, {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in row.items()}, flush=True)
    json.dump(res, open(OUT / "fingerprint_bench.json", "w"), indent=1)
