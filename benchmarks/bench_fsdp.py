"""FSDP2 × TP with shardnorm vs torch's native norms: step time, peak memory, norm-grad all-reduces.

    PYTHONPATH=src:. torchrun --standalone --nproc-per-node 2 benchmarks/bench_fsdp.py configs/llama_small_fsdp_tp.toml \
        --out fsdp_tp.json
    PYTHONPATH=src:. torchrun --standalone --nproc-per-node 2 benchmarks/bench_fsdp.py configs/tiny_cpu.toml \
        train.steps=3 train.timing_skip=1 --out /tmp/fsdp.json                      # CPU smoke run

Per norm (`--norm shardnorm|torch|both`) the main job's model, engine and data (parallel.train's
build_engine: the config's TP plan, `shardnorm.fsdp.shard_model`, the config's dtype as FSDP2 mixed
precision with fp32 reduction) run `train.steps` optimizer steps; the first `train.timing_skip` are
warm-up. Then one more step, without grad clipping, counts all-reduces and their bytes: the model's
linears communicate by all-gather / reduce-scatter, so every all-reduce is a norm-grad reduction
(shardnorm: one fp32 bucket of the dp-sharded grads over tp per step; torch: FSDP2 redistributes each
norm's Partial grad, one all-reduce of the whole param per norm param). JSON on rank 0 to `--out`.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from parallel.collectives import AllReduceCounter
from parallel.config import ConfigError, parse_args
from parallel.data import BatchSampler, load_tokens
from parallel.runtime import init_runtime, shutdown
from parallel.train import build_engine


def run(cfg, runtime, dp: int, tp: int) -> dict:
    engine, dp_rank = build_engine(cfg, runtime, dp, tp)
    tokens = load_tokens(cfg.data.path, cfg.data.corpus_bytes, cfg.train.seed)
    sampler = BatchSampler(tokens, cfg.data.seq_len, cfg.data.batch_size, cfg.train.grad_accum,
                           cfg.train.seed, dp_rank, dp)
    times, losses = [], []
    for step in range(cfg.train.steps):
        micro_batches = sampler.next_step(runtime.device)
        if step == cfg.train.timing_skip:
            runtime.reset_peak_memory()
        start = runtime.now()
        losses.append(engine.step(micro_batches))
        times.append(runtime.now() - start)
    peak = runtime.peak_memory_gib()
    engine.max_grad_norm = 0.0  # clipping all-reduces the grad norm: not a norm-grad reduction
    with AllReduceCounter() as counter:
        engine.step(sampler.next_step(runtime.device))
    timed = times[cfg.train.timing_skip:]
    return {"norm": cfg.train.norm, "step_time_s": statistics.median(timed), "step_times_s": timed,
            "peak_mem_gib": peak, "memory_kind": runtime.memory_kind,
            "norm_grad_all_reduces_per_step": counter.count,
            "norm_grad_all_reduce_bytes_per_step": counter.bytes, "final_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--norm", choices=("shardnorm", "torch", "both"), default="both")
    args, rest = parser.parse_known_args()
    norms = ("shardnorm", "torch") if args.norm == "both" else (args.norm,)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        configs = [parse_args(rest + ["--norm", norm])[0] for norm in norms]
        dp, tp = configs[0].mesh_shape(world_size)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    runtime = init_runtime()
    try:
        results = [run(cfg, runtime, dp, tp) for cfg in configs]
    finally:
        shutdown()
    if runtime.is_main:
        cfg = configs[0]
        report = {"config": cfg.name, "world_size": world_size, "dp": dp, "tp": tp, "dtype": cfg.train.dtype,
                  "device": str(runtime.device), "device_name": torch.cuda.get_device_name(runtime.device)
                  if runtime.device.type == "cuda" else "cpu", "grad_accum": cfg.train.grad_accum,
                  "timed_steps": cfg.train.steps - cfg.train.timing_skip, "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        for r in results:
            print(f"{r['norm']:>9}: step {r['step_time_s'] * 1e3:8.1f} ms  peak {r['peak_mem_gib']:.2f} GiB  "
                  f"norm-grad all-reduces/step {r['norm_grad_all_reduces_per_step']} "
                  f"({r['norm_grad_all_reduce_bytes_per_step']} bytes)")


if __name__ == "__main__":
    main()
