"""Where keep_output=False's step time goes on one GPU: option off, on, and on with its `.data`-write checks knocked
out (fingerprints, then every comparison), alternating rounds; a cProfile and a kernel tally of a few steps each.

    torchrun --nproc-per-node 1 keep_output_cost.py OUT      # PYTHONPATH=src:. from the checkout

Part `sp`: `benchmarks.sp_step`'s block stack on a one-rank mesh (the README recipe, the consumers' re-gather a
one-rank all-gather): the option's own host and GPU work without a peer to wait for. Part `hf`: HF Llama, 4 layers
of 4096, 2 x 4096 tokens, `convert(keep_output=...)`."""
import argparse, cProfile, io, json, pstats, statistics, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import hf_variants, sp_step
import shardnorm
from shardnorm import output_checks, output_recompute

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
ORIG = dict(fp=output_checks.fingerprint, eq=output_checks.check_equal,
            stats=getattr(output_recompute, "_check_statistics", None))  # None: the tree measured has no statistics check
_zero = {}


def _zero_fp(t):
    z = _zero.get(t.device)
    if z is None:
        z = _zero[t.device] = torch.zeros(1, device=t.device, dtype=torch.int32)
    return z


KNOCK = {"off": {}, "on": {}, "on_nofp": {"fp": _zero_fp},
         "on_nochecks": {"fp": _zero_fp, "eq": lambda *a: None, "stats": lambda *a: None}}


def knock(name):
    k = KNOCK[name]
    output_checks.fingerprint = k.get("fp", ORIG["fp"])
    output_checks.check_equal = k.get("eq", ORIG["eq"])
    if ORIG["stats"] is not None:
        output_recompute._check_statistics = k.get("stats", ORIG["stats"])


def log(msg):
    print(msg, flush=True)
    with open(OUT / "log.txt", "a") as f:
        f.write(msg + "\n")


def timed(step, n):
    ts, qs = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        qs.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), statistics.median(qs)


def kernels(step, name, part):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    # the kernels' own rows (a launching op's row carries its kernels' time again)
    total = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 1e3 / 3
    (OUT / f"{part}_{name}_ops.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=60,
                                                        max_name_column_width=60))
    return total


def cprofile(step, name, part):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    (OUT / f"{part}_{name}_cprofile.txt").write_text(s.getvalue())


def run_part(part, steps_by_name, rounds, n):
    result = {"step": {k: [] for k in steps_by_name}, "host": {k: [] for k in steps_by_name}}
    names = list(steps_by_name)
    for name in names:  # warm-up
        knock(name)
        for _ in range(3):
            steps_by_name[name]()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            knock(name)
            t, q = timed(steps_by_name[name], n)
            result["step"][name].append(t)
            result["host"][name].append(q)
        log(f"{part} round {r}: " + ", ".join(f"{k} {result['step'][k][-1]:.2f}/{result['host'][k][-1]:.2f}"
                                               for k in names))
    ratios = {}
    for name in names[1:]:
        rs = [a / b for a, b in zip(result["step"][name], result["step"]["off"])]
        ratios[name] = (statistics.median(rs), min(rs), max(rs))
    result["ratios"] = ratios
    result["kernel_ms"] = {}
    for name in names:
        knock(name)
        result["kernel_ms"][name] = kernels(steps_by_name[name], name, part)
        if name in ("off", "on"):
            cprofile(steps_by_name[name], name, part)
    knock("off")
    lines = [f"## {part}", "", "| variant | step ms | host ms | kernel ms (profiled) | step / off (range) |", "|---|---|---|---|---|"]
    for name in names:
        rr = ratios.get(name)
        lines.append(f"| {name} | {statistics.median(result['step'][name]):.2f} | "
                     f"{statistics.median(result['host'][name]):.2f} | {result['kernel_ms'][name]:.2f} | "
                     + (f"{rr[0]:.3f} ({rr[1]:.3f}-{rr[2]:.3f})" if rr else "1") + " |")
    log("\n".join(lines))
    return result


def sp_part():
    mesh = init_device_mesh("cuda", (1,))
    args = argparse.Namespace(dim=4096, ffn=11008, seq=4096, layers=4, device="cuda", dtype=torch.bfloat16,
                              compile=False, inductor=None)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, args.seq, args.dim, generator=g).cuda().bfloat16() for _ in range(sp_step.MICRO_BATCHES)]
    models = {"off": sp_step.build("shardnorm", args, mesh, 1), "on": sp_step.build("shardnorm_discard", args, mesh, 1)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-6) for k, m in models.items()}

    def make(key, variant):
        return lambda: sp_step.step(models[key], variant, xs, opts[key])

    steps = {"off": make("off", "shardnorm"), "on": make("on", "shardnorm_discard"),
             "on_nofp": make("on", "shardnorm_discard"), "on_nochecks": make("on", "shardnorm_discard")}
    return run_part("sp", steps, 7, 5)


def hf_part():
    models, steps = {}, {}
    ids = torch.randint(0, 32000, (2, 4096), generator=torch.Generator().manual_seed(2)).cuda()
    for keep in (True, False):
        model = hf_variants.build("llama", 4, hf_variants.SHAPE, "cuda")
        models[keep] = shardnorm.convert(model, keep_output=keep).model

    def make(keep):
        m = models[keep]

        def step():
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            for p in m.parameters():
                p.grad = None
        return step

    steps = {"off": make(True), "on": make(False), "on_nofp": make(False), "on_nochecks": make(False)}
    return run_part("hf", steps, 7, 8)


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    parts = sys.argv[2:] or ["sp", "hf"]
    for part in parts:
        out[part] = sp_part() if part == "sp" else hf_part()
        (OUT / "keep_output_cost.json").write_text(json.dumps(out, indent=1))
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
