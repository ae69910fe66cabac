"""GPU time of shardnorm's kernels at the kernel benchmark's shapes, without host time.

`bench_kernels.py` times what a user sees (autograd, Python, launches): at small rows that is the
GPU machine's shared CPU, which moves those medians by 2x between runs. Here the bare launchers
(`kernels.norm_fwd` / `norm_bwd`, default configs) are replayed from a CUDA graph (`do_bench_cudagraph`, best
of 3 medians), so the numbers say what the kernels reach and stay comparable across runs.
Same byte counts and copy ceiling as bench_kernels.py (forward: read x, write y; backward: read x
and dy, write dx; do_bench of a device-to-device copy). Outputs are not checked here: the kernel
tests and bench_kernels.py do that.

    python benchmarks/kernel_gpu_time.py --out kernel_gpu_time.json [--weights bfloat16,float32] [--min-n 14336]

With shardnorm's default settings (the specialized long-row kernels where the GPU has them);
SHARDNORM_PORTABLE_KERNELS=1 times the portable ones.
"""

import argparse
import json
import os

import torch
from triton.testing import do_bench_cudagraph

from bench_kernels import GENAI, LLAMA, QK_NORM, copy_bandwidth
from shardnorm.kernels import norm_bwd, norm_fwd

ROUNDS = 3  # best of ROUNDS medians


def inputs(n: int, rms: bool, m: int, weight_dtype: torch.dtype):
    """bf16 x [m, n] and dy, weight (and bias) in weight_dtype, and the forward's statistics."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=weight_dtype)
    b = None if rms else torch.randn(n, device="cuda", dtype=weight_dtype)
    dy = torch.randn_like(x)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-6, rms, False)
    return x, w, b, dy, mean, rstd


def call(direction, rms, t):
    x, w, b, dy, mean, rstd = t
    if direction == "fwd":
        return lambda: norm_fwd(x, w, b, None, 1e-6, rms, False)
    return lambda: norm_bwd(dy, None, x, w, mean, rstd, b is not None, rms, False)


def gpu_gbs(m: int, n: int, rms: bool, weight_dtype: torch.dtype) -> tuple:
    """(forward, backward) GB/s of the bare launchers for one shape."""
    t = inputs(n, rms, m, weight_dtype)
    fwd_ms, bwd_ms = (min(do_bench_cudagraph(call(direction, rms, t), return_mode="median") for _ in range(ROUNDS))
                      for direction in ("fwd", "bwd"))
    nbytes = m * n * t[0].element_size()
    return 2 * nbytes / fwd_ms / 1e6, 3 * nbytes / bwd_ms / 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--weights", default="bfloat16,float32")
    parser.add_argument("--min-n", type=int, default=0, help="only shapes with N >= this (e.g. 14336: long rows)")
    args = parser.parse_args(argv)
    kernels = "portable" if os.environ.get("SHARDNORM_PORTABLE_KERNELS") == "1" else "default"
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s, {kernels} kernels", flush=True)
    rows = []
    for weights in args.weights.split(","):
        for norm in ("layer", "rms"):
            for m, n in [(m, n) for m, n in GENAI + LLAMA + QK_NORM if n >= args.min_n]:
                fwd, bwd = gpu_gbs(m, n, norm == "rms", getattr(torch, weights))
                rows.append(dict(norm=norm, weight_dtype=weights, M=m, N=n, fwd_gbs=fwd, bwd_gbs=bwd,
                                 fwd_of_copy=fwd / copy_gbs, bwd_of_copy=bwd / copy_gbs))
                print(f"{norm:5s} {weights:8s} {m:6d} x {n:5d}  fwd {fwd:5.0f} GB/s ({fwd / copy_gbs:4.0%})  "
                      f"bwd {bwd:5.0f} GB/s ({bwd / copy_gbs:4.0%})", flush=True)
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), copy_gbs=copy_gbs, kernels=kernels, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
