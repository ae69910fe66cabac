"""Norm-grad reduction under tensor/sequence parallelism: shardnorm's bucketed reducer vs torch.

    PYTHONPATH=src:. torchrun --standalone --nproc-per-node 2 benchmarks/bench_sp_norm_grads.py --out sp.json

A stack of pre-norm blocks (norm -> column/row-split linear pair, twice per block, Megatron-style
sequence parallelism on a 1-D tp mesh), timed over steps of `--micro-batches` forward/backward passes.
Variants:
- `shardnorm`: shardnorm.RMSNorm + SequenceParallelNorm + the bucketed fp32 reducer (one all-reduce per
  bucket per step, launched during the last backward);
- `shardnorm_per_layer`: the same with reduce="per_layer" (one all-reduce per norm per micro-batch);
- `torch`: torch.nn.RMSNorm + torch's SequenceParallel; its `Partial` norm grads are made `Replicate`
  after the last backward, one all-reduce per parameter in the param dtype (what an optimizer or FSDP2
  triggers).
Reported per variant: forward and backward time per step (backward includes the norm-grad reduction),
norm-grad collectives per step and, on GPUs, their kernel time and the part of it not overlapped by
compute kernels (exposed), from one torch.profiler step. The sequence-parallel linears communicate with
all-gather/reduce-scatter and the loss is local, so every all-reduce in a step is a norm-grad one.
NCCL on GPUs (hidden 4096 by default), gloo on CPU (a tiny model, one timed step: a smoke run).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer
from parallel.collectives import profiled_collectives

VARIANTS = ("shardnorm", "shardnorm_per_layer", "torch")


class Block(nn.Module):
    """Pre-norm residual block: an attention-sized linear pair and an FFN pair, each behind a norm."""

    def __init__(self, hidden: int, ffn: int, norm_cls, dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.attention_norm = norm_cls(hidden, dtype=dtype, device=device)
        self.wqkv, self.wo = nn.Linear(hidden, hidden, **kw), nn.Linear(hidden, hidden, **kw)
        self.ffn_norm = norm_cls(hidden, dtype=dtype, device=device)
        self.w1, self.w2 = nn.Linear(hidden, ffn, **kw), nn.Linear(ffn, hidden, **kw)

    def forward(self, x):
        x = x + self.wo(F.silu(self.wqkv(self.attention_norm(x))))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, norm_cls, dtype, device):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, ffn, norm_cls, dtype, device) for _ in range(layers))
        self.norm = norm_cls(hidden, dtype=dtype, device=device)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build(variant: str, args, mesh, device):
    norm_cls = torch.nn.RMSNorm if variant == "torch" else shardnorm.RMSNorm
    model = Stack(args.layers, args.hidden, args.ffn, norm_cls, args.dtype, device)
    norm_style = SequenceParallel if variant == "torch" else SequenceParallelNorm
    parallelize_module(model, mesh, {
        "layers.*.attention_norm": norm_style(),
        "layers.*.ffn_norm": norm_style(),
        "layers.*.wqkv": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "layers.*.w1": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "norm": norm_style(),
    })
    if variant != "torch":
        attach_reducer(model, bucket_cap_mb=args.bucket_cap_mb,
                       reduce="per_layer" if variant == "shardnorm_per_layer" else "bucketed")
    return model


def norm_params(model):
    return [p for name, p in model.named_parameters() if name.endswith("norm.weight")]


def step(model, variant: str, batches, sync) -> tuple[float, float]:
    """One optimizer step's forward/backward passes; returns (forward s, backward s incl. grad reduction)."""
    fwd = bwd = 0.0
    for i, (x, target) in enumerate(batches):
        last = i == len(batches) - 1
        sync()
        t0 = time.perf_counter()
        with shardnorm.accumulate(model) if variant != "torch" and not last else torch.enable_grad():
            loss = (model(x).to_local().float() * target).sum()
            sync()
            t1 = time.perf_counter()
            loss.backward()
        if variant == "torch" and last:
            for p in norm_params(model):
                p.grad = p.grad.redistribute(placements=[Replicate()])
        sync()
        fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
    return fwd, bwd


def profile_step(model, variant, batches, sync, cuda: bool) -> dict:
    with profiled_collectives(cuda) as found:
        step(model, variant, batches, sync)
    return {"norm_grad_collectives_per_step": found["norm_grad_all_reduces"],
            "norm_grad_collective_ms": found.get("norm_grad_kernel_ms"),
            "exposed_ms": found.get("norm_grad_exposed_ms")}


def run_variant(variant: str, args, mesh, device, sync) -> dict:
    torch.manual_seed(args.seed)
    model = build(variant, args, mesh, device)
    tp, rank = mesh.size(), mesh.get_local_rank()
    local_seq = args.seq // tp
    batches = []
    for _ in range(args.micro_batches):
        x = torch.randn(args.batch, args.seq, args.hidden, dtype=args.dtype, device=device)
        x_local = x.chunk(tp, dim=1)[rank].contiguous().requires_grad_()
        batches.append((DTensor.from_local(x_local, mesh, [Shard(1)], run_check=False),
                        torch.randn(args.batch, local_seq, args.hidden, device=device)))
    times = []
    for i in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        fwd_bwd = step(model, variant, batches, sync)
        if i >= args.warmup:
            times.append(fwd_bwd)
    model.zero_grad(set_to_none=True)
    result = profile_step(model, variant, batches, sync, device.type == "cuda")
    result.update(forward_ms_per_step=1e3 * sum(t[0] for t in times) / len(times),
                  backward_ms_per_step=1e3 * sum(t[1] for t in times) / len(times),
                  norm_parameters=len(norm_params(model)))
    if variant != "torch":
        result["buckets"] = model._shardnorm_reducer.num_buckets
    del model, batches
    return result


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=None, help="default: 4096 on GPU, 64 on CPU")
    p.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--seq", type=int, default=None, help="default: 4096 on GPU, 16 on CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="timed steps; default: 3 on GPU, 1 on CPU")
    p.add_argument("--warmup", type=int, default=None, help="default: 2 on GPU, 0 on CPU")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    args.hidden = args.hidden or (4096 if cuda else 64)
    args.ffn = args.ffn or 4 * args.hidden
    args.seq = args.seq or (4096 if cuda else 16)
    args.steps = args.steps or (3 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    args.dtype = torch.bfloat16 if cuda else torch.float32
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if args.seq % mesh.size():
        raise SystemExit(f"--seq {args.seq} must be divisible by the tp size {mesh.size()}")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; choose from {VARIANTS}")
    results = {v: run_variant(v, args, mesh, device, sync) for v in variants}
    if dist.get_rank() == 0:
        report = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "backend": dist.get_backend(), "tp": mesh.size(),
            "config": {k: (str(v) if k == "dtype" else v) for k, v in vars(args).items()},
            "torch": torch.__version__, "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        for v, r in results.items():
            print(f"{v:>20}: backward {r['backward_ms_per_step']:.1f} ms/step, "
                  f"{r['norm_grad_collectives_per_step']} norm-grad all-reduces/step, "
                  f"exposed {r['exposed_ms']} ms")
    dist.barrier()  # every rank done with its collectives before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
