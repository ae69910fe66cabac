"""Tile sweep on one GPU: GPU time of shardnorm's kernels under alternative launch configs.

Each candidate replaces `config.fwd_config` / `config.bwd_config` in turn; the bare launchers
(`kernels.norm_fwd` / `norm_bwd`) are timed replayed from a CUDA graph (`do_bench_cudagraph`), so host
time is out of these numbers: they rank kernel configs, the kernel benchmark reports what a user
sees. Every candidate's outputs are checked against the default config's first, so a tile bug cannot
win. Candidates compile in parallel worker processes first (Triton's disk cache is shared).

    python benchmarks/sweep_tiles.py --out sweep.json [--cases fwd-65536,bwd-1024,...] [--norms rms] [--jobs 12]

These are the portable kernels' tiles: the sweep runs with SHARDNORM_PORTABLE_KERNELS=1, so long rows on
Hopper do not take the staged kernels (`gpu_longrow.py` and `longrow_fwd_variants.py` time those).
"""

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time

os.environ["SHARDNORM_PORTABLE_KERNELS"] = "1"  # before shardnorm reads its settings; spawned workers inherit it

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from bench_kernels import copy_bandwidth  # noqa: E402
from kernel_gpu_time import call, inputs  # noqa: E402
from shardnorm.kernels import config  # noqa: E402
from shardnorm.kernels.config import SplitBwdConfig, TileConfig  # noqa: E402

T = TileConfig


def rows_for(n: int) -> int:
    return 262144 if n <= 256 else 32768



