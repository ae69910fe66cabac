"""Compiled, Inductor launches the norm's kernels itself: the ops are Triton ops whose traced bodies record the
plans' launches through `torch.library.wrap_triton` (ops.py). Inductor copies each argument that its analysis of a
kernel (TTIR, `_torch_compat.triton_kernel_writes`) takes for written before every launch, and an input among them
that requires grad (the weight) fails the compile: the analysis must find exactly each kernel's outputs, for every
variant the traced bodies launch.

The analysis compiles the kernels to TTIR, which the interpreter (TRITON_INTERPRET, CI without a GPU) does not: it
runs in a subprocess without it, for an sm_90 target given to Triton as its active driver (no GPU needed)."""

import importlib
import itertools
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

# the arguments each kernel writes, by name; everything else it takes is read only
OUTPUTS = {"norm_fwd_kernel": {"Y", "Z", "MEAN", "RSTD"}, "norm_bwd_kernel": {"DX", "DW_OUT", "DB_OUT"},
           "row_sums_kernel": {"ROW_SUMS", "PARTIAL"}, "dx_kernel": {"DX"}, "column_sum_kernel": {"OUT_W", "OUT_B"}}
# N: one pass with several rows a tile (64, 1024), a tail tile (5120: LayerNorm with fp32 parameters forward, RMSNorm
# with a bf16 weight backward), persistent forward programs (fp32 parameters at 8192 and 16384), the split backward
# (16384 with two grads, 20000), the chunked forward (20000 with fp32 LayerNorm parameters, 40000)
SHAPES = ((4, 64), (64, 64), (4, 1024), (64, 1024), (64, 5120), (64, 8192), (64, 16384), (8, 20000), (8, 40000))


def _launches():
    """(kernel name, its arguments by name, constexprs included) of every launch the traced bodies record over
    SHAPES and the norm's variants, one per distinct specialization."""
    import torch

    from shardnorm.kernels import launch, norm_bwd_traced, norm_fwd_traced

    recorded = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((self.kernel, args, kwargs))

    launch.wrap_triton = Recorder
    for (m, n), rms, wdtype, params, extra, zero_centered in itertools.product(
            SHAPES, (True, False), (torch.bfloat16, torch.float32), ("weight", "bias", "both", "none"), (False, True),
            (False, True)):
        if rms and params in ("bias", "both"):
            continue
        x = torch.randn(m, n, dtype=torch.bfloat16)
        weight = torch.randn(n, dtype=wdtype) if params in ("weight", "both") else None
        bias = torch.randn(n, dtype=wdtype) if params in ("bias", "both") else None
        residual = torch.randn(m, n, dtype=torch.bfloat16) if extra else None
        y, z, mean, rstd = norm_fwd_traced(x, weight, bias, residual, 1e-5, rms, zero_centered)
        mean = x.new_empty(0) if mean is None else mean  # the ops' empty tensor for an absent output
        norm_bwd_traced(torch.randn_like(x), torch.randn_like(x) if extra else None, x, weight, mean, rstd,
                        bias is not None, rms, zero_centered)
    def spec(param, value):  # what the TTIR can depend on: constexprs, dtypes, absent pointers, ints' alignment
        if param.is_constexpr or value is None:
            return value
        if isinstance(value, torch.Tensor):
            return value.dtype
        return (value == 1, value % 16 == 0) if isinstance(value, int) else type(value)

    seen = {}
    for kernel, args, kwargs in recorded:
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}
        named.pop("num_warps")
        seen.setdefault((kernel.__name__, *(spec(p, named[p.name]) for p in kernel.params)), (kernel, named))
    return list(seen.values())


