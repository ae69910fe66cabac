"""Count and time one step's norm-grad all-reduces with torch.profiler; `AllReduceCounter` counts them (and their
bytes) as they are dispatched, without a profiler.

Which all-reduces are norm grads: in the programs here the sequence-parallel linears communicate with
all-gather / reduce-scatter, FSDP reduces with reduce-scatter, and grad clipping and loss logging
all-reduce scalars (loss logging) or per-parameter norms (grad clipping, which the engine runs inside a
`clip_grad_norm` profiler range). So a norm-grad all-reduce is an all-reduce op (`c10d::allreduce_` from
shardnorm's reducer, `_c10d_functional::all_reduce` from a DTensor `Partial -> Replicate`, not counting
the c10d op a functional one runs inside) of more than one element, outside `clip_grad_norm`.
On GPUs each NCCL all-reduce kernel is attributed to the CPU op that launched it (kernel -> its launch
by correlation id -> the all-reduce op around that launch on the same thread), which gives the kernels'
time and the part of it not overlapped by any compute kernel (exposed).
"""

import gzip
import json
import os
import tempfile
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

ALL_REDUCE_OPS = ("c10d::allreduce_", "_c10d_functional::all_reduce", "_c10d_functional::all_reduce_")
EXCLUDED_RANGE = "clip_grad_norm"


def _numel(event: dict) -> int:
    dims = (event.get("args") or {}).get("Input Dims") or [[]]
    first = dims[0] if dims and isinstance(dims[0], list) else []
    if first and isinstance(first[0], list):  # a list of tensors: the first one
        first = first[0]
    n = 1
    for d in first:
        n *= int(d)
    return n


def _inside(event: dict, outer: list[dict]) -> bool:
    """Whether `event` runs within one of `outer` (same thread, time range contains it)."""
    return any(o is not event and o["tid"] == event["tid"] and o["ts"] <= event["ts"]
               and event["ts"] + event["dur"] <= o["ts"] + o["dur"] for o in outer)


def _merged(intervals):
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def busy_ms(intervals) -> float:
    """Milliseconds covered by at least one of the (start, end) intervals, in the trace's microseconds."""
    return sum(end - start for start, end in _merged(intervals)) / 1e3


def span_ms(intervals) -> float:
    """Milliseconds from the first interval's start to the last one's end (0 for none)."""
    intervals = list(intervals)
    return (max(end for _, end in intervals) - min(start for start, _ in intervals)) / 1e3 if intervals else 0.0


def _exposed_us(comm, compute) -> float:
    busy = _merged(compute)
    return sum(end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
               for start, end in comm)


def summarize_trace(trace: dict) -> dict:
    """Norm-grad all-reduce ops (count, elements) and, where the trace has kernels, their kernel time."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ops = [e for e in events if e.get("name") in ALL_REDUCE_OPS]
    ops = [e for e in ops if not _inside(e, ops)]
    excluded = [e for e in events if e.get("name") == EXCLUDED_RANGE]
    norm_ops = [e for e in ops if _numel(e) > 1 and not _inside(e, excluded)]
    result = {"norm_grad_all_reduces": len(norm_ops), "norm_grad_elements": sum(map(_numel, norm_ops)),
              "other_all_reduces": len(ops) - len(norm_ops)}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return result
    launches = {e["args"]["correlation"]: e for e in events  # NCCL launches through the driver API
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}

    def launched_by_norm_op(kernel) -> bool:
        launch = launches.get((kernel.get("args") or {}).get("correlation"))
        return launch is not None and any(
            op["tid"] == launch["tid"] and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"] for op in norm_ops)

    all_reduces = [e for e in kernels if "AllReduce" in e["name"]]
    comm = [e for e in all_reduces if launched_by_norm_op(e)]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in comm]
    result.update(norm_grad_kernels=len(comm), norm_grad_kernel_ms=sum(b - a for a, b in intervals) / 1e3,
                  norm_grad_exposed_ms=_exposed_us(intervals, compute) / 1e3,
                  all_reduce_kernels=len(all_reduces),
                  all_reduce_kernel_ms=sum(e["dur"] for e in all_reduces) / 1e3, **_step_time(events, kernels))
    return result


def _step_time(events: list[dict], kernels: list[dict]) -> dict:
    """Where the profiled step's time goes: the GPU's span and busy time (kernels of any stream, merged), and
    the host time in norm ops (outermost CPU ops whose name has "norm": torch's aten ops and autograd nodes,
    shardnorm's Functions and ops), forward and backward together."""
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    cpu = [e for e in events if e.get("cat") == "cpu_op" or e.get("cat") == "python_function"]
    norms = [e for e in cpu if "norm" in e["name"].lower()]
    norms = [e for e in norms if not _inside(e, norms)]
    return {"gpu_span_ms": span_ms(intervals),
            "gpu_busy_ms": busy_ms(intervals),
            "kernel_count": len(kernels), "norm_host_ms": sum(e["dur"] for e in norms) / 1e3,
            "norm_host_ops": len(norms)}


@contextmanager
def profiled_collectives(cuda: bool, keep_trace: str | None = None):
    """`with profiled_collectives(cuda) as found: step()`; afterwards `found` holds summarize_trace's dict.
    `keep_trace`: also write this rank's chrome trace there, gzipped (open it in Perfetto)."""
    found: dict = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield found
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    found.update(summarize_trace(trace))
    if keep_trace:
        os.makedirs(os.path.dirname(keep_trace) or ".", exist_ok=True)
        with gzip.open(keep_trace, "wt") as f:
            json.dump(trace, f)


class AllReduceCounter(TorchDispatchMode):
    """All-reduces issued (eager c10d or functional, as DTensor's redistribute issues them) and bytes."""

    OPS = (torch.ops.c10d.allreduce_, torch.ops._c10d_functional.all_reduce)

    def __init__(self):
        super().__init__()
        self.count = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.OPS:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.count += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))
