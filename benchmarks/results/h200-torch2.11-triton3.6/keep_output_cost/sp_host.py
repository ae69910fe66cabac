"""The SP memory option's host time on one GPU, piece by piece: `sp_step`'s block stack on a one-rank mesh, option
off and on, alternating rounds (host ms until the step is queued); then the option's functions wrapped with timers
(inclusive host us per step) and a cProfile of each variant.

    torchrun --nproc-per-node 1 sp_host.py OUT [SEQ]      # PYTHONPATH=src:. from the checkout

SEQ (default 4096) sets the tokens per micro-batch: at 1024 the GPU's work is a quarter and the step host-bound, as
tp=2's is at 4096, so the host's times are not stretched by launches waiting for room in a full GPU queue."""
import argparse, cProfile, functools, io, json, pstats, statistics, sys, time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import sp_step
from shardnorm import ops, output_checks, output_recompute
from shardnorm.distributed import regather, sequence_gather

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(msg):
    print(msg, flush=True)
    with open(OUT / "log.txt", "a") as f:
        f.write(msg + "\n")


TIMES = defaultdict(float)
CALLS = defaultdict(int)


def wrap(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label] += time.perf_counter() - t0
            CALLS[label] += 1
    setattr(owner, name, timed)


def main():
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    mesh = init_device_mesh(DEV, (1,))
    small = DEV == "cpu"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    args = argparse.Namespace(dim=64 if small else 4096, ffn=96 if small else 11008, seq=64 if small else seq,
                              layers=4, device=DEV, dtype=torch.bfloat16, compile=False, inductor=None)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, args.seq, args.dim, generator=g).to(DEV, torch.bfloat16) for _ in range(2)]
    variants = {"off": "shardnorm", "on": "shardnorm_discard"}
    models = {k: sp_step.build(v, args, mesh, 1) for k, v in variants.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-6) for k, m in models.items()}
    steps = {k: functools.partial(sp_step.step, models[k], v, xs, opts[k]) for k, v in variants.items()}
    for k in steps:
        for _ in range(3):
            steps[k]()
    host, step = defaultdict(list), defaultdict(list)
    for r in range(15):
        for k in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            qs, ts = [], []
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                steps[k]()
                qs.append((time.perf_counter() - t0) * 1e3)
                sync()
                ts.append((time.perf_counter() - t0) * 1e3)
            host[k].append(statistics.median(qs))
            step[k].append(statistics.median(ts))
    d = [a - b for a, b in zip(host["on"], host["off"])]
    log(f"host ms off {statistics.median(host['off']):.2f}, on {statistics.median(host['on']):.2f}; on - off per "
        f"round: median {statistics.median(d):.2f}, range {min(d):.2f}..{max(d):.2f}")
    log(f"seq {args.seq}; step ms off {statistics.median(step['off']):.2f}, on {statistics.median(step['on']):.2f}")
    for name, prof_key in (("off", "off"), ("on", "on")):
        pr = cProfile.Profile()
        sync()
        pr.enable()
        for _ in range(5):
            steps[name]()
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
        (OUT / f"cprofile_{prof_key}.txt").write_text(s.getvalue())
    targets = [(regather.GatheredOutput, "start"), (regather.GatheredOutput, "take"),
               (regather._RegatherLinear, "forward"), (regather._RegatherLinear, "backward"),
               (regather, "attach"), (output_recompute, "track"), (output_recompute._Remake, "__call__"),
               (output_recompute, "_check_statistics"), (output_recompute, "_norm_node"),
               (output_checks, "fingerprint"), (output_checks, "check_equal"), (output_checks, "_check_pending"),
               (output_checks, "check_arrived"), (ops, "recompute_output"), (sequence_gather, "start_gather"),
               (sequence_gather, "gathered")]
    for owner, name in targets:
        if not hasattr(owner, name):  # the tree measured has no such piece
            continue
        wrap(owner, name, f"{getattr(owner, '__name__', owner)}.{name}".replace("shardnorm.", ""))
    result = {"host_ms": host, "step_ms": step, "timers": {}}
    for k in steps:
        TIMES.clear()
        CALLS.clear()
        for _ in range(10):
            steps[k]()
        sync()
        result["timers"][k] = {label: (TIMES[label] / 10 * 1e6, CALLS[label] / 10) for label in TIMES}
        log(f"-- {k}: inclusive host us per step (calls per step)")
        for label, (us, calls) in sorted(result["timers"][k].items(), key=lambda kv: -kv[1][0]):
            log(f"   {label:60s} {us:9.1f} ({calls:.0f})")
    (OUT / "sp_host.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
