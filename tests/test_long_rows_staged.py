"""The staged long-row kernels (`kernels/norm_bwd_staged.py`, `kernels/norm_fwd_staged.py`, Gluon) against float64.

Gluon does not run under the interpreter: on CPU only the selection is checked (never staged there,
and the split backward and chunked forward, the same math in `tl`, are what runs); the kernels need a GPU.
"""

import sys

import pytest
import torch

from conftest import backend_device
from shardnorm import settings
from shardnorm.kernels import config, norm_fwd
from test_kernels import run_case

bwd_module = sys.modules["shardnorm.kernels.norm_bwd"]
fwd_module = sys.modules["shardnorm.kernels.norm_fwd"]
CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="Gluon kernels do not run under the interpreter")
S = config.StagedConfig


@pytest.fixture
def force(monkeypatch):
    """force(cfg): every backward takes cfg (as the tile sweep did, `git show d7c3b12^:benchmarks/sweep_tiles.py`)."""
    def use(cfg):
        monkeypatch.setattr(config, "bwd_config", lambda *_: cfg)
        bwd_module._plan.cache_clear()
    yield use
    bwd_module._plan.cache_clear()


@pytest.fixture
def portable(monkeypatch):
    """portable(on): SHARDNORM_PORTABLE_KERNELS set (or unset) and the settings read again."""
    def use(on: bool):
        if on:
            monkeypatch.setenv("SHARDNORM_PORTABLE_KERNELS", "1")
        else:
            monkeypatch.delenv("SHARDNORM_PORTABLE_KERNELS", raising=False)
        settings.reload()
    yield use
    monkeypatch.delenv("SHARDNORM_PORTABLE_KERNELS", raising=False)
    settings.reload()


def _plan(n, rms, weight_dtype=torch.bfloat16, has_bias=True):
    device = backend_device("triton")
    return bwd_module._plan(n, weight_dtype, has_bias and not rms, False, rms, False, device,
                            config.specialized(device))


def assert_repeatable_and_replayable(run):
    """run() twice gives bitwise equal outputs, and so do three replays of a CUDA graph capturing it."""
    first, second = run(), run()
    for a, c in zip(first, second):
        assert a is None or torch.equal(a, c)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # the capture stream's own exchange words, allocated outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, c in zip(first, captured):
            assert a is None or torch.equal(a, c)


def test_selection():
    """Long rows take STAGED_BWD's entry where the staged kernels may run ("staged") and hold the row, else
    the split backward; short rows one pass either way."""
    assert config.bwd_config(14336, 2, 2, False, "staged") == config.STAGED_BWD[16384, 2, False]
    assert config.bwd_config(32768, 1, 2, True, "staged") == config.STAGED_BWD[32768, 2, True]
    assert config.bwd_config(40000, 2, 2, False, "staged").slice_n == 16384
    split = config.BWD_SPLIT
    assert config.bwd_config(32768, 2, 4, False, "staged") == config.STAGED_BWD[32768, 4, False]  # fp32 weight
    assert config.bwd_config(32768, 2, 2, False, "") == split  # portable
    assert config.bwd_config(20000, 0, 2, False, "staged") == split  # no parameter grads: nothing to write
    assert config.bwd_config(16384 - 8, 2, 2, False, "staged") == split  # N not a multiple of 16
    assert config.bwd_config(131072, 2, 2, False, "staged") == split  # not in the table
    assert config.bwd_config(4096, 2, 2, False, "staged") == config.bwd_config(4096, 2, 2, False, "")
    assert config.specialized(torch.device("cpu")) == ""


def test_family_table_and_portable_switch(monkeypatch, portable):
    """One lookup: a Hopper device takes SPECIALIZED's kernels unless SHARDNORM_PORTABLE_KERNELS=1; other
    families and CPU tensors the portable ones; a bad value is refused by name."""
    monkeypatch.setattr(config.torch.cuda, "get_device_capability", lambda device: capability)
    config._family_kernels.cache_clear()
    try:
        for capability, expected in (((9, 0), "staged"), ((8, 0), ""), ((10, 0), "")):
            config._family_kernels.cache_clear()
            portable(False)
            assert config.specialized(torch.device("cuda", 0)) == expected
            portable(True)
            assert config.specialized(torch.device("cuda", 0)) == ""
    finally:
        config._family_kernels.cache_clear()
    monkeypatch.setenv("SHARDNORM_PORTABLE_KERNELS", "maybe")
    with pytest.raises(ValueError, match="SHARDNORM_PORTABLE_KERNELS"):
        settings.reload()


@needs_gpu
@pytest.mark.parametrize("n,rms", [(14336, False), (16384, False), (32768, False), (65536, False), (20000, False),
                                   (32768, True), (65536, True), (40000, True)])
