"""Where an HF decoder's keep_output=False step cost goes on one GPU (bench_hf_models' model: 4 layers of 4096,
2 x 4096 tokens, bf16, eager): option off (`convert(keep_output=True)`), on, on with its `.data`-write checks knocked
out (checksums, statistics, comparisons), and on with its tracking knocked out (the saved-tensors hooks alone, nothing
saved as a handle). Steps interleaved one by one, order rotated each round; per variant the median step (CUDA events)
and host time until queued, and the median and range of its step over the option-off step of the same turn.

    ARCH=llama ROUNDS=8 PROFILE=0 python keep_output_checks/hf_ablation.py OUT_DIR     (PYTHONPATH=src:.)
"""
import gc, json, os, statistics, sys, time
import torch
from benchmarks import hf_variants
from benchmarks.common import turns
from shardnorm import output_checks as checks, output_recompute as orc

OUT = sys.argv[1]
ZERO = {}
def zero_fp(t):
    z = ZERO.get(t.device)
    if z is None: z = ZERO[t.device] = torch.zeros((), device=t.device)
    return z
orig = dict(fp=checks.fingerprint, stats=orc._check_statistics, ceq=checks.check_equal, track=orc.track)
KNOCK = {"off": {}, "on": {}, "on_nochecks": {"fp": zero_fp, "stats": lambda *a: None, "ceq": lambda *a, **k: None},
         "on_hooks_only": {"track": lambda *a, **k: None}}
def apply(name):
    k = KNOCK[name]
    checks.fingerprint = k.get("fp", orig["fp"]); orc._check_statistics = k.get("stats", orig["stats"])
    checks.check_equal = k.get("ceq", orig["ceq"]); orc.track = k.get("track", orig["track"])

arch = os.environ.get("ARCH", "llama")
import shardnorm
models = {}
for keep in (True, False):
    m = hf_variants.build(arch, 4, hf_variants.SHAPE, "cuda")
    models[keep] = shardnorm.convert(m, keep_output=keep).model
if os.environ.get("NATIVE") == "1":
    KNOCK["native"] = {}
    models["native"] = hf_variants.build(arch, 4, hf_variants.SHAPE, "cuda")
g = torch.Generator(device="cuda").manual_seed(2)
ids = torch.randint(0, 32000, (2, 4096), device="cuda", generator=g)
def run(name):
    apply(name)
    m = models["native"] if name == "native" else models[name == "off"]
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    for p in m.parameters(): p.grad = None
def timed(name):
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter(); s.record(); run(name); host = time.perf_counter() - t0; e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e), host * 1e3
GCSTAT = {"n": [0, 0, 0], "t": 0.0, "_t0": 0.0}
def _gccb(phase, info):
    if phase == "start": GCSTAT["_t0"] = time.perf_counter()
    else:
        GCSTAT["n"][info["generation"]] += 1; GCSTAT["t"] += time.perf_counter() - GCSTAT["_t0"]
gc.callbacks.append(_gccb)
mode = os.environ.get("GCMODE", "default")
names = os.environ.get("VARIANTS", ",".join(KNOCK)).split(",")
for n in names:
    for _ in range(3): run(n)
res = {n: {"ms": [], "host": [], "gc_n": [0, 0, 0], "gc_ms": 0.0} for n in names}
gc.collect()
if mode == "disable": gc.disable()
if mode == "freeze": gc.freeze()
rounds = int(os.environ.get("ROUNDS", 6))
for r in range(rounds):
    for _ in range(6):
        for n in turns(names, r):
            b = list(GCSTAT["n"]); bt = GCSTAT["t"]
            ms, host = timed(n); res[n]["ms"].append(ms); res[n]["host"].append(host)
            res[n]["gc_n"] = [x + y - z for x, y, z in zip(res[n]["gc_n"], GCSTAT["n"], b)]; res[n]["gc_ms"] += (GCSTAT["t"] - bt) * 1e3
    if 0: print("round", r, {n: round(statistics.median(res[n]["ms"][-6:]), 2) for n in names}, flush=True)
base = res["off"]["ms"]
summary = {}
for n in names:
    ratios = [a / b for a, b in zip(res[n]["ms"], base)]
    summary[n] = dict(median_ms=statistics.median(res[n]["ms"]), host_ms=statistics.median(res[n]["host"]),
                      ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios), gc_n=res[n]["gc_n"], gc_ms=res[n]["gc_ms"])
    print(mode, n, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary[n].items()}, flush=True)
json.dump(dict(arch=arch, summary=summary, raw=res), open(f"{OUT}/gc_{arch}_{mode}_{os.environ.get('NATIVE','0')}.json", "w"), indent=1)

