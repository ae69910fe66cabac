"""Tile sweep on one GPU: time shardnorm's forward and backward under alternative TileConfigs.

Replaces `shardnorm.kernels.config.fwd_config` / `bwd_config` with each candidate in turn, so the
numbers say which values `config.py` should hold. bf16 x, M = 32768 (16384 above N = 32768).

    python benchmarks/sweep_tiles.py --out sweep.json
"""

import argparse
import itertools
import json
import time

import torch
from triton.testing import do_bench

import shardnorm
from shardnorm.kernels import config
from shardnorm.kernels.config import TileConfig

SHAPES = [1024, 2048, 4096, 16384, 32768, 65536]  # 16384: LayerNorm's chunked backward


def candidates(n: int, backward: bool):
    one_pass = n <= (config.MAX_FUSED_N_BWD[2] if backward else config.MAX_FUSED_N_FWD)
    if one_pass and n <= 4096:
        rows = (1, 2, 4) if backward else (1, 2, 4, 8)
        stages, per_sm = ((1, 2), (4, 8, 16)) if backward else ((1,), (1,))
        for bm, warps, st, ps in itertools.product(rows, (4, 8), stages, per_sm):
            if bm * n <= 8192:
                yield TileConfig(bm, n, warps, True, programs_per_sm=ps, num_stages=st)
        return
    if one_pass:
        yield TileConfig(1, n, 16, True)
    tiles = ((2048, 4), (1024, 8), (2048, 2)) if backward else ((2048, 1), (4096, 1), (2048, 2), (4096, 2))
    for (chunk, bm), warps, ps, st in itertools.product(tiles, (4, 8), (1, 2) if backward else (1,), (1, 2)):
        yield TileConfig(bm, chunk, warps, False, programs_per_sm=ps, num_stages=st)


def cpu_overhead_us() -> float:
    """Host time of one tiny forward+backward through shardnorm: the floor of any eager timing."""
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    for _ in range(50):
        shardnorm.rms_norm(x, 64, w).sum()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        shardnorm.rms_norm(x, 64, w)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(f"host time of one eager forward call: {cpu_overhead_us():.1f} us", flush=True)
    original = (config.fwd_config, config.bwd_config)
    results = []
    for n, rms in itertools.product(SHAPES, (True, False)):
        if n in (4096, 16384) and rms:  # one-pass RMS backward there is already near copy speed
            continue
        m = 32768 if n <= 32768 else 16384
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fn = (lambda: shardnorm.rms_norm(x, n, w, 1e-6)) if rms else (lambda: shardnorm.layer_norm(x, n, w, b))
        nbytes = m * n * 2
        for backward in ((True,) if n in (4096, 16384, 32768) else (False, True)):
            best = None
            for cfg in candidates(n, backward):
                if backward:
                    config.bwd_config = lambda n_, g, cfg=cfg: cfg
                else:
                    config.fwd_config = lambda n_, cfg=cfg: cfg
                try:
                    if backward:
                        y = fn()
                        ms = do_bench(lambda: y.backward(dy, retain_graph=True),
                                      grad_to_none=[x, w, b] if b is not None else [x, w], return_mode="median")
                        gbs = 3 * nbytes / ms / 1e6
                    else:
                        ms = do_bench(fn, return_mode="median")
                        gbs = 2 * nbytes / ms / 1e6
                except Exception as e:
                    print(f"{n} rms={rms} bwd={backward} {cfg} failed: {e}", flush=True)
                    continue
                finally:
                    config.fwd_config, config.bwd_config = original
                results.append(dict(N=n, M=m, rms=rms, backward=backward, cfg=cfg.__dict__, gbs=gbs))
                if best is None or gbs > best[0]:
                    best = (gbs, cfg)
            print(f"N={n} rms={rms} {'bwd' if backward else 'fwd'} best {best[0]:.0f} GB/s {best[1]}", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
