"""Sequence-parallel activation memory and step time of the main job's model: torch-native SP against shardnorm.

Three variants of `parallel.model.Transformer` parallelized as the main job does it (`parallel.parallelize`: the TP
plan, `--compile`, FSDP2 over a dp=1 mesh dim with bf16 compute and fp32 grad reduction), one process per tp rank:
- torch:            torch.nn.RMSNorm + `SequenceParallel`; the consumers' `PrepareModuleInput` all-gathers, and
                    every rank saves the gathered norm output in full for backward.
- shardnorm:        converted norms, `SequenceParallelNorm(output_layouts=Replicate())`: the norm gathers (the
                    same one all-gather); its consumers, `RegatherColwiseParallel`, save the gathered output as
                    torch's `ColwiseParallel` does.
- shardnorm_recompute: the same with keep_output=False: the consumers keep the norm's shard instead; their backward
                    recomputes the local output and all-gathers it again, overlapped with their dgrad GEMM.

Per rank: the bytes a forward leaves allocated (what the backward will read: activations plus the logits), the
peak of a whole step over the allocation before it (GPU only), the step time as alternating pairs against the
torch variant (GPU only: K rounds, each round one step of every variant in turn; the median of the per-round
ratios and their range), the losses (shardnorm variants bitwise equal, torch within bf16 rounding), the norm
weights' grads after the tp reduction against one fp32 process (torch reduces `Partial` grads in the params' dtype;
shardnorm's reducer sums fp32 partials), and the norm-grad all-reduces of one more step, under torch.profiler
(`parallel.collectives`: torch's one per norm parameter, shardnorm's reducer one per bucket; on GPUs also their
NCCL kernel time and the part of it no compute kernel overlaps).
Bytes on the CPU: every storage an op made during the forward, weakly held, counted if still alive after it (a
dispatch mode: the norms take their op route there); on a GPU: `torch.cuda.memory_allocated`.

    python -m benchmarks.sp_activation_memory --tp 2 4 8 --out DIR                    # CPU, gloo (accounting)
    python -m benchmarks.sp_activation_memory --device cuda --tp 2 --dim 2048 --layers 8 --ffn 5632 \\
        --heads 16 --seq 2048 --batch 8 --dtype bfloat16 --pairs 10 --out DIR          # 2 GPUs, NCCL
"""

import argparse
import gc
import os
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import command, environment, median_range, pyplot, rel_err, save_figure, table, write_json
from parallel.collectives import profiled_collectives
from parallel.runtime import free_port

VARIANTS = ("torch", "shardnorm", "shardnorm_recompute")
MIB = 2 ** 20


def _build(variant: str, args, mesh, device):
    """The main job's model and parallelization (`parallel.parallelize.parallelize`: TP plan, --compile, FSDP2 on
    the dp=1 mesh dim with bf16 compute and fp32 reduction; shardnorm's norm grads through its reducer)."""
    from parallel.config import ModelConfig, TrainConfig
    from parallel.model import build_model
    from parallel.parallelize import parallelize

    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads,
                      ffn_dim=args.ffn, max_seq_len=args.seq, norm_keep_output=variant != "shardnorm_recompute")
    norm = "torch" if variant == "torch" else "shardnorm"
    model = build_model(cfg, norm, device, seed=0)
    return parallelize(model, mesh, TrainConfig(norm=norm, compile=args.compile, dtype=args.dtype))


def _norm_grad_errors(models: dict, args, tokens, device) -> dict:
    """Per variant: the norm weights' grads (after the tp reduction, in the params' dtype) against one process
    running the model unsharded in fp32: max over norms of the relative error (norm of the difference over the
    norm of the reference)."""
    from torch.distributed.tensor import DTensor

    from parallel.config import ModelConfig
    from parallel.model import build_model

    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads,
                      ffn_dim=args.ffn, max_seq_len=args.seq)
    ref = build_model(cfg, "torch", device, seed=0)
    _loss(ref, tokens).backward()
    ref_grads = {n: p.grad.double() for n, p in ref.named_parameters() if "norm" in n}
    errors = {}
    for v, model in models.items():
        model.zero_grad(set_to_none=True)
        _loss(model, tokens).backward()
        worst = 0.0
        for n, p in model.named_parameters():
            if n in ref_grads:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst = max(worst, rel_err(g, ref_grads[n]))
        errors[v] = worst
    return errors


