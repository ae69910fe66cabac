"""Sequence-parallel training step of a stack of Llama-like blocks: torch's norms and plan against shardnorm's
README recipe, with and without its memory option, eager and compiled, as alternating rounds.

Each block is `x + wo(silu(wa(n(x))) * wb(n(x)))` twice: every norm feeds two column-parallel consumers (like q/k/v,
gate/up) and a row-parallel output back to the sequence shard. Variants, all on one tensor-parallel mesh:

- `torch`: `nn.RMSNorm` under `SequenceParallel`, the sublayer gathering the norm's shard once for both consumers
  (`PrepareModuleInput`, torchtitan's plan);
- `shardnorm`: the README's recipe, `SequenceParallelNorm(output_layouts=Replicate())` (the norm gathers its own
  output) read by `RegatherColwiseParallel` consumers, `attach_reducer`, micro-batches but the last inside
  `shardnorm.accumulate`;
- `shardnorm_discard`: the same with `keep_output=False` (each rank keeps its shard; the consumers gather it again in
  backward, overlapped with their dgrad GEMM).

A step is MICRO_BATCHES forward+backward passes and an SGD step. Per round every variant runs `--steps` timed steps
(after `--warmup`), in an order rotated each round; each round's ratio of median step times is one sample, and the
table gives their median and range. Memory: bytes the first micro-batch's forward leaves allocated, and the peak.
Losses of the first step are compared with torch's (each variant's own model, the same weights and data).

    torchrun --nproc-per-node 2 -m benchmarks.sp_step --out OUT_DIR [--compile] [--rounds 5] [--trace]
    python -m benchmarks.sp_step --summary OUT_DIR      # every sp_step_*.json there: sp_step.md and sp_step.png
"""

import argparse
import ast
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import shardnorm
from benchmarks import common
from shardnorm.distributed import RegatherColwiseParallel, SequenceParallelNorm, attach_reducer

MICRO_BATCHES = 2
VARIANTS = ("torch", "shardnorm", "shardnorm_discard")


