"""The profiled-step summaries read from torch.profiler traces: `parallel.collectives.summarize_trace`'s step-time
fields and `benchmarks/trace_kernels.py`, on synthetic traces with random kernels, against a brute-force count of
the microseconds the GPU is busy."""

import gzip
import json
import random

import pytest

from benchmarks import trace_kernels
from parallel.collectives import summarize_trace

NAMES = ("triton_poi_fused_add_3", "triton_poi_fused_add_7", "norm_fwd_kernel", "ncclDevKernel_AllGather_RING_LL",
         "nvjet_sm90_tst_256x128(int)")


def _random_trace(rng: random.Random, n: int = 60) -> dict:
    """Kernels at integer microseconds on two streams (overlapping), plus CPU norm ops, nested and not."""
    events = []
    for i in range(n):
        start, dur = rng.randrange(0, 2000), rng.randrange(1, 80)
        events.append({"ph": "X", "cat": "kernel", "name": rng.choice(NAMES), "ts": start, "dur": dur, "tid": i % 2,
                       "args": {}})
    outer = {"ph": "X", "cat": "cpu_op", "name": "shardnorm::norm_fwd", "ts": 100, "dur": 50, "tid": 9}
    inner = {"ph": "X", "cat": "cpu_op", "name": "aten::rms_norm", "ts": 110, "dur": 20, "tid": 9}
    other = {"ph": "X", "cat": "cpu_op", "name": "RmsNormBackward0", "ts": 400, "dur": 30, "tid": 9}
    return {"traceEvents": events + [outer, inner, other,
                                     {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999, "tid": 8}]}


def _busy_us(kernels) -> int:
    """Microseconds covered by at least one kernel, counted one by one."""
    return len({t for k in kernels for t in range(k["ts"], k["ts"] + k["dur"])})


def test_step_time_fields_count_busy_time_once_and_outermost_norm_ops():
    seed = random.randrange(2**31)
    trace = _random_trace(random.Random(seed))
    kernels = [e for e in trace["traceEvents"] if e["cat"] == "kernel"]
    found = summarize_trace(trace)
    assert found["gpu_busy_ms"] == pytest.approx(_busy_us(kernels) / 1e3), f"seed {seed}"
    assert found["gpu_span_ms"] == pytest.approx(
        (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / 1e3), f"seed {seed}"
    assert found["kernel_count"] == len(kernels)
    # the aten op inside shardnorm's op is not counted again; aten::mm has no "norm" in its name
    assert (found["norm_host_ops"], found["norm_host_ms"]) == (2, pytest.approx(0.080))


def test_trace_kernels_tables_sum_each_runs_kernels(tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    paths = []
    for name in "ab":
        path = tmp_path / f"{name}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(_random_trace(rng, n=rng.randrange(20, 80)), f)
        paths.append(str(path))
    runs = [trace_kernels.load(p) for p in paths]
    for kernels in runs:
        s = trace_kernels.summary(kernels)
        compute = [k for k in kernels if "nccl" not in k["name"].lower()]
        assert s["busy_ms"] == pytest.approx(_busy_us(kernels) / 1e3), f"seed {seed}"
        assert s["compute_busy_ms"] == pytest.approx(_busy_us(compute) / 1e3), f"seed {seed}"
        assert s["nccl_kernels"] + len(compute) == s["kernels"] == len(kernels)
        names = trace_kernels.by_name(kernels)
        # instance numbers and signatures dropped: the two fused-add kernels are one name
        assert set(names) <= {"triton_poi_fused_add", "norm_fwd_kernel", "ncclDevKernel_AllGather_RING_LL",
                              "nvjet_sm90_tst_256x128"}
        assert sum(c for c, _ in names.values()) == len(kernels)
        assert sum(ms for _, ms in names.values()) == pytest.approx(sum(k["dur"] for k in kernels) / 1e3)
    out = tmp_path / "table.md"
    trace_kernels.main([*paths, "--md", str(out)])
    text = out.read_text()
    assert "| A |" in text and "| B |" in text and "`triton_poi_fused_add`" in text, f"seed {seed}"