def _loss(model, tokens):
    logits = model(tokens)
    logits = logits.to_local() if type(logits).__name__ == "DTensor" else logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def _forward_bytes(model, tokens, device) -> tuple:
    """(loss, bytes the forward left allocated on this rank)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = _loss(model, tokens)
        torch.cuda.synchronize()
        return loss, torch.cuda.memory_allocated() - before
    with _Allocations() as allocations:
        loss = _loss(model, tokens)
    return loss, allocations.held()


class _Allocations(TorchDispatchMode):
    """Every storage an op makes during the forward (DTensor ops as their local ops), held weakly: after the
    forward, the bytes of those still alive are what the forward left for the backward (and the logits)."""

    def __init__(self):
        super().__init__()
        self.storages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type != "meta":
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out

    def held(self) -> int:
        """Bytes of the storages still alive, each once. Keyed by address only among the living: a storage freed
        during the forward leaves its address to a later one, which a key taken at allocation would hide."""
        gc.collect()
        alive = {}
        for ref in self.storages:
            storage = ref()
            if storage is not None:
                alive[storage.data_ptr()] = storage.nbytes()
        return sum(alive.values())


def _step(model, tokens, device) -> tuple:
    """One forward + backward: (loss, forward bytes, peak bytes over the start, seconds)."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss, forward_bytes = _forward_bytes(model, tokens, device)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - start_bytes if device.type == "cuda" else 0
    return loss.detach(), forward_bytes, peak, seconds


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    models = {v: _build(v, args, mesh, device) for v in VARIANTS}
    rows = {v: dict(losses=[], forward_bytes=[], peak_bytes=[], seconds=[]) for v in VARIANTS}
    for round_ in range(args.warmup + args.pairs):
        for v in VARIANTS:  # alternating: every round runs each variant once, in the same order
            loss, forward_bytes, peak, seconds = _step(models[v], tokens, device)
            if round_ >= args.warmup:
                row = rows[v]
                row["losses"].append(loss.item())
                row["forward_bytes"].append(forward_bytes)
                row["peak_bytes"].append(peak)
                row["seconds"].append(seconds)
    for v in VARIANTS:
        with profiled_collectives(device.type == "cuda") as found:
            _step(models[v], tokens, device)
        rows[v]["collectives"] = {k: found.get(k) for k in ("norm_grad_all_reduces", "norm_grad_kernel_ms",
                                                             "norm_grad_exposed_ms")}
    rows["norm_grad_rel_error"] = _norm_grad_errors(models, args, tokens, device)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _summary(tp: int, rows: dict, args) -> dict:
    errors = rows.pop("norm_grad_rel_error")
    torch_steps = rows["torch"]["seconds"]
    gathered_per_norm = args.batch * args.seq * args.dim * torch.finfo(getattr(torch, args.dtype)).bits // 8
    norms = 2 * args.layers + 1
    out = dict(tp=tp, device=args.device, dtype=args.dtype, compile=args.compile,
               gathered_mib_per_norm=gathered_per_norm / MIB, norms=norms, variants={})
    for v, row in rows.items():
        ratios = median_range([a / b for a, b in zip(row["seconds"], torch_steps)])
        out["variants"][v] = dict(
            forward_mib=statistics.median(row["forward_bytes"]) / MIB,
            peak_mib=statistics.median(row["peak_bytes"]) / MIB if args.device == "cuda" else None,
            step_ms=statistics.median(row["seconds"]) * 1e3,
            step_ratio_vs_torch_median=ratios["median"], step_ratio_range=[ratios["min"], ratios["max"]],
            pair_ratios=[a / b for a, b in zip(row["seconds"], torch_steps)], losses=row["losses"],
            norm_grad_rel_error_vs_fp32=errors[v], **row["collectives"])
    base, recompute = out["variants"]["shardnorm"], out["variants"]["shardnorm_recompute"]
    out["saved_mib_recompute_vs_shardnorm"] = base["forward_mib"] - recompute["forward_mib"]
    out["saved_mib_recompute_vs_torch"] = out["variants"]["torch"]["forward_mib"] - recompute["forward_mib"]
    out["losses_bitwise_shardnorm_variants"] = base["losses"] == recompute["losses"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="compile each block as the main job's --compile")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**environment(args.device, max(args.tp) if args.device == "cuda" else 1),
            "command": command(__spec__.name, argv)}
    results = []
    for tp in args.tp:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            print(f"tp={tp}: {torch.cuda.device_count()} GPUs visible, skipped")
            continue
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(tp, free_port(), args, queue), nprocs=tp, join=True)
        results.append(_summary(tp, queue.get(), args))
        write_json(args.out / "sp_activation_memory.json",
                   dict(meta=meta, args=vars(args) | {"out": str(args.out)}, results=results))
        r = results[-1]
        print(f"tp={tp}: forward MiB torch {r['variants']['torch']['forward_mib']:.2f}, shardnorm "
              f"{r['variants']['shardnorm']['forward_mib']:.2f}, recompute "
              f"{r['variants']['shardnorm_recompute']['forward_mib']:.2f} (gathered norm output "
              f"{r['gathered_mib_per_norm']:.2f} MiB x {r['norms']} norms)", flush=True)
    _write_markdown(results, args, meta)


