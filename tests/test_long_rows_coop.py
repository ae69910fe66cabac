"""The cooperative long-row backward (`kernels/norm_bwd_coop.py`) against float64.

Its programs wait for each other, so the interpreter (one program after another) can only run
single-slice grids (C = 1: each program waits on itself): those check the exchange, the row-group
walk, the lookahead and the counter reset on CPU. Several slices need a GPU.
"""

import sys

import pytest
import torch

from conftest import backend_device
from shardnorm.kernels import config, norm_fwd
from test_kernels import run_case

bwd_module = sys.modules["shardnorm.kernels.norm_bwd"]
CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="slices wait on each other: the interpreter runs programs in turn")
C = config.CoopBwdConfig
# Candidates benchmarks/gpu_longrow.py measures: slice columns x rows per exchange, warps, programs per SM
# (2 per SM only where a local sm_90 compile leaves room for two: 128 registers at 8 warps).
GPU_CONFIGS = {"4096x1": C(4096, 1, 16), "4096x1_wait_first": C(4096, 1, 16, lookahead=0),
               "4096x1_publish_ahead": C(4096, 1, 16, lookahead=1),
               "4096x1_plain_launch": C(4096, 1, 16, cooperative=False),
               "2048x1_2_per_sm": C(2048, 1, 8, programs_per_sm=2), "2048x2": C(2048, 2, 8), "8192x1": C(8192, 1, 32),
               "8192x1_w16": C(8192, 1, 16)}


@pytest.fixture
def force(monkeypatch):
    """force(cfg): every backward takes cfg (as benchmarks/sweep_tiles.py swaps configs)."""
    def use(cfg):
        monkeypatch.setattr(config, "bwd_config", lambda *_: cfg)
        bwd_module._plan.cache_clear()
    yield use
    bwd_module._plan.cache_clear()


@pytest.fixture(autouse=True)
def workspaces(monkeypatch):
    """The (exchange, counters) workspaces the test's launches used."""
    used = []
    original = bwd_module.workspace

    def tracked(*args):
        used.append(original(*args))
        return used[-1]

    monkeypatch.setattr(bwd_module, "workspace", tracked)
    return used


def _counters_zero(workspaces) -> bool:
    """Some launch ran the cooperative kernel, and it left every counter zero (it resets them itself)."""
    return bool(workspaces) and all(int(counters.abs().sum()) == 0 for _, counters in workspaces)


def _plan_kind(n, rms, weight_dtype=torch.float32, has_bias=True) -> type:
    device = _device()
    plan = bwd_module._plan(n, weight_dtype, has_bias and not rms, False, rms, False, device, False,
                            config.coop_mode(device))
    return type(plan.cfg)


def _device():
    return backend_device("triton")


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("lookahead", [0, 1, 2], ids=["wait_first", "publish_ahead", "prefetch"])
@pytest.mark.parametrize("rows,block_m", [(1, 1), (7, 2), (2 * config.INTERPRETER_SM_COUNT + 3, 1)])
def test_single_slice(monkeypatch, force, workspaces, rms, lookahead, rows, block_m):
    """One slice (N <= SLICE_N) on either backend: more row blocks than groups, a partial last block,
    one row; with a residual grad and zero-centered gamma; counters back to zero afterwards."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "triton")
    force(C(slice_n=256, block_m=block_m, num_warps=4, lookahead=lookahead))
    assert _plan_kind(200, rms) is C
    run_case(_device(), 200, rms, torch.float32, rows=rows)
    run_case(_device(), 200, rms, torch.bfloat16, rows=rows, weight_dtype=torch.bfloat16,
             residual_dtype=torch.bfloat16, zero_centered=True)
    assert _counters_zero(workspaces)


def test_interpreter_never_runs_several_slices(monkeypatch, force):
    """Under the interpreter a grid of several slices would hang: the plan falls back to the split backward."""
    if CUDA:
        pytest.skip("the interpreter runs only without a GPU here")
    monkeypatch.setenv("SHARDNORM_BACKEND", "triton")
    force(C(slice_n=64, block_m=1, num_warps=4))
    assert _plan_kind(200, False) is config.SplitBwdConfig
    assert config.coop_mode(torch.device("cpu")) == ""
    run_case(_device(), 200, False, torch.float32, rows=3)


def test_table_and_forced_selection(monkeypatch):
    """Long rows take the cooperative backward only where the table (filled from GPU measurements)
    says so, or everywhere when forced; never on a device that cannot run it."""
    for n, parts, rms in ((16384 + 1, 2, False), (32768, 1, True), (65536, 2, False), (65536, 1, True)):
        key = (config.next_pow2(n), 2, rms)
        assert config.bwd_config(n, parts, 2, rms, False, "table") == config.STAGED_BWD.get(
            key, config.COOP_BWD.get(key, config.BWD_SPLIT))
        assert config.bwd_config(n, parts, 2, rms, False, "coop-table") == config.COOP_BWD.get(key, config.BWD_SPLIT)
        assert config.bwd_config(n, parts, 2, rms, False, "force") == config.COOP_BWD_DEFAULT
        assert config.bwd_config(n, parts, 2, rms, False, "") == config.BWD_SPLIT
    assert config.bwd_config(4096, 2, 2, False, False, "force") == config.bwd_config(4096, 2, 2, False, False, "")
    monkeypatch.setenv("SHARDNORM_LONG_BWD", "coop")
    assert config.coop_mode(torch.device("cpu")) == ""


@needs_gpu
@pytest.mark.parametrize("key", sorted(config.COOP_BWD), ids=lambda k: f"{'rms' if k[2] else 'ln'}_{k[0]}_w{k[1]}")
def test_table_entries(monkeypatch, workspaces, key):
    """Each measured table entry, as users get it (not forced): at a non-power-of-two N of its row size,
    more row blocks than groups, against float64."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "triton")
    monkeypatch.delenv("SHARDNORM_LONG_BWD", raising=False)
    n_pow2, weight_bytes, rms = key
    n = n_pow2 - 5
    weight_dtype = torch.float32 if weight_bytes == 4 else torch.bfloat16
    assert _plan_kind(n, rms, weight_dtype, not rms) is C
    run_case(_device(), n, rms, torch.bfloat16, rows=301, weight_dtype=weight_dtype)
    assert _counters_zero(workspaces)


