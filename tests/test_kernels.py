"""Numerics of the norm family against a float64 reference, on both backends.

Fresh random data on every run (the seed is in the failure message). Tolerances: outputs stored in
low precision are held to about one rounding of that dtype; dgamma/dbeta are accumulated in fp32
partial sums, so with fp32 weights they are held to 1e-5 whatever the activation dtype.
"""

import math
import random

import pytest
import torch

import shardnorm
from conftest import reference_norm, rel_err
from shardnorm.kernels import config

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
# Rows longer than one program's registers hold: the backward's (20000) and the forward's (40000). They take
# the chunked forward and the split backward (portable), or on Hopper the staged kernels for the calls those
# take (tests/test_long_rows_staged.py); `test_long_rows` runs them.
LONG = config.MAX_FUSED_N_FWD + 7232
HIDDEN = (1, 7, 127, 1000, 4096, 5120, 20000, LONG)


def _seeded():
    seed = random.getrandbits(31)
    torch.manual_seed(seed)
    return seed


def run_case(device, n, rms, dtype, *, rows=6, weight_dtype=torch.float32, bias=True, affine=True, weight=True,
             residual_dtype=None, zero_centered=False, eps=1e-5, lead_shape=None, offset=0):
    """Run one case through the public functional API and compare every output and grad.
    offset: x starts that many elements into its buffer (1: not 16-byte aligned); weight=False: a bias
    without a weight (LayerNorm)."""
    seed = _seeded()
    shape = (*(lead_shape or (rows,)), n)
    leaf = lambda t: t.to(device).requires_grad_()  # noqa: E731
    x_buffer = (torch.randn(math.prod(shape) + offset) * 2 + 0.5).to(dtype).to(device)
    x = x_buffer[offset:].view(shape).requires_grad_()
    weight = leaf(torch.randn(n).to(weight_dtype)) if affine and weight else None
    b = leaf(torch.randn(n).to(weight_dtype)) if affine and bias and not rms else None
    res = leaf(torch.randn(shape).to(residual_dtype)) if residual_dtype else None
    kw = dict(zero_centered_gamma=zero_centered)
    if res is None:
        y = (shardnorm.rms_norm(x, n, weight, eps, **kw) if rms else shardnorm.layer_norm(x, n, weight, b, eps, **kw))
        z = None
    elif rms:
        y, z = shardnorm.add_rms_norm(x, res, n, weight, eps, **kw)
    else:
        y, z = shardnorm.add_layer_norm(x, res, n, weight, b, eps, **kw)
    dy = torch.randn_like(y)
    dz = torch.randn_like(z) if z is not None else None
    torch.autograd.backward([y] + ([z] if z is not None else []), [dy] + ([dz] if dz is not None else []))

    ref_leaf = lambda t: t.detach().cpu().double().requires_grad_() if t is not None else None  # noqa: E731
    # With a residual the op normalizes z = x + residual as rounded to z's dtype: check z against the
    # exact sum, then everything else against the norm of that z (dz flows straight to x and residual).
    xr, wr, br = ref_leaf(x), ref_leaf(weight), ref_leaf(b)
    src = ref_leaf(z) if z is not None else xr
    yr = reference_norm(src, wr, br, None, eps, rms, zero_centered)
    yr.backward(dy.cpu().double())
    dx_ref = src.grad + dz.cpu().double() if z is not None else xr.grad

    ctx = f"seed={seed} n={n} rms={rms} dtype={dtype} weight={weight_dtype} offset={offset}"
    assert y.dtype == dtype and y.shape == x.shape, ctx
    checks = [("y", y, yr, TOL[dtype]), ("dx", x.grad, dx_ref, TOL[dtype])]
    if z is not None:
        exact_sum = x.detach().double() + res.detach().double()
        checks += [("z", z, exact_sum, TOL[z.dtype]), ("dresidual", res.grad, dx_ref, TOL[residual_dtype])]
    for name, actual, expected, tol in checks:
        err = rel_err(actual, expected)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol} ({ctx})"

    # dweight/dbias are sums over rows, whose terms can cancel to near zero (6 rows, random signs): their
    # error is judged against the sum of the terms' magnitudes, the scale a correct fp32 sum is accurate to.
    # A wrong grad still misses by about its own size: 1/sqrt(rows) of that scale, far above tol.
    dyd = dy.detach().cpu().double().reshape(-1, n)
    xhat = reference_norm(src.detach(), None, None, None, eps, rms).reshape(-1, n)
    sums = []
    if weight is not None:
        sums.append(("dweight", weight.grad, wr.grad, (dyd * xhat).abs().sum(0)))
    if b is not None:
        sums.append(("dbias", b.grad, br.grad, dyd.abs().sum(0)))
    for name, actual, expected, magnitude in sums:
        err = rel_err(actual.detach(), expected, scale=magnitude)
        tol = TOL[weight_dtype]
        assert err <= tol, f"{name}: error {err:.3g} of the terms' magnitude > {tol} ({ctx})"


