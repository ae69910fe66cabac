"""One-off: the norm-grad reducer's host time at the backward passes' boundaries (the pending sums stashed into
`.grad`, taken back, reduced and written) per accumulating step, and its tensor ops other than views (each a kernel
on a GPU), for N sequence-parallel RMSNorms of hidden 4096 in one process with torch's `fake` process group (tp=2
shapes, no collective cost). Run once per tree to compare:

    PYTHONPATH=src python benchmarks/results/cpu-torch2.13-triton3.9/reducer_host.py [--norms 8 65] [--steps 40]
        [--device cuda]
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import shardnorm
from shardnorm.distributed import SequenceParallelNorm, attach_reducer

MICRO_BATCHES, HIDDEN = 2, 4096


ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default)  # no kernel


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view and func not in ALLOCATIONS
        return func(*args, **(kwargs or {}))


def measure(mesh, norms: int, steps: int, device: str) -> dict:
    model = nn.Sequential(*[shardnorm.RMSNorm(HIDDEN) for _ in range(norms)]).to(device, torch.bfloat16)
    parallelize_module(model, mesh, {str(i): SequenceParallelNorm() for i in range(norms)})
    reducer = attach_reducer(model)
    spent, ops = [0.0], [0]
    counting = [False]

    def timed(method):
        def run(*args):
            t = time.perf_counter()
            if counting[0]:
                with Count() as c:
                    method(*args)
                ops[0] += c.ops
            else:
                method(*args)
            spent[0] += time.perf_counter() - t
        return run

    reducer._begin_backward = timed(reducer._begin_backward)
    reducer._end_backward = timed(reducer._end_backward)
    x = distribute_tensor(torch.randn(1, 16, HIDDEN, dtype=torch.bfloat16, device=device), mesh, [Shard(1)])
    per_step = []
    for step in range(steps + 3):
        counting[0] = step == 2
        spent[0] = 0.0
        for mb in range(MICRO_BATCHES):
            with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else torch.enable_grad():
                model(x).to_local().float().sum().backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 3:
            per_step.append(spent[0] * 1e3)
    return {"norms": norms, "boundary_ms_per_step": statistics.median(per_step),
            "boundary_ms_range": [min(per_step), max(per_step)], "ops_per_step": ops[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--norms", type=int, nargs="+", default=[8, 65])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh(args.device, (2,))
    for n in args.norms:
        print(json.dumps(measure(mesh, n, args.steps, args.device)))


if __name__ == "__main__":
    main()
