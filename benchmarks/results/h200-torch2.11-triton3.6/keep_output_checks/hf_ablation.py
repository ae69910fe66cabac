"""Where an HF decoder's keep_output=False step cost goes on one GPU (bench_hf_models' model: 4 layers of 4096,
2 x 4096 tokens, bf16, eager): option off (`convert(keep_output=True)`), on, on with its `.data`-write checks knocked
out (checksums, statistics, comparisons), and on with its tracking knocked out (the saved-tensors hooks alone, nothing
saved as a handle). Steps interleaved one by one, order rotated each round; per variant the median step (CUDA events)
and host time until queued, and the median and range of its step over the option-off step of the same turn.

    ARCH=llama ROUNDS=8 PROFILE=0 python keep_output_checks/hf_ablation.py OUT_DIR     (PYTHONPATH=src:.)

NATIVE=1 adds the model's own norms as a variant; GCMODE=default|disable|freeze counts Python's garbage collections
per variant (and turns the collector off, or freezes what exists, before the timed steps), written to
gc_<arch>_<mode>_<NATIVE>.json instead of hf_ablation_<arch>.json.
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
GCSTAT = {"n": [0, 0, 0], "t": 0.0, "t0": 0.0}
def on_gc(phase, info):
    if phase == "start": GCSTAT["t0"] = time.perf_counter()
    else: GCSTAT["n"][info["generation"]] += 1; GCSTAT["t"] += time.perf_counter() - GCSTAT["t0"]
gc_mode = os.environ.get("GCMODE")
if gc_mode: gc.callbacks.append(on_gc)
names = os.environ.get("VARIANTS", ",".join(KNOCK)).split(",")
for n in names:
    for _ in range(3): run(n)
res = {n: {"ms": [], "host": [], "gc_n": [0, 0, 0], "gc_ms": 0.0} for n in names}
gc.collect()
if gc_mode == "disable": gc.disable()
if gc_mode == "freeze": gc.freeze()
rounds = int(os.environ.get("ROUNDS", 6))
for r in range(rounds):
    for _ in range(6):
        for n in turns(names, r):
            n_before, t_before = list(GCSTAT["n"]), GCSTAT["t"]
            ms, host = timed(n); res[n]["ms"].append(ms); res[n]["host"].append(host)
            res[n]["gc_n"] = [a + b - c for a, b, c in zip(res[n]["gc_n"], GCSTAT["n"], n_before)]
            res[n]["gc_ms"] += (GCSTAT["t"] - t_before) * 1e3
    print("round", r, {n: round(statistics.median(res[n]["ms"][-6:]), 2) for n in names}, flush=True)
base = res["off"]["ms"]
summary = {}
for n in names:
    ratios = [a / b for a, b in zip(res[n]["ms"], base)]
    summary[n] = dict(median_ms=statistics.median(res[n]["ms"]), host_ms=statistics.median(res[n]["host"]),
                      ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                      gc_n=res[n]["gc_n"], gc_ms=res[n]["gc_ms"])
    print(n, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary[n].items()}, flush=True)
name = f"gc_{arch}_{gc_mode}_{os.environ.get('NATIVE', '0')}.json" if gc_mode else f"hf_ablation_{arch}.json"
json.dump(dict(arch=arch, summary=summary, raw=res), open(f"{OUT}/{name}", "w"), indent=1)

if os.environ.get("PROFILE", "1") == "0": sys.exit(0)
from torch.profiler import profile, ProfilerActivity
prof_summary = {}
for n in ("off", "on"):
    run(n); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run(n)
            torch.cuda.synchronize()
    path = f"{OUT}/trace_{n}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    os.remove(path)
    ks = sorted([e for e in ev if e.get("cat") == "kernel" and "dur" in e], key=lambda e: e["ts"])
    rt = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    cpu = sorted([e for e in ev if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e], key=lambda e: e["ts"])
    steps, cur = [], [ks[0]]
    for a, b in zip(ks, ks[1:]):
        if b["ts"] - (a["ts"] + a["dur"]) > 3000: steps.append(cur); cur = []
        cur.append(b)
    steps.append(cur)
    out = []
    for st in steps:
        busy = sum(e["dur"] for e in st) / 1e3
        span = (st[-1]["ts"] + st[-1]["dur"] - st[0]["ts"]) / 1e3
        gaps, end = [], st[0]["ts"] + st[0]["dur"]
        for prev, e in zip(st, st[1:]):
            g = e["ts"] - end
            if g > 30:
                r = rt.get(e["args"].get("correlation"))
                host = ""
                if r is not None:
                    enc = [c for c in cpu if c["ts"] <= r["ts"] <= c["ts"] + c["dur"] and c.get("tid") == r.get("tid")]
                    host = " < ".join(c["name"][:40] for c in enc[-4:])
                gaps.append((round(g / 1e3, 3), round((e["ts"] - st[0]["ts"]) / 1e3, 2), prev["name"][:40], e["name"][:40], host))
            end = max(end, e["ts"] + e["dur"])
        gaps.sort(reverse=True)
        out.append(dict(busy=busy, span=span, n_kernels=len(st), gap_ms=sum(g[0] for g in gaps), top=gaps[:10]))
    prof_summary[n] = out
    for o in out:
        print(n, round(o["busy"], 2), round(o["span"], 2), o["n_kernels"], round(o["gap_ms"], 3), flush=True)
        for g in o["top"][:6]: print("   ", g, flush=True)
json.dump(prof_summary, open(f"{OUT}/hf_ablation_syncprofile_{arch}.json", "w"), indent=1)
