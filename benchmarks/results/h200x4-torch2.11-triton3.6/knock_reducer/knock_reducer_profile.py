"""One-off: torch.profiler op tables (rank 0, CPU and CUDA) of 2 compiled steps of sp_step's block stack, shardnorm
with and without the norm-grad reducer (as in knock_reducer.py), after 4 warm-up steps; each table's first line is the
host time until a step's work was queued (median of 6 unprofiled steps).

    OUT=DIR torchrun --nproc-per-node 4 knock_reducer_profile.py
Run from the repository root with PYTHONPATH=src:. (it imports benchmarks.sp_step)."""
import argparse, os, statistics, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import profile, ProfilerActivity
from benchmarks import sp_step

def step_plain(m, xs, o):
    for x in xs:
        y = m(x); y = y.to_local() if hasattr(y, "to_local") else y
        y.float().square().mean().backward()
    o.step(); o.zero_grad(set_to_none=True)

def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = "cuda" if cuda else "cpu"
    if cuda: torch.cuda.set_device(rank)
    mesh = init_device_mesh(dev, (world,))
    small = not cuda
    args = argparse.Namespace(dim=128 if small else 4096, ffn=256 if small else 11008, seq=64 if small else 4096,
                              layers=4, compile=True, device=dev, dtype=torch.bfloat16, inductor={})
    g = torch.Generator().manual_seed(0)
    ls = args.seq // world
    xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank*ls:(rank+1)*ls].contiguous().to(dev).bfloat16() for _ in range(2)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = os.environ.get("OUT", "/tmp/profk"); os.makedirs(out, exist_ok=True)
    for v in ("shardnorm", "shardnorm_noreducer"):
        if v == "shardnorm_noreducer":
            real = sp_step.attach_reducer; sp_step.attach_reducer = lambda m: None
            m = sp_step.build("shardnorm", args, mesh, 1); sp_step.attach_reducer = real
            o = torch.optim.SGD(m.parameters(), lr=1e-6); run = lambda: step_plain(m, xs, o)
        else:
            m = sp_step.build(v, args, mesh, 1)
            o = torch.optim.SGD(m.parameters(), lr=1e-6); run = lambda: sp_step.step(m, v, xs, o)
        for _ in range(4): run()
        sync()
        q = []
        for _ in range(6):
            dist.barrier(); sync(); t = time.perf_counter(); run(); q.append((time.perf_counter() - t) * 1e3); sync()
        dist.barrier(); sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(2): run()
            sync()
        if rank == 0:
            ka = prof.key_averages()
            with open(f"{out}/ops_{v}.txt", "w") as f:
                f.write(f"host queued ms per step (6 steps, median): {statistics.median(q):.2f}\n")
                f.write(ka.table(sort_by="self_cpu_time_total", row_limit=70, max_name_column_width=80))
                f.write(ka.table(sort_by="count", row_limit=70, max_name_column_width=80))
        del m, o
    dist.destroy_process_group()
main()
