"""Tile sweep on one GPU: time shardnorm's forward and backward under alternative TileConfigs.

Replaces `shardnorm.kernels.config.fwd_config` / `bwd_config` with each candidate in turn, so the
numbers say which values `config.py` should hold. bf16 x, M = 32768 (16384 above N = 32768).

    python benchmarks/sweep_tiles.py --out sweep.json
"""

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

import shardnorm
from shardnorm.kernels import config
from shardnorm.kernels.config import TileConfig

SHAPES = [1024, 2048, 16384, 32768, 65536]  # 16384: LayerNorm's chunked backward


def candidates(n: int, backward: bool):
    if n <= 2048:
        for bm, warps in itertools.product((1, 2, 4, 8, 16), (2, 4, 8)):
            yield TileConfig(bm, n, warps, True, programs_per_sm=4 if backward else 2)
        return
    if n <= (config.MAX_FUSED_N_BWD[2] if backward else config.MAX_FUSED_N_FWD):
        yield TileConfig(1, n, 16, True)
    for chunk, bm, warps, per_sm in itertools.product((1024, 2048, 4096), (1, 2, 4), (4, 8), (1, 2)):
        if bm * chunk <= 8192 and (backward or per_sm == 1):
            yield TileConfig(bm, chunk, warps, False, programs_per_sm=per_sm)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    original = (config.fwd_config, config.bwd_config)
    results = []
    for n, rms in itertools.product(SHAPES, (True, False)):
        if n == 16384 and rms:
            continue
        m = 32768 if n <= 32768 else 16384
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        fn = (lambda: shardnorm.rms_norm(x, n, w, 1e-6)) if rms else (lambda: shardnorm.layer_norm(x, n, w, b))
        nbytes = m * n * 2
        for backward in ((True,) if n == 16384 else (False, True)):
            best = None
            for cfg in candidates(n, backward):
                if backward:
                    config.bwd_config = lambda n_, g, cfg=cfg: cfg
                else:
                    config.fwd_config = lambda n_, cfg=cfg: cfg
                try:
                    if backward:
                        y = fn()
                        ms = do_bench(lambda: y.backward(dy, retain_graph=True), grad_to_none=[x, w, b] if b is not None else [x, w], return_mode="median")
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