class Mlp(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.wa = nn.Linear(dim, ffn, bias=False)
        self.wb = nn.Linear(dim, ffn, bias=False)
        self.wo = nn.Linear(ffn, dim, bias=False)

    def forward(self, h):
        return self.wo(nn.functional.silu(self.wa(h)) * self.wb(h))


class Sub(nn.Module):
    def __init__(self, dim, ffn, norm):
        super().__init__()
        self.norm, self.mlp = norm, Mlp(dim, ffn)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Block(nn.Module):
    def __init__(self, dim, ffn, make_norm):
        super().__init__()
        self.first, self.second = Sub(dim, ffn, make_norm()), Sub(dim, ffn, make_norm())

    def forward(self, x):
        return self.second(self.first(x))


def build(variant: str, args, mesh, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if variant == "torch":
        make_norm = lambda: nn.RMSNorm(args.dim, eps=1e-6)  # noqa: E731
    else:
        make_norm = lambda: shardnorm.RMSNorm(args.dim, eps=1e-6)  # noqa: E731
    model = nn.Sequential(*[Block(args.dim, args.ffn, make_norm) for _ in range(args.layers)])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(device="cuda" if args.device == "cuda" else "cpu", dtype=args.dtype)
    for sub in (s for block in model for s in (block.first, block.second)):
        # shardnorm's consumers of the gathered output re-gather the norm's shard in backward with keep_output=False
        colwise = ColwiseParallel if variant == "torch" else RegatherColwiseParallel
        consumers = {"mlp.wa": colwise(), "mlp.wb": colwise(), "mlp.wo": RowwiseParallel(output_layouts=Shard(1))}
        if variant == "torch":  # torchtitan's plan: the sublayer gathers the norm's shard once for its consumers
            plan = {"norm": SequenceParallel(),
                    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        else:
            sub.norm.keep_output = variant != "shardnorm_discard"
            plan = {"norm": SequenceParallelNorm(output_layouts=Replicate())}
        parallelize_module(sub, mesh, plan | consumers)
    if variant != "torch":
        attach_reducer(model)
    if args.compile:
        # static shapes: every block's graph is the first one's (its recompile on the next block's parameters would
        # otherwise trace DTensors with symbolic sizes)
        for block in model:
            block.compile(dynamic=False, options=args.inductor or None)
    return model


def step(model, variant, batches, opt) -> float:
    losses = []
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        ctx = shardnorm.accumulate(model) if variant != "torch" and not last else contextlib.nullcontext()
        with ctx:
            y = model(x)
            y = y.to_local() if hasattr(y, "to_local") else y
            loss = y.float().square().mean()
            loss.backward()
        losses.append(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack(losses).sum()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def held_after_forward(model, x) -> int:
    _sync()
    before = _allocated()
    y = model(x)
    _sync()
    held = _allocated() - before
    (y.to_local() if hasattr(y, "to_local") else y).float().square().mean().backward()
    return held


def _covered(interval, others) -> float:
    """Length of `interval` (start, end) covered by the union of the sorted intervals `others`."""
    start, end = interval
    covered, reach = 0.0, start
    for s, e in others:
        if e <= reach:
            continue
        if s >= end:
            break
        lo = max(s, reach)
        covered += max(0.0, min(e, end) - lo)
        reach = max(reach, min(e, end))
    return covered


def trace_step(model, variant, batches, opt, out, name, keep: bool) -> dict:
    """One step under torch's profiler: how much of the step's collective kernel time no compute kernel overlaps
    (exposed), by the kernels' own timestamps; with `keep` the trace goes to `out/name.json.gz`, the host's ops and
    launches beside the GPU's kernels (what the host was doing while the GPU waited)."""
    import gzip
    import json

    from torch.profiler import ProfilerActivity, profile

    common.Path(out).mkdir(parents=True, exist_ok=True)
    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step(model, variant, batches, opt)
        _sync()
    path = common.Path(out) / f"{name}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    if keep:
        with gzip.open(f"{path}.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    path.unlink()
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("cat") == "kernel" and e.get("dur") is not None]
    comm = [(s, e) for s, e, n in kernels if "nccl" in n.lower()]
    compute = sorted((s, e) for s, e, n in kernels if "nccl" not in n.lower())
    comm_us = sum(e - s for s, e in comm)
    exposed = sum((e - s) - _covered((s, e), compute) for s, e in comm)
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels) if kernels else 0.0
    return {"collective_kernels": len(comm), "collective_ms": comm_us / 1e3, "exposed_collective_ms": exposed / 1e3,
            "compute_kernel_ms": sum(e - s for s, e in compute) / 1e3, "gpu_span_ms": span / 1e3}


def summarize(folder) -> None:
    """One table and one plot of every run in `folder`: each ratio's median and range, by mode and tp."""
    import json

    runs = []
    for path in sorted(common.Path(folder).glob("sp_step_*_tp*.json")):
        run = json.loads(path.read_text())
        run["label"] = path.stem.removeprefix("sp_step_")  # e.g. eager_tp2, compiled_tp4_reorder
        runs.append(run)
    runs.sort(key=lambda r: (r["mode"] != "eager", r["tp"], r["label"]))
    rows, labels = [], []
    for r in runs:
        for name, p in r["pairs"].items():
            rows.append([r["label"], name, f"{p['median']:.3f}", f"{p['min']:.3f}-{p['max']:.3f}"])
        held = r["held_after_forward_mib"]
        rows.append([r["label"], "held after forward MiB (torch / shardnorm / discard)",
                     " / ".join(f"{held[v]:.0f}" for v in VARIANTS if v in held), ""])
        trace = r.get("trace") or {}
        if trace:
            spans = [f"{trace[v]['exposed_collective_ms']:.2f}, {trace[v]['gpu_span_ms']:.1f}"
                     for v in VARIANTS if v in trace]
            rows.append([r["label"], "one profiled step: exposed collective ms, GPU span ms (torch / shardnorm / "
                         "discard)", " / ".join(spans), ""])
        labels.append(r["label"])
    lines = ["# SP block stack: shardnorm's README recipe against torch's norms and plan", "",
             "Step-time ratios, median of the alternating rounds and their range; per-run tables and commands in "
             "the `sp_step_<run>.md` files beside this one.", ""]
    lines += common.table(["run", "ratio", "median", "range"], rows)
    (common.Path(folder) / "sp_step.md").write_text("\n".join(lines) + "\n")
    plt = common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 2, 3.5))
    names = ("shardnorm / torch", "shardnorm_discard / shardnorm")
    for k, name in enumerate(names):
        med = [r["pairs"][name]["median"] for r in runs]
        err = [[m - r["pairs"][name]["min"] for m, r in zip(med, runs)],
               [r["pairs"][name]["max"] - m for m, r in zip(med, runs)]]
        ax.bar([i + 0.4 * k for i in range(len(runs))], med, 0.4, yerr=err, capsize=3, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(runs))], labels)
    ax.set_ylabel("step time ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    common.save_figure(fig, common.Path(folder) / "sp_step.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", help="write the table and plot of the runs in this folder, and stop")
    parser.add_argument("--out")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Inductor options for every variant's compile (torch.compile's options), e.g. "
                             "aten_distributed_optimizations.enable_overlap_scheduling=True")
    parser.add_argument("--trace", action="store_true",
                        help="after the rounds, one step per variant under torch's profiler: collective kernel time "
                             "overlapped by compute, and the traces")
    args = parser.parse_args()
    if args.summary:
        summarize(args.summary)
        return
    if not args.out:
        parser.error("--out is required for a run")
    if args.device == "cuda":
        common.require_cuda(parser, "sp_step --device cuda (the default; --device cpu runs on gloo)")
    args.inductor = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.inductor)}
    args.dtype = torch.bfloat16
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(args.device, (world,))
    g = torch.Generator().manual_seed(0)
    local_seq = args.seq // world
    batches = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank * local_seq:(rank + 1) * local_seq]
               .contiguous().to(args.device, args.dtype) for _ in range(MICRO_BATCHES)]
    models = {v: build(v, args, mesh, seed=1) for v in args.variants}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-6) for v, m in models.items()}
    first_loss, held, peak = {}, {}, {}
    for v in args.variants:  # warm-up (compiles), memory and first-step losses
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        held[v] = held_after_forward(models[v], batches[0])
        opts[v].zero_grad(set_to_none=True)
        first_loss[v] = step(models[v], v, batches, opts[v]).item()
        for _ in range(args.warmup):
            step(models[v], v, batches, opts[v])
        _sync()
        peak[v] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    times = {v: [] for v in args.variants}
    host = {v: [] for v in args.variants}  # time until the step's work is queued: near the step time when host-bound
    for r in range(args.rounds):
        for v in common.turns(list(args.variants), r):
            samples, queued = [], []
            for _ in range(args.steps):
                dist.barrier()
                _sync()
                t0 = time.perf_counter()
                step(models[v], v, batches, opts[v])
                queued.append((time.perf_counter() - t0) * 1e3)
                _sync()
                samples.append((time.perf_counter() - t0) * 1e3)
            times[v].append(statistics.median(samples))
            host[v].append(statistics.median(queued))
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{v} {times[v][-1]:.1f} ms" for v in args.variants), flush=True)
    mode = "compiled" if args.compile else "eager"
    traces = {}
    if args.trace:
        for v in args.variants:
            traces[v] = trace_step(models[v], v, batches, opts[v], args.out,
                                   f"sp_step_trace_{mode}_tp{world}_{v}_rank{rank}", keep=rank == 0)
    if rank != 0:
        dist.destroy_process_group()
        return
    pairs = {}
    for b, a in (("shardnorm", "torch"), ("shardnorm_discard", "torch"), ("shardnorm_discard", "shardnorm")):
        if a in times and b in times:
            pairs[f"{b} / {a}"] = common.median_range([tb / ta for tb, ta in zip(times[b], times[a])])
    result = {"environment": common.environment(args.device, world), "command": common.command("benchmarks.sp_step"),
              "mode": mode, "tp": world, "shape": vars(args) | {"dtype": str(args.dtype)},
              "step_ms": times, "host_ms": host, "pairs": pairs,
              "held_after_forward_mib": {v: b / 2**20 for v, b in held.items()},
              "peak_mib": {v: b / 2**20 for v, b in peak.items()}, "first_step_loss": first_loss,
              "trace": traces}
    out = common.Path(args.out)
    common.write_json(out / f"sp_step_{mode}_tp{world}.json", result)
    lines = [f"# SP block stack, tp={world}, {mode}", "", f"`{result['command']}`", "",
             f"{result['environment']['device']} x {world}, torch {torch.__version__}; {args.layers} blocks of 2 "
             f"norms, D {args.dim}, F {args.ffn}, S {args.seq}, {MICRO_BATCHES} micro-batches, bf16; "
             f"{args.rounds} rounds of {args.steps} steps, order rotated each round", ""]
    lines += common.table(["variant", "step ms (median of rounds)", "host ms (work queued)", "held after forward MiB",
                           "peak MiB", "first-step loss"],
                          [[v, f"{statistics.median(times[v]):.1f}", f"{statistics.median(host[v]):.1f}",
                            f"{held[v] / 2**20:.0f}",
                            f"{peak[v] / 2**20:.0f}", f"{first_loss[v]:.6g}"] for v in args.variants])
    ratios = [[k, f"{p['median']:.3f}", f"{p['min']:.3f}-{p['max']:.3f}"] for k, p in pairs.items()]
    lines += [""] + common.table(["ratio", "median", "range"], ratios)
    if traces:
        lines += ["", "One step under torch's profiler (rank 0): collective kernels, and the part of their time no "
                  "compute kernel overlaps", ""]
        lines += common.table(["variant", "collective kernels", "collective ms", "exposed ms", "compute kernel ms",
                               "GPU span ms"],
                              [[v, t["collective_kernels"], f"{t['collective_ms']:.2f}",
                                f"{t['exposed_collective_ms']:.2f}", f"{t['compute_kernel_ms']:.1f}",
                                f"{t['gpu_span_ms']:.1f}"] for v, t in traces.items()])
    (out / f"sp_step_{mode}_tp{world}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
