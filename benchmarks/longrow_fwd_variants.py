"""The staged long-row forward's variants on one GPU: warps per program, parameters held on chip.

`staged_fwd_kernel` launched directly (as its plan would, one program per SM) at each num_warps and number of
chunks whose parameters stay in shared memory, LayerNorm with and without its bias (docs/performance.md also records
LayerNorm's statistics in one and two passes and per warp, y as one multiply-add, maskless even rows, the next
row's statistics taken in the y pass, one shared-memory allocation per chunk): y, mean and
rstd checked against float64 on sampled rows, then timed with do_bench_cudagraph (GPU time) and do_bench (best of
3 medians), the device-to-device copy measured in the same run. Bytes: read x, write y (2 x M x N x 2; the
parameters and statistics are not counted, as in bench_kernels.py).

    python benchmarks/longrow_fwd_variants.py --out OUT.json [--n 65536] [--m 32768] [--warps 16,32] [--param-chunks 0,3]
"""

import argparse
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import copy_bandwidth  # noqa: E402
from shardnorm.kernels import config  # noqa: E402
from shardnorm.kernels.norm_fwd_staged import staged_fwd_kernel  # noqa: E402

EPS = 1e-5


def reference(x, w, b, rows, rms):
    x64 = x[rows].double()
    mean = torch.zeros(len(rows), dtype=torch.float64, device=x.device) if rms else x64.mean(1)
    xc = x64 if rms else x64 - mean[:, None]
    rstd = (xc.square().mean(1) + EPS).rsqrt()
    y = xc * rstd[:, None] * w.double()
    return (y if rms else y + b.double()), mean, rstd


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--m", type=int, default=32768)
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--warps", default="16,32")
    parser.add_argument("--param-chunks", default="0,3",
                        help="chunks whose parameters are held in shared memory (0: chunk 0's in registers, LayerNorm)")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n = args.m, args.n
    torch.manual_seed(n)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    x[:, : n // 8] += 40  # chunk 0 far from the row's mean: the worst case of norm_fwd_staged._warp_moments' shifts
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows = sorted({*range(256), *range(m // 2, m // 2 + 256), *range(m - 256, m)})
    nbytes = 2 * m * n * x.element_size()
    results = []
    for norm, warps, held in itertools.product(("layer", "layer_no_bias", "rms"), map(int, args.warps.split(",")),
                                               map(int, args.param_chunks.split(","))):
        rms = norm == "rms"
        bias = norm == "layer"
        chunk = config.StagedConfig(warps).chunk
        y = torch.empty_like(x)
        mean = torch.empty(m, device="cuda", dtype=torch.float32)
        rstd = torch.empty_like(mean)

        def call():
            staged_fwd_kernel[(min(m, sms),)](x, w, b if bias else None, y, None if rms else mean, rstd, x.stride(0),
                                              m, n, EPS, IS_RMS=rms, HAS_WEIGHT=True, HAS_BIAS=bias,
                                              ZERO_CENTERED=False, VEC=8, CHUNKS=config.cdiv(n, chunk),
                                              PARAM_CHUNKS=held, HOLD_CHUNK0=not rms and not held, num_warps=warps)

        row = dict(norm=norm, M=m, N=n, num_warps=warps, param_chunks=held)
        try:
            call()
            torch.cuda.synchronize()
            ref_y, ref_mean, ref_rstd = reference(x, w, b if bias else torch.zeros_like(b), rows, rms)
            row["err"] = dict(y=rel(y[rows], ref_y), rstd=rel(rstd[rows], ref_rstd))
            if not rms:
                row["err"]["mean"] = rel(mean[rows], ref_mean)
            row["correct"] = row["err"]["y"] < 1e-2 and row["err"]["rstd"] < 1e-5
            graph_ms = do_bench_cudagraph(call, return_mode="median")
            rounds = [do_bench(call, return_mode="median") for _ in range(3)]
            row.update(graph_us=graph_ms * 1e3, bench_rounds_us=[r * 1e3 for r in rounds],
                       graph_of_copy=nbytes / graph_ms / 1e6 / copy_gbs,
                       bench_of_copy=nbytes / min(rounds) / 1e6 / copy_gbs)
        except Exception as e:  # recorded; the next variant runs
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), copy_gbs=copy_gbs, torch=torch.__version__,
                command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=results), f, indent=1)
    print(f"copy {copy_gbs:.0f} GB/s")
    for r in results:
        print(f"{r['norm']:5} w{r['num_warps']} held{r['param_chunks']} "
              + (f"graph {100 * r['graph_of_copy']:.0f}% bench {100 * r['bench_of_copy']:.0f}% err {r['err']}"
                 if "failed" not in r else r["failed"]))


if __name__ == "__main__":
    main()
