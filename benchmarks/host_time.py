"""Host (CPU) time per norm call at small shapes, where the GPU work is negligible.

    python benchmarks/host_time.py --out OUT_DIR     # CUDA: every row; without CUDA, CPU tensors (torch backend)

Host time of one call: time.perf_counter around CALLS calls queued back to back (no sync inside the timed loop,
one before and after), the median of ROUNDS rounds, the best of 3 such medians. The providers of a shape take
turns round by round, so a slow stretch of the shared CPU falls on all of them. Rows, forward and
forward+backward (`y.backward(dy)`): shardnorm's module against torch's `nn.RMSNorm` / `nn.LayerNorm` module,
shardnorm's functional call against torch's `F.rms_norm` / `F.layer_norm`, Liger's module where importable, and
shardnorm's autograd node taking the ops (`shardnorm_ops`: the way compiled graphs, dispatch modes and tensor
subclasses reach the kernels, here in eager), what eager calls on plain tensors avoid by calling the launchers
directly (ops.py says why); and both modules under `torch.compile(fullgraph=True)`
(`*_module_compiled`): what a compiled graph pays per norm, shardnorm's ops against the norm Inductor
generates (guards and the compiled-function wrappers, the same for both, included).
Writes OUT_DIR/host_time.json and OUT_DIR/host_time.md.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import shardnorm
from shardnorm import ops

SHAPES = ((8, 4096), (8, 1024), (4096, 128))
ROUNDS, CALLS = 7, 50


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us_interleaved(fns: dict, calls=CALLS, rounds=ROUNDS, best_of=3) -> dict:
    """Host microseconds per call of each `name: fn`, the fns taking turns within every round (in an order
    rotated round by round): best of `best_of` medians over `rounds` rounds of `calls` calls."""
    names = list(fns)
    for fn in fns.values():  # warm-up: compile kernels, fill caches
        for _ in range(3):
            fn()
    best = {}
    for _ in range(best_of):
        samples = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    fns[name]()
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
                sync()
        for name in names:
            best[name] = min(best.get(name, float("inf")), statistics.median(samples[name]))
    return best


def profile_text(fn, calls: int = 200, top: int = 30) -> str:
    """cProfile of `calls` calls of fn (after a warm-up): the `top` functions by own time, then by cumulative
    time; where a provider's host time goes."""
    for _ in range(3):
        fn()
    sync()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    sync()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"{calls} calls\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def write_profiles(out: str, label: str, fns: dict) -> None:
    """OUT/profile/<label>-<provider>.txt for each provider in `fns`."""
    os.makedirs(os.path.join(out, "profile"), exist_ok=True)
    for name in fns:
        with open(os.path.join(out, "profile", f"{label}-{name}.txt"), "w") as f:
            f.write(profile_text(fns[name]))


def providers(rms: bool, n: int, device, dtype):
    ours = (shardnorm.RMSNorm if rms else shardnorm.LayerNorm)(n, device=device, dtype=dtype)
    theirs = (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(n, device=device, dtype=dtype)
    with torch.no_grad():
        for p in list(ours.parameters()) + list(theirs.parameters()):
            p.normal_()
    w, b = ours.weight, getattr(ours, "bias", None)
    result = {
        "shardnorm_module": ours,
        "torch_module": theirs,
        "shardnorm_module_compiled": torch.compile(ours, fullgraph=True),
        "torch_module_compiled": torch.compile(theirs, fullgraph=True),
        "shardnorm_functional": (lambda x: shardnorm.rms_norm(x, (n,), w)) if rms else
        (lambda x: shardnorm.layer_norm(x, (n,), w, b)),
        "torch_functional": (lambda x: F.rms_norm(x, (n,), w)) if rms else (lambda x: F.layer_norm(x, (n,), w, b)),
        "shardnorm_ops": lambda x: ops._NormFunction.apply(x, w, b, None, 1e-6, rms, False, False),
    }
    try:
        if rms:
            from liger_kernel.transformers import LigerRMSNorm

            liger = LigerRMSNorm(n).to(device=device, dtype=dtype)
        else:
            from liger_kernel.transformers import LigerLayerNorm

            liger = LigerLayerNorm(n).to(device=device, dtype=dtype)
        result["liger_module"] = liger
    except Exception:  # not installed, or no GPU
        pass
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", nargs="*", help="MxN (default 8x4096 8x1024 4096x128)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a cProfile of each provider's forward+backward to OUT/profile/")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    rows = []
    for rms in (True, False):
        for m, n in shapes:
            x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(m, n, device=device, dtype=dtype)
            fns = providers(rms, n, device, dtype)
            forward = host_us_interleaved({name: (lambda f=f: f(x)) for name, f in fns.items()})
            steps = {name: (lambda f=f: f(x).backward(dy)) for name, f in fns.items()}
            backward = host_us_interleaved(steps)
            if args.profile:
                write_profiles(args.out, f"{'rms' if rms else 'ln'}-{m}x{n}", steps)
            for name in fns:
                rows.append({"norm": "rms" if rms else "ln", "m": m, "n": n, "provider": name,
                             "forward_us": forward[name], "forward_backward_us": backward[name]})
                print(rows[-1], flush=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "dtype": str(dtype)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_time.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    lines = [f"Host us per call, {env['device']}, {dtype}, torch {env['torch']}", "",
             "| norm | M x N | provider | forward | forward+backward |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['norm']} | {r['m']} x {r['n']} | {r['provider']} | {r['forward_us']:.1f} | "
                     f"{r['forward_backward_us']:.1f} |")
    with open(os.path.join(args.out, "host_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