def test_table_entries(triton_backend, n, rms):
    """As users get it: the measured rows (and rows that round up to them: 20000, 40000, a partial last
    slice) take the staged backward, against float64."""
    bwd_module._plan.cache_clear()
    assert isinstance(_plan(n, rms).cfg, S)
    run_case(backend_device("triton"), n, rms, torch.bfloat16, rows=301, weight_dtype=torch.bfloat16)
    bwd_module._plan.cache_clear()


def test_stageable_calls():
    """What a call must be for the staged backward's 16-byte copies; anything else goes to the portable plan."""
    rows = torch.randn(4, 16384 + 8, dtype=torch.bfloat16)
    x, dy, w = rows[:, :16384], torch.randn(4, 16384, dtype=torch.bfloat16), torch.randn(16384, dtype=torch.bfloat16)
    stageable = bwd_module._stageable
    assert x.stride()[0] % 16 == 8 and not stageable(x, dy, w)  # rows 8 elements apart: not 16-byte multiples
    x = torch.randn(4, 16384, dtype=torch.bfloat16)
    assert stageable(x, dy, w) and stageable(x, dy, None)
    assert not stageable(x.float(), dy, w) and not stageable(x, dy.float(), w)  # 4-byte rows
    assert not stageable(torch.randn(4 * 16384 + 1, dtype=torch.bfloat16)[1:].view(4, 16384), dy, w)  # misaligned
    assert not stageable(x, dy, torch.randn(16385, dtype=torch.bfloat16)[1:])  # misaligned weight


CASES = {"bf16_weight": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16),
         "fp32_weight": dict(dtype=torch.bfloat16),
         "residual_zero_centered": dict(dtype=torch.bfloat16, residual_dtype=torch.bfloat16, zero_centered=True),
         "fp16_no_bias": dict(dtype=torch.float16, weight_dtype=torch.float16, bias=False),
         "fp32_rows": dict(dtype=torch.float32),  # 4-byte rows: the plan hands them to the split backward
         "misaligned": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16, offset=1)}  # ditto: x not 16-byte aligned


@needs_gpu
@pytest.mark.parametrize("n", [9000, 14336, 16384 - 5, 20000, 32768])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 301])
def test_matches_float64(triton_backend, n, rms, case, rows):
    """As users get it: fewer rows than programs (1) and several rows per program (301, no multiple of the SM
    count), partial last chunks (14336, 20000); N that is no multiple of 16 (9000, 16379) and the cases the
    plan hands on go through the split backward."""
    bwd_module._plan.cache_clear()
    kw = dict(CASES[case])
    run_case(backend_device("triton"), n, rms, kw.pop("dtype"), rows=rows, **kw)
    bwd_module._plan.cache_clear()


@needs_gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_bitwise_deterministic(rms):
    bwd_module._plan.cache_clear()
    n = 20480 if rms else 16384  # long rows for each (RMSNorm's one pass goes to 16384)
    x = torch.randn(2048, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn_like(w)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-5, rms, False)
    dy = torch.randn_like(x)
    run = lambda: bwd_module.norm_bwd(dy, None, x, w, mean, rstd, b is not None, rms, False)  # noqa: E731
    assert isinstance(_plan(n, rms).cfg, S)
    for a, c in zip(run(), run()):
        assert a is None or torch.equal(a, c)
    bwd_module._plan.cache_clear()


# the staged candidates benchmarks/gpu_longrow.py timed (removed in d7c3b12:
# `git show d7c3b12^:benchmarks/gpu_longrow.py`)
SLICED = {"slices_16384": S(32, slice_n=16384), "slices_8192": S(32, slice_n=8192),
          "slices_16384_lead": S(32, slice_n=16384, slots=3), "slices_16384_w16": S(16, slice_n=16384),
          "slices_16384_w16_lead": S(16, slice_n=16384, slots=3)}
SLICED_SHAPES = [(14336, 301), (16384, 301), (32768, 1), (40000, 301), (65536, 77)]
SLICED_CASES = [(name, n, rows) for name in SLICED for n, rows in SLICED_SHAPES
                if name in ("slices_16384", "slices_16384_w16_lead")
                or (n, rows) in ((16384, 301), (40000, 301), (65536, 77))]


@needs_gpu
@pytest.mark.parametrize("name,n,rows", SLICED_CASES)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", ["bf16_weight", "residual_zero_centered", "fp16_no_bias"])
def test_sliced_rows_match_float64(triton_backend, force, name, n, rows, rms, case):
    """Rows split over 1-8 staged programs meeting through the exchange (one slice: whole rows in two or three
    slots, no exchange): a partial last slice (40000), fewer rows than groups (1), several rounds of the
    exchange ring (301, 77), rows published one ahead (three slots)."""
    force(SLICED[name])
    kw = dict(CASES[case])
    run_case(backend_device("triton"), n, rms, kw.pop("dtype"), rows=rows, **kw)