def fwd_candidates(n: int, rms: bool):
    """One-pass tiles, each with one program per row block (0) and with 2-8 persistent programs per
    SM holding the parameters in registers; above the one-pass limit, chunked tiles."""
    yield config.fwd_config(n, WEIGHT_DTYPE.itemsize, not rms)
    if n > config.MAX_FUSED_N_FWD or (n > 16384 and WEIGHT_DTYPE.itemsize >= 4 and not rms):
        for bm, bn, warps, stages in itertools.product((1, 2), (2048, 4096, 8192, 16384), (8, 16, 32), (1, 2)):
            if 4 <= bm * bn // (32 * warps) <= 32:
                yield T(bm, bn, warps, single_pass=False, num_stages=stages)
        return
    if n >= 16384 or (n > 4096 and WEIGHT_DTYPE.itemsize >= 4):  # the chunked path as an alternative
        for bm, bn, warps in ((1, 4096, 16), (1, 16384, 32), (2, 8192, 16)):
            yield T(bm, bn, warps, single_pass=False, num_stages=2 if bm == 2 else 1)
    for bn, tail in dict.fromkeys([(config.next_pow2(n), 0), config.row_tiles(n)]):
        for elems, warps, per_sm in itertools.product((1024, 2048, 4096, 8192, 16384, 32768), (4, 8, 16, 32), (0, 2, 4, 8)):
            if elems >= bn and 8 <= elems // (32 * warps) <= 32 and (elems == bn or elems <= 16384):
                yield T(elems // bn, bn, warps, programs_per_sm=per_sm, tail_n=tail)


# (rows, columns, warps) of a tile: 8-32 elements per thread.
SPLIT_TILES = ((1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (1, 4096, 16), (2, 2048, 8), (2, 4096, 16), (1, 8192, 16))
DX_TILES = SPLIT_TILES + ((4, 1024, 8), (2, 4096, 8))


def split_candidates(n: int):
    """Row-sums pass varied with the default dx pass, then the dx pass with the default row sums
    (below N = 16384 only the default, to compare with the fused kernel)."""
    base = config.BWD_SPLIT
    if n < 16384:
        yield base
        return
    for (bm, bn, warps), per_sm, stages in itertools.product(SPLIT_TILES, (2, 4), (1, 2, 3)):
        if bn <= n:
            yield SplitBwdConfig(T(bm, bn, warps, programs_per_sm=per_sm, num_stages=stages), base.dx)
    for bm, bn, warps in DX_TILES:
        if bn <= n:
            yield SplitBwdConfig(base.row_sums, T(bm, bn, warps))


def bwd_candidates(n: int, rms: bool):
    if n >= 8192:
        yield from split_candidates(n)
    if n > 16384:
        return
    for bn, tail in dict.fromkeys([(config.next_pow2(n), 0), config.row_tiles(n)]):  # with a tail tile too
        small = bn <= 2048
        for elems, warps, per_sm, stages in itertools.product(
                (bn, 2048, 4096) if small else (bn,), (4, 8) if small else (8, 16, 32) if bn < 16384 else (16, 32),
                (2, 4, 8) if small else (1, 2, 3), (1, 2) if small else (1, 2)):
            if elems >= bn and 4 <= elems // (32 * warps) <= 32:
                yield T(elems // bn, bn, warps, programs_per_sm=per_sm, num_stages=stages,
                        hoist_params=bn <= config.HOIST_PARAMS_MAX_N_BWD, tail_n=tail)


CASES = {f"{d}-{n}": (d, n) for d in ("fwd", "bwd")
         for n in (64, 128, 256, 1024, 2048, 4096, 4608, 5120, 8192, 9216, 12288, 14336, 16384, 32768, 65536)}


WEIGHT_DTYPE = torch.bfloat16  # --weights


def using(direction, cfg):
    """Point the launchers at cfg; returns the undo. The launchers keep the plan (config and
    compiled launches) they chose per shape, so both changes forget those."""
    name = "fwd_config" if direction == "fwd" else "bwd_config"
    original = getattr(config, name)
    setattr(config, name, lambda *_: cfg)
    forget_plans()

    def undo():
        setattr(config, name, original)
        forget_plans()

    return undo


def forget_plans():
    for module in ("norm_fwd", "norm_bwd"):
        sys.modules[f"shardnorm.kernels.{module}"]._plan.cache_clear()


def jobs(cases, norms=("rms", "layer")):
    for name in cases:
        direction, n = CASES[name]
        for rms in [norm == "rms" for norm in norms]:
            gen = fwd_candidates(n, rms) if direction == "fwd" else bwd_candidates(n, rms)
            for cfg in dict.fromkeys(gen):
                yield direction, n, rms, cfg


def compile_one(job):
    """Worker: run the candidate once on a few rows, which compiles it into the shared disk cache."""
    global WEIGHT_DTYPE
    direction, n, rms, cfg, WEIGHT_DTYPE = job
    undo = using(direction, cfg)
    try:
        call(direction, rms, inputs(n, rms, 64, WEIGHT_DTYPE))()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again, with the shape, when the parent runs it
        return f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        undo()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--norms", default="rms,layer")
    parser.add_argument("--weights", default="bfloat16", help="weight/bias dtype")
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args()
    global WEIGHT_DTYPE
    WEIGHT_DTYPE = getattr(torch, args.weights)
    all_jobs = list(jobs(args.cases.split(","), args.norms.split(",")))
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        pool.map(compile_one, [job + (WEIGHT_DTYPE,) for job in all_jobs], chunksize=1)
    print(f"compiled {len(all_jobs)} candidates in {time.time() - start:.0f} s", flush=True)
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy {copy_gbs:.0f} GB/s", flush=True)
    results = []
    for (direction, n, rms), group in itertools.groupby(all_jobs, key=lambda j: j[:3]):
        m = rows_for(n)
        t = inputs(n, rms, m, WEIGHT_DTYPE)
        expected = call(direction, rms, t)()
        nbytes = (2 if direction == "fwd" else 3) * m * n * 2
        params = 1 if rms else 2
        if direction == "fwd":
            default = config.fwd_config(n, WEIGHT_DTYPE.itemsize, not rms)
        else:
            default = config.bwd_config(n, params, WEIGHT_DTYPE.itemsize, rms)
        rows = []
        for _, _, _, cfg in group:
            undo = using(direction, cfg)
            try:
                got = call(direction, rms, t)()
                err = max(rel(a, e) for a, e in zip(got, expected) if e is not None and e.numel())
                if not err < 2e-3:  # bf16 outputs: summation order moves some roundings
                    raise AssertionError(f"outputs differ from the default config's by {err:.2e}")
                ms = do_bench_cudagraph(call(direction, rms, t), return_mode="median")
            except Exception as e:
                print(f"  {direction} N={n} rms={rms} {cfg} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            finally:
                undo()
            gbs = nbytes / ms / 1e6
            rows.append(dict(direction=direction, N=n, M=m, rms=rms, cfg=repr(cfg), default=cfg == default,
                             us=ms * 1e3, gbs=gbs, of_copy=gbs / copy_gbs))
        rows.sort(key=lambda r: -r["gbs"])
        results += rows
        dflt = next((r for r in rows if r["default"]), None)
        print(f"{direction} N={n} {'rms' if rms else 'layer'}: default "
              f"{dflt['of_copy'] if dflt else float('nan'):.0%}; best of {len(rows)}:", flush=True)
        for r in rows[:3]:
            print(f"    {r['of_copy']:5.0%} {r['us']:7.1f} us  {r['cfg']}", flush=True)
        del t, expected
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