def _collectives(row: dict) -> str:
    """Norm-grad all-reduces in a step, with their NCCL kernel ms (exposed ms) where the GPU was profiled."""
    count = row.get("norm_grad_all_reduces")
    if row.get("norm_grad_kernel_ms") is None:
        return "-" if count is None else str(count)
    return f"{count} ({row['norm_grad_kernel_ms']:.2f} ms, {row['norm_grad_exposed_ms']:.2f} exposed)"


def _write_markdown(results: list, args, meta: dict) -> None:
    rows = []
    for r in results:
        base = r["variants"]["torch"]["forward_mib"]
        for v, row in r["variants"].items():
            lo, hi = row["step_ratio_range"]
            rows.append([r["tp"], v, f"{row['forward_mib']:.2f}", f"{base - row['forward_mib']:.2f}",
                         f"{row['peak_mib']:.0f}" if row["peak_mib"] is not None else "-", f"{row['step_ms']:.1f}",
                         f"{row['step_ratio_vs_torch_median']:.3f} ({lo:.3f}-{hi:.3f})",
                         f"{row['norm_grad_rel_error_vs_fp32']:.2e}", _collectives(row)])
    lines = [f"{meta['device']}, torch {meta['torch']}. Command: `{meta['command']}`", ""]
    lines += table(["tp", "variant", "forward MiB / rank", "saved vs torch", "peak MiB", "step ms",
                    "step / torch (median, range)", "norm-grad rel. error vs fp32", "norm-grad all-reduces / step"],
                   rows)
    lines += ["", f"Gathered norm output per norm: {results[0]['gathered_mib_per_norm']:.2f} MiB; "
                  f"{results[0]['norms']} norms. Shardnorm variants' losses bitwise equal: "
                  f"{all(r['losses_bitwise_shardnorm_variants'] for r in results)}."]
    (args.out / "sp_activation_memory.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    tps = [r["tp"] for r in results]
    for v in VARIANTS:
        ax.plot(tps, [r["variants"][v]["forward_mib"] for r in results], marker="o", label=v)
    ax.set_xlabel("tp")
    ax.set_ylabel("bytes held after forward per rank (MiB)")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title(f"SP activation memory ({args.device}, {args.dtype})")
    fig.tight_layout()
    save_figure(fig, args.out / "sp_activation_memory.png", dpi=120)


if __name__ == "__main__":
    main()
