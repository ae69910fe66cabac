"""Eager SP step, option off and on: with parts of the option's bookkeeping knocked out (default), or `--profile`:
torch.profiler op tables of 3 steps each way (every host thread, the autograd engine's included)."""
import argparse, contextlib, os, statistics, sys, time, json
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from benchmarks import sp_step
import shardnorm
from shardnorm import output_recompute
from shardnorm.distributed import regather

ZERO = {}
def zero_fp(t):
    z = ZERO.get(t.device)
    if z is None: z = ZERO[t.device] = torch.zeros((), device=t.device)
    return z

orig = dict(rfp=regather._fingerprint, ofp=output_recompute._fingerprint, stats=output_recompute._check_statistics,
            ceq=output_recompute.check_equal)
PATCHES = {
    "off": {}, "on": {},
    "on_nofp": {"rfp": zero_fp, "ofp": zero_fp},
    "on_nofp_nostats": {"rfp": zero_fp, "ofp": zero_fp, "stats": lambda *a: None},
    "on_nochecks": {"rfp": zero_fp, "ofp": zero_fp, "stats": lambda *a: None, "ceq": lambda *a: None},
}
def apply(name):
    p = PATCHES[name]
    regather._fingerprint = p.get("rfp", orig["rfp"]); output_recompute._fingerprint = p.get("ofp", orig["ofp"])
    output_recompute._check_statistics = p.get("stats", orig["stats"]); output_recompute.check_equal = p.get("ceq", orig["ceq"])
    regather.output_recompute = output_recompute

def step(model, variant, batches, opt, phases):
    losses = []
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        ctx = shardnorm.accumulate(model) if not last else contextlib.nullcontext()
        with ctx:
            t0 = time.perf_counter()
            y = model(x)
            y = y.to_local() if hasattr(y, "to_local") else y
            loss = y.float().square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        phases[0] += t1 - t0; phases[1] += t2 - t1
    opt.step(); opt.zero_grad(set_to_none=True)


def profile_steps(mesh, args, xs, out, rank):
    from torch.profiler import profile, ProfilerActivity
    for variant in ("shardnorm", "shardnorm_discard"):
        model = sp_step.build(variant, args, mesh, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        for _ in range(3): sp_step.step(model, variant, xs, opt)
        torch.cuda.synchronize(); dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3): sp_step.step(model, variant, xs, opt)
            torch.cuda.synchronize()
        if rank == 0:
            ka = prof.key_averages()
            open(f"{out}/ops_{variant}.txt", "w").write(ka.table(sort_by="self_cpu_time_total", row_limit=70, max_name_column_width=70))
            prof.export_chrome_trace(f"{out}/trace_{variant}.json")
        del model, opt; torch.cuda.empty_cache()


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    args = argparse.Namespace(dim=4096, ffn=11008, seq=4096, layers=4, compile=False, device="cuda",
                              dtype=torch.bfloat16, inductor={})
    g = torch.Generator().manual_seed(0)
    ls = args.seq // world
    xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank*ls:(rank+1)*ls].contiguous().cuda().bfloat16() for _ in range(2)]
    if "--profile" in sys.argv:
        profile_steps(mesh, args, xs, os.environ["OUT"], rank)
        dist.destroy_process_group()
        return
    models = {"shardnorm": sp_step.build("shardnorm", args, mesh, 1), "shardnorm_discard": sp_step.build("shardnorm_discard", args, mesh, 1)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-6) for k, m in models.items()}
    res = {n: {"step": [], "host": [], "fwd": [], "bwd": []} for n in PATCHES}
    for n in PATCHES:
        apply(n); v = "shardnorm" if n == "off" else "shardnorm_discard"
        for _ in range(3): step(models[v], v, xs, opts[v], [0, 0])
    torch.cuda.synchronize()
    names = list(PATCHES)
    for r in range(int(os.environ.get("ROUNDS", 5))):
        for n in names[r % len(names):] + names[:r % len(names)]:
            apply(n); v = "shardnorm" if n == "off" else "shardnorm_discard"
            st, ho, fw, bw = [], [], [], []
            for _ in range(5):
                dist.barrier(); torch.cuda.synchronize()
                ph = [0.0, 0.0]; t = time.perf_counter()
                step(models[v], v, xs, opts[v], ph); ho.append(time.perf_counter() - t)
                torch.cuda.synchronize(); st.append(time.perf_counter() - t); fw.append(ph[0]); bw.append(ph[1])
            for key, vals in (("step", st), ("host", ho), ("fwd", fw), ("bwd", bw)):
                res[n][key].append(statistics.median(vals) * 1e3)
    if rank == 0:
        out = {n: {k: round(statistics.median(v), 2) for k, v in d.items()} for n, d in res.items()}
        for n, d in out.items(): print(n, d)
        json.dump({"medians": out, "rounds": res}, open(os.environ["OUT"] + "/knock_sp.json", "w"), indent=1)
    dist.destroy_process_group()
main()
