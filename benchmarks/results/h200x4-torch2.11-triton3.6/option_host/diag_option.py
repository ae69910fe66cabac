"""One-off: where the eager keep_output=False option's host time goes in sp_step's block stack (tp = world size).

Wraps the option's steps in timers (the norm's `track` and `attach` in forward; the consumers' `_RegatherLinear`
forward and backward, the re-gather's `start` and `take`, the end-of-backward checks), runs shardnorm's README recipe
with and without the option for 6 alternating rounds of 5 steps, and writes rank 0's median step, host time queued
and per-step milliseconds in each wrapped part (`diag_rank0.txt`); then a cProfile of 3 steps (main thread only: the
backward runs on autograd's device thread) and torch.profiler op tables and traces of 2 steps per variant.

    OUT=DIR torchrun --nproc-per-node 4 diag_option.py      # from the repository root, PYTHONPATH=src:.
"""
import argparse, collections, cProfile, functools, gzip, io, json, os, pstats, statistics, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile
from shardnorm import output_recompute as orc
from shardnorm.distributed import regather
from benchmarks import sp_step
acc = collections.Counter()
def sync():
    if torch.cuda.is_available(): torch.cuda.synchronize()
def timed(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(obj, name, w)
timed(regather.GatheredOutput, "start", "start"); timed(regather.GatheredOutput, "take", "take")
timed(orc, "track", "track"); timed(regather, "attach", "attach"); timed(orc, "_check_pending", "check_pending")
timed(orc, "check_arrived", "check_arrived")
timed(regather._RegatherLinear, "backward", "RL.backward"); timed(regather._RegatherLinear, "forward", "RL.forward")
out = os.environ["OUT"]
cuda = torch.cuda.is_available(); dev = "cuda" if cuda else "cpu"
dist.init_process_group("nccl" if cuda else "gloo"); rank, world = dist.get_rank(), dist.get_world_size()
if cuda: torch.cuda.set_device(rank)
mesh = init_device_mesh(dev, (world,))
args = argparse.Namespace(dim=4096 if cuda else 64, ffn=11008 if cuda else 128, seq=4096 if cuda else 64, layers=4, compile=False, device=dev, dtype=torch.bfloat16, inductor={})
g = torch.Generator().manual_seed(0); local = args.seq // world
xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank*local:(rank+1)*local].contiguous().to(dev).bfloat16() for _ in range(2)]
log = open(f"{out}/diag_rank{rank}.txt", "w") if rank == 0 else None
def p(*a):
    if log: print(*a, file=log, flush=True)
variants = ("shardnorm", "shardnorm_discard")
models = {v: sp_step.build(v, args, mesh, 1) for v in variants}
opts = {v: torch.optim.SGD(models[v].parameters(), lr=1e-6) for v in variants}
for v in variants:
    for _ in range(3): sp_step.step(models[v], v, xs, opts[v])
sync()
res = {v: ([], []) for v in variants}; comp = {v: collections.Counter() for v in variants}
for r in range(6):
    for v in (variants if r % 2 == 0 else variants[::-1]):
        acc.clear()
        for _ in range(5):
            dist.barrier(); sync(); t = time.perf_counter()
            sp_step.step(models[v], v, xs, opts[v]); q = time.perf_counter() - t
            sync(); res[v][0].append((time.perf_counter() - t) * 1e3); res[v][1].append(q * 1e3)
        comp[v].update({k: x / 5 * 1e3 for k, x in acc.items()})
for v in variants:
    p(v, "step", round(statistics.median(res[v][0]), 1), "queued", round(statistics.median(res[v][1]), 1),
      {k: round(x / 6, 2) for k, x in comp[v].items()})
for v in variants:
    pr = cProfile.Profile(); sync(); pr.enable()
    for _ in range(3): sp_step.step(models[v], v, xs, opts[v])
    sync(); pr.disable()
    if rank == 0:
        s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats(120)
        st.sort_stats("tottime").print_stats(60); open(f"{out}/cprofile_{v}.txt", "w").write(s.getvalue())
    dist.barrier()
for v in variants:
    sync(); dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(2): sp_step.step(models[v], v, xs, opts[v])
        sync()
    if rank == 0:
        ka = prof.key_averages()
        open(f"{out}/ops_{v}.txt", "w").write(ka.table(sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=70))
        prof.export_chrome_trace(f"{out}/trace_{v}.json")
        with open(f"{out}/trace_{v}.json") as f, gzip.open(f"{out}/trace_{v}.json.gz", "wt") as g2: g2.write(f.read())
        os.remove(f"{out}/trace_{v}.json")
    dist.barrier()
dist.destroy_process_group()
