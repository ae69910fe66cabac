"""One-off: what the norm-grad reducer costs in sp_step's block stack. Variants torch, shardnorm (the README recipe,
`attach_reducer` and `accumulate`) and shardnorm_noreducer (the same plan without a reducer: the norm grads stay
`Partial` and DTensor reduces them per parameter in the optimizer step, as torch's are), in rounds of rotated order;
per round the median of STEPS steps, then the ratios' median and range over the rounds.

    COMPILE=1 OUT=DIR torchrun --nproc-per-node 4 knock_reducer.py   # ROUNDS=7 STEPS=5 by default
    OUT=DIR torchrun --nproc-per-node 4 knock_reducer.py             # eager
Run from the repository root with PYTHONPATH=src:. (it imports benchmarks.sp_step)."""
import argparse, contextlib, json, os, statistics, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from benchmarks import sp_step, common

def step_plain(model, batches, opt):
    for x in batches:
        y = model(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        y.float().square().mean().backward()
    opt.step(); opt.zero_grad(set_to_none=True)

def main():
    compile_ = os.environ.get("COMPILE") == "1"
    rounds, steps = int(os.environ.get("ROUNDS", 7)), int(os.environ.get("STEPS", 5))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if cuda else "cpu"
    if cuda: torch.cuda.set_device(rank)
    mesh = init_device_mesh(dev, (world,))
    small = not cuda
    args = argparse.Namespace(dim=128 if small else 4096, ffn=256 if small else 11008, seq=64 if small else 4096,
                              layers=4, compile=compile_, device=dev, dtype=torch.bfloat16, inductor={})
    g = torch.Generator().manual_seed(0)
    ls = args.seq // world
    xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank*ls:(rank+1)*ls].contiguous().to(dev).bfloat16() for _ in range(2)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    models, steppers = {}, {}
    for v in ("torch", "shardnorm", "shardnorm_noreducer"):
        if v == "shardnorm_noreducer":
            real = sp_step.attach_reducer
            sp_step.attach_reducer = lambda m: None
            m = sp_step.build("shardnorm", args, mesh, 1)
            sp_step.attach_reducer = real
            o = torch.optim.SGD(m.parameters(), lr=1e-6)
            steppers[v] = (lambda m=m, o=o: step_plain(m, xs, o))
        else:
            m = sp_step.build(v, args, mesh, 1)
            o = torch.optim.SGD(m.parameters(), lr=1e-6)
            steppers[v] = (lambda m=m, o=o, v=v: sp_step.step(m, v, xs, o))
        models[v] = m
        for _ in range(3): steppers[v]()
        sync()
    times = {v: [] for v in steppers}; host = {v: [] for v in steppers}
    for r in range(rounds):
        for v in common.turns(list(steppers), r):
            s, q = [], []
            for _ in range(steps):
                dist.barrier(); sync(); t = time.perf_counter()
                steppers[v](); q.append((time.perf_counter() - t) * 1e3)
                sync(); s.append((time.perf_counter() - t) * 1e3)
            times[v].append(statistics.median(s)); host[v].append(statistics.median(q))
        if rank == 0: print(f"round {r}: " + ", ".join(f"{v} {times[v][-1]:.1f}/{host[v][-1]:.1f}" for v in times), flush=True)
    if rank == 0:
        res = {"mode": "compiled" if compile_ else "eager", "tp": world, "step_ms": times, "host_ms": host,
               "ratios": {f"{b} / {a}": common.median_range([x / y for x, y in zip(times[b], times[a])])
                          for b, a in (("shardnorm", "torch"), ("shardnorm_noreducer", "torch"),
                                       ("shardnorm", "shardnorm_noreducer"))}}
        out = os.environ.get("OUT", "/tmp/knock")
        os.makedirs(out, exist_ok=True)
        with open(f"{out}/knock_reducer_{res['mode']}_tp{world}.json", "w") as f: json.dump(res, f, indent=1)
        print(json.dumps(res["ratios"]), {v: statistics.median(h) for v, h in host.items()})
    dist.destroy_process_group()
main()
