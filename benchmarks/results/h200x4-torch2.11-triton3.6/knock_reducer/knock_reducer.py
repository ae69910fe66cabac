"""One-off: what the norm-grad reducer costs in sp_step's block stack. Variants: torch, shardnorm (the README
recipe, `attach_reducer` and `accumulate`) and shardnorm_noreducer (the same plan without a reducer: the norm grads
stay `Partial` and DTensor reduces them per parameter in the optimizer step, as torch's are).

Timing: rounds of rotated order, per round the median of STEPS steps, then the ratios' median and range over the
rounds (`knock_reducer_{eager,compiled}_tp4.json`). `--profile`: torch.profiler op tables of rank 0 over 2 compiled
steps of shardnorm and shardnorm_noreducer after 4 warm-up steps, the host time until a step's work was queued
(median of 6 unprofiled steps) on their first line (`ops_compiled_tp4_*.txt`).

    COMPILE=1 OUT=DIR torchrun --nproc-per-node 4 knock_reducer.py    # ROUNDS=7 STEPS=5 by default
    OUT=DIR torchrun --nproc-per-node 4 knock_reducer.py              # eager
    COMPILE=1 OUT=DIR torchrun --nproc-per-node 4 knock_reducer.py --profile
Run from the repository root with PYTHONPATH=src:. (it imports benchmarks.sp_step)."""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from benchmarks import common, sp_step


def step_plain(model, batches, opt):
    for x in batches:
        y = model(x)
        (y.to_local() if hasattr(y, "to_local") else y).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def stepper(variant, args, mesh, xs):
    if variant == "shardnorm_noreducer":
        real, sp_step.attach_reducer = sp_step.attach_reducer, lambda m: None
        model = sp_step.build("shardnorm", args, mesh, 1)
        sp_step.attach_reducer = real
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        return lambda: step_plain(model, xs, opt)
    model = sp_step.build(variant, args, mesh, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    return lambda: sp_step.step(model, variant, xs, opt)


def main():
    profiling = "--profile" in sys.argv
    compile_ = os.environ.get("COMPILE") == "1"
    rounds, steps = int(os.environ.get("ROUNDS", 7)), int(os.environ.get("STEPS", 5))
    out = os.environ.get("OUT", "/tmp/knock")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(dev, (world,))
    small = not cuda
    args = argparse.Namespace(dim=128 if small else 4096, ffn=256 if small else 11008, seq=64 if small else 4096,
                              layers=4, compile=compile_, device=dev, dtype=torch.bfloat16, inductor={})
    g = torch.Generator().manual_seed(0)
    local = args.seq // world
    xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank * local:(rank + 1) * local].contiguous()
          .to(dev).bfloat16() for _ in range(2)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    os.makedirs(out, exist_ok=True)
    variants = ("shardnorm", "shardnorm_noreducer") if profiling else ("torch", "shardnorm", "shardnorm_noreducer")
    steppers = {}
    for v in variants:
        steppers[v] = stepper(v, args, mesh, xs)
        for _ in range(4 if profiling else 3):
            steppers[v]()
        sync()
        if profiling:
            queued = []
            for _ in range(6):
                dist.barrier()
                sync()
                t = time.perf_counter()
                steppers[v]()
                queued.append((time.perf_counter() - t) * 1e3)
                sync()
            dist.barrier()
            sync()
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                for _ in range(2):
                    steppers[v]()
                sync()
            if rank == 0:
                ka = prof.key_averages()
                with open(f"{out}/ops_compiled_tp{world}_{v}.txt", "w") as f:
                    f.write(f"host queued ms per step (6 steps, median): {statistics.median(queued):.2f}\n")
                    f.write(ka.table(sort_by="self_cpu_time_total", row_limit=70, max_name_column_width=80))
                    f.write(ka.table(sort_by="count", row_limit=70, max_name_column_width=80))
            del steppers[v]
    if profiling:
        dist.destroy_process_group()
        return
    times, host = {v: [] for v in steppers}, {v: [] for v in steppers}
    for r in range(rounds):
        for v in common.turns(list(steppers), r):
            s, q = [], []
            for _ in range(steps):
                dist.barrier()
                sync()
                t = time.perf_counter()
                steppers[v]()
                q.append((time.perf_counter() - t) * 1e3)
                sync()
                s.append((time.perf_counter() - t) * 1e3)
            times[v].append(statistics.median(s))
            host[v].append(statistics.median(q))
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{v} {times[v][-1]:.1f}/{host[v][-1]:.1f}" for v in times), flush=True)
    if rank == 0:
        res = {"mode": "compiled" if compile_ else "eager", "tp": world, "step_ms": times, "host_ms": host,
               "ratios": {f"{b} / {a}": common.median_range([x / y for x, y in zip(times[b], times[a])])
                          for b, a in (("shardnorm", "torch"), ("shardnorm_noreducer", "torch"),
                                       ("shardnorm", "shardnorm_noreducer"))}}
        with open(f"{out}/knock_reducer_{res['mode']}_tp{world}.json", "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res["ratios"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