def _analyse() -> dict:
    """{kernel name: [launches analysed, [(constexprs, writes, outputs) of each launch where they differ]]}."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    from shardnorm import _torch_compat

    class Hopper:
        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Hopper())
    report = {name: [0, []] for name in OUTPUTS}
    for kernel, named in _launches():
        tensors = {k for k, v in named.items() if isinstance(v, torch.Tensor)}
        writes = set(_torch_compat.triton_kernel_writes(kernel, named))
        entry = report[kernel.__name__]
        entry[0] += 1
        if writes != OUTPUTS[kernel.__name__] & tensors:
            constexprs = {p.name: named[p.name] for p in kernel.params if p.is_constexpr}
            entry[1].append([repr(constexprs), sorted(writes), sorted(OUTPUTS[kernel.__name__] & tensors)])
    return report


def test_inductor_finds_each_kernel_writes_its_outputs_only():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert all(count for count, _ in report.values()), report  # every kernel launched by some variant
    wrong = {name: bad for name, (_, bad) in report.items() if bad}
    assert not wrong, "kernels whose analysed writes are not their outputs (constexprs, writes, outputs): " + \
        json.dumps(wrong, indent=1)[:6000]


# (rows, N, RMSNorm, x dtype, weight dtype, residual): direct dgamma (8 x 1024) and partial sums, tail tiles (3000,
# 5120), the split backward or on Hopper the staged one (20000: bf16 staged, fp32 split), the staged forward and
# backward on Hopper (65536)
CASES = [(8, 1024, True, torch.bfloat16, torch.bfloat16, False), (64, 1024, False, torch.float32, torch.float32, True),
         (64, 3000, True, torch.float32, torch.float32, True), (64, 3000, False, torch.bfloat16, torch.float32, False),
         (64, 4096, True, torch.bfloat16, torch.float32, True), (64, 4096, False, torch.float32, torch.float32, False),
         (64, 5120, True, torch.bfloat16, torch.bfloat16, False), (64, 8192, False, torch.bfloat16, torch.bfloat16, True),
         (64, 8192, True, torch.float32, torch.float32, False), (16, 20000, False, torch.bfloat16, torch.bfloat16, False),
         (16, 20000, False, torch.float32, torch.float32, True), (8, 65536, True, torch.bfloat16, torch.bfloat16, False)]


def _case_id(case):
    m, n, rms, dtype, wdtype, residual = case
    return f"{'rms' if rms else 'ln'}-{m}x{n}-{str(dtype)[6:]}-w{str(wdtype)[6:]}{'-residual' if residual else ''}"


def _norm_call(n: int, rms: bool):
    """norm(x, residual or None, weight, bias) -> the functional call's outputs as a tuple."""
    import shardnorm

    def norm(x, r, w, b):
        if r is None:
            return (shardnorm.rms_norm(x, n, w, 1e-5) if rms else shardnorm.layer_norm(x, n, w, b, 1e-5)),
        return shardnorm.add_rms_norm(x, r, n, w, 1e-5) if rms else shardnorm.add_layer_norm(x, r, n, w, b, 1e-5)
    return norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor launches the kernels on a GPU")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_compiled_norm_is_inductors_launch_of_the_eager_kernels(case, monkeypatch):
    """torch.compile(fullgraph=True) of a norm, forward and backward: outputs and grads bitwise the eager call's (the
    same kernels, configs and grids), and rows that fit the portable kernels (N <= 8192) run no launcher of
    shardnorm's per compiled call (Inductor launches the kernels; long rows on Hopper keep the staged kernels
    behind an opaque op). Inductor's analysis of the kernels reports no failure (it would copy every input)."""
    m, n, rms, dtype, wdtype, residual = case
    torch.manual_seed(n)
    leaf = lambda *shape, dt: torch.randn(*shape, device="cuda", dtype=dt).requires_grad_()  # noqa: E731
    x, r = leaf(m, n, dt=dtype), leaf(m, n, dt=dtype) if residual else None
    w, b = leaf(n, dt=wdtype), None if rms else leaf(n, dt=wdtype)
    inputs = [t for t in (x, r, w, b) if t is not None]
    norm = _norm_call(n, rms)

    def run(fn):
        outs = fn(x, r, w, b)
        grads = torch.autograd.grad(outs, inputs, [torch.ones_like(o).normal_(generator=gen) for o in outs])
        return [o.detach() for o in outs] + list(grads)

    failures = []
    handler = logging.Handler()
    handler.emit = lambda record: failures.append(record.getMessage())
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(handler)
    try:
        gen = torch.Generator("cuda").manual_seed(1)
        eager = run(norm)
        torch._dynamo.reset()
        compiled = torch.compile(norm, fullgraph=True, dynamic=False)
        run(compiled)  # compiles
        calls = []
        for module, plan in (("norm_fwd", "_FwdPlan"), ("norm_bwd", "_BwdPlan")):
            cls = getattr(importlib.import_module(f"shardnorm.kernels.{module}"), plan)
            monkeypatch.setattr(cls, "__call__", lambda self, *a, call=cls.__call__: calls.append(self) or call(self, *a))
        gen = torch.Generator("cuda").manual_seed(1)
        got = run(compiled)
        torch._dynamo.reset()
    finally:
        logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").removeHandler(handler)
    assert not [f for f in failures if "assuming every input" in f], failures
    if n <= 8192:
        assert not calls, f"{len(calls)} launcher calls of shardnorm's in a compiled call"
    names = ["y", "z", "dx", "dresidual", "dweight", "dbias"] if residual else ["y", "dx", "dweight", "dbias"]
    unequal = [name for name, a, e in zip(names, got, eager) if not torch.equal(a, e)]
    assert not unequal, f"compiled differs from eager in {unequal}"