@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_float64(backend, device, n, rms, dtype):
    # At N=1 the RMS gradient is 1 - xhat^2 ~ eps/x^2: ill-conditioned for a tiny eps in any fp32 code.
    run_case(device, n, rms, dtype, eps=1.0 if n == 1 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("eps", [1e-12, 1e-5])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_layer_norm_of_one_element(backend, device, dtype, eps, residual):
    """LayerNorm over N = 1: y is the bias whatever x is, so dx is exactly 0 (torch's result) and with a
    residual dx = dresidual = dz exactly; dgamma exactly 0. On a GPU the formula's w*dy - mean(w*dy) left
    w*dy's rounding error times rstd (up to 2.3 at eps = 1e-12) where the compiler fused the mean into an FMA."""
    seed = _seeded()
    rows = 300
    x = (torch.randn(rows, 1) * 3).to(dtype).to(device).requires_grad_()
    w = torch.randn(1, device=device, requires_grad=True)
    b = torch.randn(1, device=device, requires_grad=True)
    dy = (torch.randn(rows, 1) * 4).to(dtype).to(device)
    if residual:
        res = torch.randn(rows, 1).to(dtype).to(device).requires_grad_()
        y, z = shardnorm.add_layer_norm(x, res, 1, w, b, eps)
        dz = torch.randn(rows, 1).to(dtype).to(device)
        torch.autograd.backward([y, z], [dy, dz])
        assert torch.equal(x.grad, dz) and torch.equal(res.grad, dz), seed
    else:
        y = shardnorm.layer_norm(x, 1, w, b, eps)
        y.backward(dy)
        assert torch.equal(x.grad, torch.zeros_like(x)), f"max |dx| {x.grad.abs().max().item()} (seed={seed})"
    assert torch.equal(y, y[:1].expand(rows, 1)), seed  # the bias (rounded to y's dtype), whatever x is
    assert rel_err(y[0], b.detach()) <= TOL[dtype], seed
    assert torch.equal(w.grad, torch.zeros_like(w)), seed


VARIANTS = {
    "bf16_weight": dict(weight_dtype=torch.bfloat16),
    "fp16_weight": dict(dtype=torch.float16, weight_dtype=torch.float16),
    "no_bias": dict(bias=False),
    "affine_off": dict(affine=False),
    "residual": dict(residual_dtype=torch.bfloat16),
    "fp32_residual_stream": dict(residual_dtype=torch.float32),
    "zero_centered": dict(zero_centered=True),
    "residual_zero_centered_3d": dict(residual_dtype=torch.bfloat16, zero_centered=True, lead_shape=(2, 3, 5)),
    "3d": dict(lead_shape=(3, 4, 5)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", [1000, 5120, LONG], ids=["one_pass", "tail_tile", "long"])
def test_variants(backend, device, variant, rms, n):
    kw = dict(dtype=torch.bfloat16, rows=5) | VARIANTS[variant]
    run_case(device, n, rms, kw.pop("dtype"), **kw)


def test_strided_rows(backend, device):
    seed = _seeded()
    base = torch.randn(9, 300, device=device)
    x = base[::2, :257]  # row stride 600, last dim contiguous: passed as is
    w = torch.randn(257, device=device)
    y = shardnorm.layer_norm(x, (257,), w)
    assert rel_err(y, reference_norm(x.cpu(), w.cpu(), None, None, 1e-5, False)) < 1e-5, seed
    xt = torch.randn(4, 6, 33, device=device).transpose(0, 1)  # needs a copy
    assert rel_err(shardnorm.rms_norm(xt, 33), reference_norm(xt.cpu(), None, None, None, 1e-6, True)) < 1e-5
    wide = torch.randn(2 * 257, device=device, requires_grad=True)  # strided parameters: read as they are, not
    b = torch.randn(3 * 257, device=device)[::3]                     # as if contiguous; grads reach the base
    y = shardnorm.layer_norm(x, (257,), wide[::2], b)
    assert rel_err(y, reference_norm(x.cpu(), wide[::2].detach().cpu(), b.cpu(), None, 1e-5, False)) < 1e-5, seed
    y.sum().backward()
    assert wide.grad[1::2].abs().max() == 0 and wide.grad[::2].abs().max() > 0


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", [1024, LONG], ids=["one_pass", "long"])
def test_misaligned_after_aligned(backend, device, rms, n):
    """The same shapes, first 16-byte aligned, then offset by one element: on a GPU the second call
    must not reuse the kernel Triton compiled for aligned pointers (kernels/launch.py's cache)."""
    for offset in (0, 1, 0):
        run_case(device, n, rms, torch.bfloat16, rows=3, offset=offset)


@pytest.mark.parametrize("rms,n", [(False, 7000), (False, 12000), (True, 12000)])
def test_persistent_forward_walks_row_blocks(backend, device, rms, n):
    """fp32 parameters take persistent forward programs that keep them in registers: with more row
    blocks than programs, each program normalizes several."""
    cfg = config.fwd_config(n, 4, not rms)
    assert cfg.single_pass and cfg.programs_per_sm > 0
    programs = config.sm_count(torch.device(device)) * cfg.programs_per_sm
    run_case(device, n, rms, torch.bfloat16, rows=2 * programs * cfg.block_m + 3)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual_zero_centered"])
def test_backward_tail_tile(backend, device, residual):
    """RMSNorm with a bf16 weight at N = 5120 runs the backward as 4096 + 1024 tiles: with more row
    blocks than persistent programs, and with a residual (dz) and zero-centered gamma."""
    cfg = config.bwd_config(5120, 1, 2, True)
    assert cfg.tail_n and cfg.block_n + cfg.tail_n == 5120 and cfg.programs_per_sm
    rows = 2 * config.INTERPRETER_SM_COUNT * cfg.programs_per_sm + 3
    kw = dict(residual_dtype=torch.bfloat16, zero_centered=True) if residual else {}
    run_case(device, 5120, True, torch.bfloat16, rows=rows, weight_dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n,rows", [(1000, 301), (20000, 41)], ids=["one_pass", "long"])
def test_backward_is_bitwise_deterministic(backend, device, rms, n, rows):
    """Many persistent programs, each with its own partial row: repeated runs agree bit for bit."""
    if backend == "triton":
        cfg = config.bwd_config(n, 1 if rms else 2, 2, rms, config.specialized(torch.device(device)))
        assert config.partial_rows(cfg, rows, n, config.sm_count(torch.device(device))) > 1
    _seeded()
    x = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = None if rms else torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    results = []
    for _ in range(3):
        xg = x.clone().requires_grad_()
        y = shardnorm.rms_norm(xg, n, w) if rms else shardnorm.layer_norm(xg, n, w, b)
        params = [xg, w] + ([b] if b is not None else [])
        results.append(torch.autograd.grad(y, params, dy))
    for other in results[1:]:
        for g0, g1 in zip(results[0], other):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize("n", [20000, LONG])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", [dict(dtype=torch.float32), dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16),
                                  dict(dtype=torch.bfloat16, residual_dtype=torch.bfloat16, zero_centered=True),
                                  dict(dtype=torch.float16, bias=False)],
                         ids=["fp32", "bf16_weight", "residual_zero_centered", "fp16_no_bias"])
def test_long_rows(triton_backend, n, rms, case):
    """Rows too long for one program: the chunked forward (40000) and the split backward (both), or on Hopper
    the staged kernels where the table and the call allow."""
    device = triton_backend
    kw = dict(case)
    param_size = kw.get("weight_dtype", torch.float32).itemsize
    fwd = config.fwd_config(n, param_size, not rms and kw.get("bias", True))
    bwd = config.bwd_config(n, 1 if rms else 2, param_size, rms)
    assert (n < config.MAX_FUSED_N_FWD or not fwd.single_pass) and isinstance(bwd, config.SplitBwdConfig)
    run_case(device, n, rms, kw.pop("dtype"), rows=3, **kw)


SMALL_GRAD_CASES = {
    "fp32": dict(dtype=torch.float32),
    "bf16_weight": dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16),
    "fp16_no_bias": dict(dtype=torch.float16, bias=False),
    "bias_only": dict(dtype=torch.bfloat16, weight=False),
    "residual_zero_centered": dict(dtype=torch.bfloat16, residual_dtype=torch.bfloat16, zero_centered=True),
}


@pytest.mark.parametrize("case", SMALL_GRAD_CASES)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", [7, 1000, 4096, 4097, 5120])
def test_small_backward_grads(triton_backend, grads_path, case, rms, n):
    """dgamma/dbeta at 8 x 4096 elements or fewer (sizes where a call is bound by host time), both ways:
    one program storing them (`config.direct_grads`) and partial rows with the column sum; several row
    blocks per program where the tile allows."""
    kw = dict(SMALL_GRAD_CASES[case])
    if rms and not kw.get("weight", True):
        pytest.skip("RMSNorm has no bias")
    device = triton_backend
    rows = min(8, 8 * 4096 // n)
    has_bias = not rms and kw.get("bias", True)
    num_grads = kw.get("weight", True) + has_bias
    param_size = kw.get("weight_dtype", torch.float32).itemsize
    cfg = config.bwd_config(n, num_grads, param_size, rms)
    assert config.direct_grads(cfg, rows, n) == (grads_path == "direct")
    run_case(device, n, rms, kw.pop("dtype"), rows=rows, **kw)


def test_zero_rows(backend, device):
    x = torch.randn(0, 3, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    b = torch.randn(64, device=device, requires_grad=True)
    y = shardnorm.layer_norm(x, 64, w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_constant_row_finite_and_nan_propagates(backend, device, rms):
    x = torch.randn(3, 100, device=device)
    x[0] = 4.0
    x[1, 7] = float("nan")
    w, b = torch.randn(100, device=device), torch.randn(100, device=device)
    y = shardnorm.rms_norm(x, 100, w) if rms else shardnorm.layer_norm(x, 100, w, b)
    expected = (torch.nn.functional.rms_norm(x.cpu(), (100,), w.cpu(), 1e-6) if rms
                else torch.nn.functional.layer_norm(x.cpu(), (100,), w.cpu(), b.cpu()))
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    assert torch.isnan(y[1]).all() == torch.isnan(expected[1]).all()
    assert rel_err(y[[0, 2]], expected[[0, 2]]) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a tensor of more than 2^31 elements needs a GPU")
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_more_than_2_pow_31_elements(rms):
    """Offsets past 2^31 elements must not wrap: check the last rows, forward and backward."""
    n = 65536
    m = 2**31 // n + 5
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", requires_grad=True)
    y = shardnorm.rms_norm(x, n, w) if rms else shardnorm.layer_norm(x, n, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(m - 8, m)
    xr, wr = x[tail].detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = reference_norm(xr, wr, None, None, 1e-6 if rms else 1e-5, rms)
    yr.backward(dy[tail].double())
    assert rel_err(y[tail], yr) < TOL[torch.bfloat16]
    assert rel_err(x.grad[tail], xr.grad) < TOL[torch.bfloat16]


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_hidden_size_262144(backend, device, rms):
    """The largest hidden size the issue names, through the chunked path (fp32, 2 rows)."""
    run_case(device, 262144, rms, torch.float32, rows=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", [1000, LONG], ids=["one_pass", "long"])
def test_tensors_on_another_gpu_than_the_current_one(rms, n):
    """A model spread over GPUs in one process (HF's device_map="auto") calls norms on cuda:1 while cuda:0 is
    current: the kernels must run on cuda:1, in order with its stream, and give what they give there as current
    device. The input is made on a side stream of cuda:1 that cuda:1's current stream waits for, so a launch on
    cuda:0 (unordered with it) could read it unfinished."""
    seed = _seeded()
    results = []
    for current in (1, 0):
        with torch.cuda.device(current):
            other = torch.device("cuda", 1)
            x = (torch.randn(64, n, generator=torch.Generator().manual_seed(seed)) * 2).to(other, torch.bfloat16)
            norm = (shardnorm.RMSNorm if rms else shardnorm.LayerNorm)(n, device=other)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)))
            side = torch.cuda.Stream(other)
            with torch.cuda.stream(side):
                x = (x * 1.5).requires_grad_()
            torch.cuda.current_stream(other).wait_stream(side)
            residual = x.detach() * 0.5
            y, z = norm(x, residual)
            (y.float() * z.float()).sum().backward()
            torch.cuda.synchronize(other)
            results.append([t.cpu() for t in (y, z, x.grad, norm.weight.grad)])
    for mine, theirs in zip(*results):
        assert torch.equal(mine, theirs), f"seed {seed}"
    bias = getattr(norm, "bias", None)
    expected = reference_norm(x.detach().cpu(), norm.weight.detach().cpu(), bias.detach().cpu() if bias is not None
                              else None, residual.cpu(), norm.eps or torch.finfo(torch.bfloat16).eps, rms)
    assert rel_err(results[1][0], expected) < TOL[torch.bfloat16], f"seed {seed}"