@needs_gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("name", ["slices_16384", "slices_16384_w16_lead"])
def test_sliced_deterministic_and_graph_replay(monkeypatch, force, rms, name):
    """Bitwise repeatable, also from CUDA graph replays (the last slice out zeroes the exchange in-kernel, so
    the next launch starts from tags that match no row)."""
    from shardnorm.kernels import norm_bwd_staged

    exchanges = []
    original = norm_bwd_staged.exchange_words
    monkeypatch.setattr(norm_bwd_staged, "exchange_words", lambda *a: exchanges.append(original(*a)) or exchanges[-1])
    force(SLICED[name])
    x = torch.randn(1000, 65536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(65536, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn_like(w)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-5, rms, False)
    dy = torch.randn_like(x)
    assert _plan(65536, rms).cfg == SLICED[name]
    assert_repeatable_and_replayable(lambda: bwd_module.norm_bwd(dy, None, x, w, mean, rstd, b is not None, rms, False))
    torch.cuda.synchronize()
    assert exchanges and all(int(words.abs().sum()) == 0 for words in exchanges)


@pytest.mark.parametrize("n,rms", [(16384, False), (65536, False), (65536, True)])
def test_zero_rows(triton_backend, n, rms):
    """No rows: zero dgamma/dbeta and an empty dx, whichever long-row path the table picks (the staged kernels
    hand M = 0 to the plan without them: the three-slot one takes its first row's sums before its loop)."""
    bwd_module._plan.cache_clear()
    device = backend_device("triton")
    x = torch.randn(0, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = None if rms else torch.randn_like(w)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-5, rms, False)
    dx, dw, db = bwd_module.norm_bwd(torch.randn_like(x), None, x, w, mean, rstd, b is not None, rms, False)
    bwd_module._plan.cache_clear()
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))
    assert db is None if rms else torch.equal(db, torch.zeros_like(b))


# ---- the staged forward (`kernels/norm_fwd_staged.py`) ----

FWD_CASES = {"bf16_weight": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16),
             "fp32_weight": dict(dtype=torch.bfloat16),
             "zero_centered": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16, zero_centered=True),
             "fp16_no_bias": dict(dtype=torch.float16, weight_dtype=torch.float16, bias=False),
             "affine_off": dict(dtype=torch.bfloat16, affine=False),
             # handed to the chunked forward: a residual, x not 16-byte aligned, 4-byte x
             "residual": dict(dtype=torch.bfloat16, residual_dtype=torch.bfloat16),
             "misaligned": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16, offset=1),
             "fp32_rows": dict(dtype=torch.float32)}