def test_traced_grids_add_no_guard_on_the_row_count():
    """The grids, partial-sum rows and the direct-grads choice of every forward and backward plan, computed from a
    symbolic row count as the traced bodies compute them, add no guard on it: each would recompile a dynamic-shape
    graph at its threshold, and fail one whose row count the user marked dynamic (config.GUARD_FREE)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fwd = importlib.import_module("shardnorm.kernels.norm_fwd")
    bwd = importlib.import_module("shardnorm.kernels.norm_bwd")
    cpu = torch.device("cpu")
    for n in (64, 1024, 5120, 8192, 16384, 20000, 40000):
        env = ShapeEnv()
        m = env.create_symintnode(env.create_symbol(300, ConstantSource("m")), hint=300)
        for wsize, bias, rms in itertools.product((2, 4), (False, True), (False, True)):
            fwd._FwdPlan(n, wsize, True, bias, False, rms, False, cpu)._programs(m)
            wdtype = torch.bfloat16 if wsize == 2 else torch.float32
            plan = bwd._BwdPlan(n, wdtype, bias, False, rms, False, cpu, "")
            partial_rows, dx_tiles, direct = plan._grid(m)
            assert direct is False
        assert not env.guards, f"N = {n}: guards on the row count {[str(g.expr) for g in env.guards]}"


# (N, RMSNorm, x dtype, residual): the one-pass backward with direct dgamma at small M and partial sums at larger M
# (1024), a tail tile (5120), the split backward or on Hopper the staged one behind the opaque op (20000)
DYNAMIC_CASES = [(1024, True, torch.bfloat16, False), (1024, False, torch.float32, True),
                 (5120, True, torch.bfloat16, True), (20000, False, torch.bfloat16, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor launches the kernels on a GPU")
@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=lambda c: f"{'rms' if c[1] else 'ln'}-{c[0]}-{str(c[2])[6:]}"
                         f"{'-residual' if c[3] else ''}")
def test_compiled_norm_with_dynamic_rows(case):
    """The row count marked dynamic (`torch._dynamo.mark_dynamic`, what automatic dynamic shapes do after a second
    sequence length): the traced bodies' grids, buffers and launch arguments are symbolic in it. The first graph
    serves every row count of more than one row block (no guard on the regimes of the grids and of direct dgamma:
    config.GUARD_FREE); a single row block compiles one more (a partial-sum buffer of one row: Inductor guards on a
    size of 1). Outputs and grads are the eager call's bitwise, except dgamma/dbeta where the eager call writes them
    from one program (M x N <= config.DIRECT_GRADS_MAX_ELEMENTS) and the compiled one sums partial rows: there within
    fp32 rounding."""
    from conftest import rel_err
    from shardnorm.kernels import config

    n, rms, dtype, residual = case
    torch.manual_seed(n)
    norm = _norm_call(n, rms)

    w = torch.randn(n, device="cuda").requires_grad_()
    b = None if rms else torch.randn(n, device="cuda").requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    names = ["y", "z", "dx", "dresidual", "dweight", "dbias"] if residual else ["y", "dx", "dweight", "dbias"]
    try:
        for m in (37, 64, 300, 1000, 2):  # partial dgamma in eager; 2 rows: direct in eager, one row block
            x = torch.randn(m, n, device="cuda", dtype=dtype).requires_grad_()
            r = torch.randn(m, n, device="cuda", dtype=dtype).requires_grad_() if residual else None
            for t in (x, r):
                if t is not None:
                    torch._dynamo.mark_dynamic(t, 0)
            inputs = [t for t in (x, r, w, b) if t is not None]
            results = []
            for fn in (norm, compiled):
                outs = fn(x, r, w, b)
                gen = torch.Generator("cuda").manual_seed(m)
                grads = torch.autograd.grad(outs, inputs, [torch.randn(o.shape, device="cuda", dtype=o.dtype,
                                                                       generator=gen) for o in outs])
                results.append([o.detach() for o in outs] + list(grads))
            if m == 1000:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
                assert graphs == 1, f"{graphs} graphs compiled for row counts 37-1000"
            direct = m * n <= config.DIRECT_GRADS_MAX_ELEMENTS and n <= 8192
            for name, e, c in zip(names, *results):
                if direct and name in ("dweight", "dbias"):
                    assert rel_err(c, e) < 1e-6, f"M = {m}: compiled {name} off by {rel_err(c, e)}"
                else:
                    assert torch.equal(e, c), f"M = {m}: compiled {name} differs from eager"
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
    finally:
        torch._dynamo.reset()
    assert graphs <= 2, f"{graphs} graphs compiled for 5 row counts"


if __name__ == "__main__":
    print(json.dumps(_analyse()))