CASES = {"fp32": dict(dtype=torch.float32), "bf16_weight": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16),
         "residual_zero_centered": dict(dtype=torch.bfloat16, residual_dtype=torch.bfloat16, zero_centered=True),
         "fp16_no_bias": dict(dtype=torch.float16, weight_dtype=torch.float16, bias=False),
         "affine_off": dict(dtype=torch.bfloat16, affine=False)}


@needs_gpu
@pytest.mark.parametrize("n", [14336, 20000, 32768, 65536 + 7])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 301])
def test_matches_float64(monkeypatch, workspaces, n, rms, case, rows):
    """The default candidate (SHARDNORM_LONG_BWD=coop) on 2-9 slices: M = 1 (fewer rows than programs)
    and more row blocks than groups with a partial last round (301 is no multiple of G)."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "triton")
    monkeypatch.setenv("SHARDNORM_LONG_BWD", "coop")
    kw = dict(CASES[case])
    affine = kw.get("affine", True)
    weight_dtype = kw.get("weight_dtype", torch.float32) if affine else None
    has_bias = affine and kw.get("bias", True) and not rms
    long = n > config.MAX_FUSED_N_BWD[int(affine) + int(has_bias)]
    assert (_plan_kind(n, rms, weight_dtype, has_bias) is C) == long
    run_case(_device(), n, rms, kw.pop("dtype"), rows=rows, **kw)
    assert _counters_zero(workspaces) == long


@needs_gpu
@pytest.mark.parametrize("name", GPU_CONFIGS)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_candidates(monkeypatch, force, workspaces, name, rms):
    """Every candidate the benchmark times, at a long row with a partial slice and many row rounds."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "triton")
    force(GPU_CONFIGS[name])
    run_case(_device(), 40000, rms, torch.bfloat16, rows=1000, weight_dtype=torch.bfloat16)
    run_case(_device(), 40000, rms, torch.float32, rows=3)
    assert _counters_zero(workspaces)


def _bwd_inputs(m, n, rms):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-5, rms, False)
    return torch.randn_like(x), x, w, b, mean, rstd


@needs_gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_bitwise_deterministic_and_graph_replay(monkeypatch, rms):
    """Two runs agree bit for bit; so do CUDA graph replays (the counters reset themselves in-kernel,
    so a replay starts from zeros without a host-side epoch)."""
    monkeypatch.setenv("SHARDNORM_LONG_BWD", "coop")
    bwd_module._plan.cache_clear()
    dy, x, w, b, mean, rstd = _bwd_inputs(2048, 32768, rms)
    assert_repeatable_and_replayable(lambda: bwd_module.norm_bwd(dy, None, x, w, mean, rstd, b is not None, rms, False))
    bwd_module._plan.cache_clear()


def assert_repeatable_and_replayable(run):
    """run() twice gives bitwise equal outputs, and so do three replays of a CUDA graph capturing it."""
    first, second = run(), run()
    for a, c in zip(first, second):
        assert a is None or torch.equal(a, c)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # the capture stream's own workspace, allocated outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, c in zip(first, captured):
            assert a is None or torch.equal(a, c)


@needs_gpu
def test_grid_larger_than_resident_is_refused(monkeypatch, force):
    """More programs per SM than fit: the cooperative launch raises instead of hanging."""
    force(C(slice_n=16384, block_m=1, num_warps=32, programs_per_sm=8))  # <= 2 per SM fit
    dy, x, w, b, mean, rstd = _bwd_inputs(4096, 65536, True)
    with pytest.raises(Exception):
        bwd_module.norm_bwd(dy, None, x, w, mean, rstd, False, True, False)
        torch.cuda.synchronize()
