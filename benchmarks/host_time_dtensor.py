"""Host (CPU) time per sequence-parallel norm call: DTensor `Shard(1)` inputs, shardnorm against torch.

    python benchmarks/host_time_dtensor.py --out OUT_DIR                     # CPU, a 1-rank gloo mesh
    torchrun --nproc-per-node 2 benchmarks/host_time_dtensor.py --device cuda --out OUT_DIR   # 2 GPUs, NCCL

Each provider is a norm module parallelized over the tp mesh as the main job does it (parallel/parallelize.py):
- `torch_sp`: torch's `nn.RMSNorm` under torch's `SequenceParallel` (with a residual: `norm(x + residual)`,
  the DTensor add included, as parallel/model.py's `add_norm` does for torch's norms);
- `shardnorm_sp`: shardnorm's `RMSNorm` under `SequenceParallelNorm`, no reducer: the weight grad comes back
  `Partial`, as in the main job, whose FSDP2 reduces it (`shardnorm.fsdp`); with a residual the add is fused;
- `shardnorm_sp_reducer`: the same with `attach_reducer` (grads pushed into the reducer's fp32 buffer), timed
  inside `shardnorm.accumulate`: the reducer's per-call cost, without its once-per-step all-reduce.
Inputs x (and residual) are DTensors sharded on the sequence dim, built once; forward+backward runs
`y.backward(dy)` with a DTensor dy. Timing: benchmarks/host_time.py's `host_us_interleaved` (the providers
take turns round by round; best of 3 medians). CPU runs use the torch backend (the kernels' time is small at
the default shapes, so host time dominates); on GPUs the Triton kernels run and nothing syncs inside the loop.
No collective runs in the timed calls, so the ranks time independently; rank 0 writes
OUT_DIR/host_time_dtensor.json and .md.
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time import host_us_interleaved, write_profiles  # noqa: E402

# global [batch, sequence, hidden]; tp=2 gives each rank 8 rows of 4096 (host_time.py's 8 x 4096)
GPU_SHAPES = ((1, 16, 4096),)
CPU_SHAPES = ((1, 16, 64), (1, 16, 4096))


def init(device_type: str):
    """The default process group (torchrun's, else one rank) and this rank's device."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port for the one-rank group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


class _AddNorm(torch.nn.Module):
    """torch's norm on x + residual: the pre-norm step of parallel/model.py for torch norms."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        return self.norm(x + residual)


def providers(n: int, mesh, device, dtype, residual: bool) -> dict:
    def make(cls, style, reducer=False):
        norm = cls(n, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.normal_(generator=torch.Generator(device).manual_seed(0))
        norm = parallelize_module(norm, mesh, style)
        if reducer:
            attach_reducer(norm)
        return norm

    torch_norm = make(torch.nn.RMSNorm, SequenceParallel())
    ours, routed = make(shardnorm.RMSNorm, SequenceParallelNorm()), make(shardnorm.RMSNorm, SequenceParallelNorm(), True)
    if residual:
        torch_add = _AddNorm(torch_norm)
        return {"torch_sp": lambda x, r: torch_add(x, r),
                "shardnorm_sp": lambda x, r: ours(x, r)[0],
                "shardnorm_sp_reducer": lambda x, r: routed(x, r)[0]}, routed
    return {"torch_sp": lambda x, r: torch_norm(x), "shardnorm_sp": lambda x, r: ours(x),
            "shardnorm_sp_reducer": lambda x, r: routed(x)}, routed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", nargs="*", help="BxSxN global shapes, sharded on S (default: per device)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a cProfile of each provider's forward+backward to OUT/profile/ (rank 0)")
    parser.add_argument("--label", default="", help="a name for this tree in the output (e.g. before / after)")
    args = parser.parse_args()
    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else \
        (GPU_SHAPES if args.device == "cuda" else CPU_SHAPES)
    gen = torch.Generator(device).manual_seed(1234 + rank)
    rows = []
    for b, s, n in shapes:
        if s % world:
            raise SystemExit(f"--shapes: sequence length {s} is not divisible by the {world} ranks")

        def shard(requires_grad=False):
            local = torch.randn(b, s // world, n, device=device, dtype=dtype, generator=gen)
            return DTensor.from_local(local.requires_grad_(requires_grad), mesh, [Shard(1)], run_check=False)

        for residual in (False, True):
            x, r, dy = shard(True), shard(True) if residual else None, shard()
            fns, routed = providers(n, mesh, device, dtype, residual)
            with shardnorm.accumulate(routed):
                forward = host_us_interleaved({name: (lambda f=f: f(x, r)) for name, f in fns.items()})
                steps = {name: (lambda f=f: f(x, r).backward(dy)) for name, f in fns.items()}
                backward = host_us_interleaved(steps)
                if args.profile and rank == 0:
                    write_profiles(args.out, f"{'add_rms' if residual else 'rms'}-{b}x{s}x{n}", steps)
            for name in fns:
                rows.append({"norm": "add_rms" if residual else "rms", "b": b, "s": s, "n": n,
                             "local_rows": b * s // world, "provider": name, "forward_us": forward[name],
                             "forward_backward_us": backward[name]})
                if rank == 0:
                    print(rows[-1], flush=True)
    dist.barrier()
    if rank == 0:
        write(args.out, rows, args.label, device, dtype, world)
    dist.destroy_process_group()


def write(out: str, rows: list, label: str, device, dtype, world: int) -> None:
    env = {"torch": torch.__version__, "dtype": str(dtype), "world_size": world, "label": label,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    os.makedirs(out, exist_ok=True)
    name = f"host_time_dtensor{'_' + label if label else ''}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    lines = [f"Host us per call, DTensor Shard(1) inputs on a {world}-rank mesh, {env['device']}, {dtype}, "
             f"torch {env['torch']}{', ' + label if label else ''}", "",
             "| norm | B x S x N (local rows) | provider | forward | forward+backward |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['norm']} | {r['b']} x {r['s']} x {r['n']} ({r['local_rows']}) | {r['provider']} | "
                     f"{r['forward_us']:.1f} | {r['forward_backward_us']:.1f} |")
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