def test_forward_parameter_chunks():
    """How many chunks' parameters the staged forward holds in shared memory beside a row (227 KB, 1 KB of
    scratch): all fit for a 40000-column row, 3 of 8 at 65536 (6 without a bias, 1 with fp32 ones)."""
    from shardnorm.kernels.norm_fwd_staged import SCRATCH_BYTES, SMEM_BYTES, param_chunks

    chunk = config.STAGED_FWD.chunk  # 8192
    assert param_chunks(65536, chunk, 2, 2, 2) == 3 and param_chunks(65536, chunk, 2, 2, 1) == 6
    assert param_chunks(65536, chunk, 2, 4, 2) == 1 and param_chunks(65536, chunk, 2, 2, 0) == 0
    assert param_chunks(40000, chunk, 2, 2, 2) == 4 and param_chunks(32784, chunk, 2, 2, 1) == 5
    for n in (32784, 40000, 65536, 98304, 114688):
        for size, params in ((2, 1), (2, 2), (4, 2)):
            chunks = -(-n // chunk)
            held = param_chunks(n, chunk, 2, size, params)
            assert 0 <= held <= chunks
            assert chunks * chunk * 2 + held * chunk * size * params <= SMEM_BYTES - SCRATCH_BYTES


def test_forward_parameters_that_cannot_be_staged():
    """The staged forward copies its parameters 16 bytes at a time and sizes them by the weight's width."""
    stageable = fwd_module._stageable_params
    w = torch.randn(65536, dtype=torch.bfloat16)
    assert stageable(w, torch.randn_like(w)) and stageable(None, w) and stageable(w, None) and stageable(None, None)
    assert not stageable(torch.randn(65537, dtype=torch.bfloat16)[1:], None)  # 2 bytes off
    assert not stageable(w, torch.randn(65537, dtype=torch.bfloat16)[1:])
    assert not stageable(w, torch.randn(65536))  # a bias twice the weight's width


@needs_gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_with_unstageable_parameters(triton_backend, rms):
    """A weight 2 bytes off 16-byte alignment, or a bias wider than the weight: the chunked forward, the same
    result as the staged one to a rounding step."""
    fwd_module._plan.cache_clear()
    x = torch.randn(300, 65536, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w = torch.randn(65536, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn_like(w)
    y, _, _, rstd = fwd_module.norm_fwd(x, w, b, None, 1e-5, rms, False)
    w_off = torch.empty(65537, device="cuda", dtype=torch.bfloat16)[1:].copy_(w)
    for weight, bias in [(w_off, b)] + ([] if rms else [(w, b.float())]):
        y2, _, _, rstd2 = fwd_module.norm_fwd(x, weight, bias, None, 1e-5, rms, False)
        torch.testing.assert_close(rstd2, rstd, rtol=1e-5, atol=0)
        torch.testing.assert_close(y2.float(), y.float(), rtol=1e-2, atol=1e-2)
    fwd_module._plan.cache_clear()


def test_forward_never_staged_on_cpu():
    cpu = torch.device("cpu")
    fwd_module._plan.cache_clear()
    assert fwd_module._plan(65536, 2, True, True, False, False, False, cpu, config.specialized(cpu)).staged is None
    fwd_module._plan.cache_clear()


@needs_gpu
@pytest.mark.parametrize("n,rows", [(32768 + 16, 1), (40000, 301), (65536, 301), (65536 + 8, 3)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", FWD_CASES)
def test_forward_matches_float64(triton_backend, n, rms, case, rows):
    """Rows above 32768 columns (N % 16 == 0 staged, 65544 not), fewer rows than programs and several
    rows per program; outputs and grads against float64."""
    fwd_module._plan.cache_clear()
    kw = dict(FWD_CASES[case])
    cuda = torch.device("cuda")
    staged = fwd_module._plan(n, 2, True, not rms, False, rms, False, cuda, config.specialized(cuda)).staged
    assert (staged is not None) == (n % 16 == 0)
    run_case(backend_device("triton"), n, rms, kw.pop("dtype"), rows=rows, **kw)
    fwd_module._plan.cache_clear()


@needs_gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_forward_portable_switch_and_agreement(portable, rms):
    """SHARDNORM_PORTABLE_KERNELS=1 keeps the chunked `tl` forward; both give the same statistics to fp32
    rounding."""
    x = torch.randn(257, 65536, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w = torch.randn(65536, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn_like(w)
    outs = {}
    for mode in ("staged", "chunked"):
        portable(mode == "chunked")
        fwd_module._plan.cache_clear()
        kernels = config.specialized(x.device)
        assert (kernels == "staged") == (mode == "staged")
        assert (fwd_module._plan(65536, 2, True, b is not None, False, rms, False, x.device, kernels).staged is None) \
            == (mode == "chunked")
        outs[mode] = fwd_module.norm_fwd(x, w, b, None, 1e-5, rms, False)
    fwd_module._plan.cache_clear()
    (y1, _, m1, r1), (y2, _, m2, r2) = outs["staged"], outs["chunked"]
    torch.testing.assert_close(r1, r2, rtol=1e-5, atol=0)
    if not rms:
        torch.testing.assert_close(m1, m2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y1.float(), y2.float(), rtol=1e-2, atol=1e-2)  # a bf16 rounding step apart at most


@needs_gpu
@pytest.mark.parametrize("offset,first_chunk", [(0.0, 0.0), (1000.0, 0.0), (0.0, 40.0)])
def test_forward_statistics_far_from_zero(offset, first_chunk):
    """The LayerNorm statistics (one pass, shifted by the first chunk's mean) keep the variance of rows whose
    mean is far from zero against their spread, and of rows whose first chunk sits far from the rest (the
    shift's worst case): mean, rstd and y against float64."""
    fwd_module._plan.cache_clear()
    x = torch.randn(300, 65536, device="cuda", dtype=torch.float32) * 8 + offset
    x[:, :config.STAGED_FWD.chunk] += first_chunk * 8
    x = x.to(torch.bfloat16)
    w = torch.randn(65536, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(w)
    assert fwd_module._plan(65536, 2, True, True, False, False, False, x.device, "staged").staged is not None
    y, _, mean, rstd = fwd_module.norm_fwd(x, w, b, None, 1e-5, False, False)
    fwd_module._plan.cache_clear()
    x64 = x.double()
    mean64 = x64.mean(1)
    rstd64 = (x64.var(1, unbiased=False) + 1e-5).rsqrt()
    y64 = (x64 - mean64[:, None]) * rstd64[:, None] * w.double() + b.double()
    torch.testing.assert_close(mean.double(), mean64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-4, atol=0)
    assert ((y.double() - y64).norm() / y64.norm()).item() < 1e-2  # bf16 output
