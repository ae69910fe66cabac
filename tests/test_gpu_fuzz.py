"""GPU fuzz: random shapes, dtypes and options through the public API, against float64 with torch's own error
as the floor.

Each case draws N (1 to 100000), M (0 up to a few million elements), x / parameter / residual dtypes, bias,
residual, zero-centered gamma, an eps, strided rows, and module or functional; it runs three calls with fresh
data and checks y, z, dx, dresidual, dweight and dbias against float64. What an output may miss by is twice the
error torch's own F.layer_norm / F.rms_norm has in the same dtypes (its parameters cast to the input's dtype)
against the same float64 reference, or a small floor per dtype, whichever is larger. Errors are relative to the
scale the result is accurate to: ||y||; for dx the size of its first term, rstd * w * dy (at N = 1-2 the
gradient itself cancels to almost nothing, in any floating-point code); for dweight / dbias the sum of their
terms' magnitudes (as tests/test_kernels.py).

    GPU_FUZZ_CASES=200 GPU_FUZZ_SEED=1234 python -m pytest tests/test_gpu_fuzz.py -x -q

GPU_FUZZ_SEED (default: random) seeds case i with seed + i; a failure names both, and `-k "case_17"` with the
same seed reruns one case. Default settings (no SHARDNORM_* variable is set here).
"""

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

import shardnorm

CASES = int(os.environ.get("GPU_FUZZ_CASES", "200"))
SEED = int(os.environ.get("GPU_FUZZ_SEED", str(random.SystemRandom().getrandbits(31))))
MAX_ELEMENTS = 1 << 22
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Floors of the relative errors, by the output's dtype: about one rounding of it (fp32: the fp32 sums' own).
FLOOR = {torch.float32: 5e-6, torch.bfloat16: 6e-3, torch.float16: 1e-3}
# N drawn log-uniformly half the time, else near a size where the kernels change tiles or paths.
EDGES = (1, 2, 7, 64, 127, 128, 1000, 1024, 2048, 4096, 4608, 5120, 8192, 8193, 14336, 16384, 16385, 20000,
         32768, 32784, 40000, 65536, 65544, 100000)

DEVICE = "cuda"

print(f"test_gpu_fuzz: GPU_FUZZ_SEED={SEED} GPU_FUZZ_CASES={CASES}")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="the fuzz runs the kernels on a GPU"),
              pytest.mark.filterwarnings("ignore:.*degrees of freedom")]  # the reference at M = 0


def _draw(rng: random.Random) -> dict:
    n = rng.choice(EDGES) if rng.random() < 0.5 else int(math.exp(rng.uniform(0, math.log(100000))))
    n = max(1, min(100000, n))
    cap = max(1, min(4096, MAX_ELEMENTS // n))
    m = 0 if rng.random() < 0.05 else int(math.exp(rng.uniform(0, math.log(cap))))
    rms = rng.random() < 0.5
    module = rng.random() < 0.4
    affine = rng.random() < 0.85
    case = dict(n=n, m=m, rms=rms, module=module, dtype=rng.choice(DTYPES), param_dtype=rng.choice(DTYPES),
                affine=affine, bias=not rms and affine and rng.random() < 0.7,
                weight=affine and (module or rms or rng.random() < 0.9),  # functional LayerNorm: a bias alone
                residual_dtype=rng.choice(DTYPES) if rng.random() < 0.35 else None,
                zero_centered=affine and rng.random() < 0.25,
                eps=rng.choice((1e-5, 1e-6, 1e-12, None if rms else 1e-5)),  # None: rms_norm's default
                strided=rng.random() < 0.3, lead=rng.random() < 0.2)
    if case["module"]:  # modules have a weight and (LayerNorm) a bias together, or neither
        case["weight"] = affine
        case["bias"] = not rms and affine and case["bias"]
    return case


def _error(actual, expected, scale) -> float:
    diff = (actual.double() - expected).norm().item()
    if diff != diff:
        return float("inf")
    scale = scale.norm().item() if isinstance(scale, torch.Tensor) else scale
    return diff / scale if scale > 0 else diff


def _rows(m, n, dtype, strided, gen, scale=2.0, shift=0.5):
    """[m, n] on the GPU, or its view into wider rows (row stride n + 8)."""
    width = n + 8 if strided else n
    full = (torch.randn(m, width, generator=gen, device=DEVICE) * scale + shift).to(dtype)
    return full[:, :n] if strided else full


def _reference(src64, w64, b64, eps, rms, zero_centered):
    if rms:
        y = src64 * torch.rsqrt(src64.square().mean(-1, keepdim=True) + eps)
    else:
        y = (src64 - src64.mean(-1, keepdim=True)) * torch.rsqrt(src64.var(-1, unbiased=False, keepdim=True) + eps)
    if w64 is not None:
        y = y * (w64 + 1 if zero_centered else w64)
    if b64 is not None:
        y = y + b64
    return y


def _torch_same_dtype(x, res, w, b, eps, rms, zero_centered, dy, dz):
    """torch's own norm in the input's dtypes (parameters cast to the norm input's dtype): outputs and grads."""
    x = x.detach().clone().requires_grad_()
    res = res.detach().clone().requires_grad_() if res is not None else None
    z = x + res if res is not None else x
    wt = None if w is None else ((w.detach().float() + 1) if zero_centered else w.detach()).to(z.dtype)
    bt = None if b is None else b.detach().to(z.dtype)
    wt = wt.requires_grad_() if wt is not None else None
    bt = bt.requires_grad_() if bt is not None else None
    n = x.shape[-1]
    y = F.rms_norm(z, (n,), wt, eps) if rms else F.layer_norm(z, (n,), wt, bt, eps if eps is not None else 1e-5)
    y = y.to(x.dtype)
    outs, grads = [y], [dy]
    if res is not None:
        outs.append(z)
        grads.append(dz)
    torch.autograd.backward(outs, grads)
    return y.detach(), x.grad, res.grad if res is not None else None, \
        wt.grad if wt is not None else None, bt.grad if bt is not None else None


def _one_call(case, norm, w, b, gen, ctx):
    n, m, rms, dtype = case["n"], case["m"], case["rms"], case["dtype"]
    shape = (m, n)
    x = _rows(m, n, dtype, case["strided"], gen).requires_grad_()
    res = _rows(m, n, case["residual_dtype"], case["strided"], gen).requires_grad_() \
        if case["residual_dtype"] else None
    xin, rin = x, res
    if case["lead"] and m % 2 == 0 and m:  # 3-D input: [2, M / 2, N] (a view: strided rows stay strided)
        xin = x.view(2, m // 2, n)
        rin = None if res is None else res.view(2, m // 2, n)
        shape = xin.shape
    out = norm(xin, rin)
    y, z = out if res is not None else (out, None)
    assert y.shape == shape and y.dtype == dtype, ctx
    y = y.reshape(m, n)
    z = z.reshape(m, n) if z is not None else None
    dy = torch.randn(m, n, generator=gen, device=DEVICE).to(dtype)
    dz = torch.randn(m, n, generator=gen, device=DEVICE).to(z.dtype) if z is not None else None
    torch.autograd.backward([y] + ([z] if z is not None else []), [dy] + ([dz] if dz is not None else []))

    eps = case["eps"]
    # None: torch's rms_norm default, the epsilon of the float32 it computes in whatever the input's dtype
    # (shardnorm.functional.resolve_eps; tests/test_modules.py checks torch's own call against it)
    eps_eff = torch.finfo(torch.float32).eps if eps is None else eps
    src = (x.detach() + res.detach()) if res is not None else x.detach()
    if z is not None:  # both round the fp32 sum to nearest even (the CPU interpreter does not, on ties)
        assert torch.equal(z, src), f"z is not x + residual in torch's promoted dtype ({ctx})"
    src64 = src.double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y64 = _reference(src64, w64, b64, eps_eff, rms, case["zero_centered"])
    y64.backward(dy.double())
    dx64 = src64.grad + (dz.double() if dz is not None else 0)
    ty, tdx, tdres, tdw, tdb = _torch_same_dtype(x, res, w, b, eps_eff if rms else eps, rms, case["zero_centered"],
                                                 dy, dz)

    with torch.no_grad():
        centered = src.double() - (0 if rms else src.double().mean(-1, keepdim=True))
        rstd = torch.rsqrt(centered.square().mean(-1) + eps_eff)
        w_eff = (w.double() + 1 if case["zero_centered"] else w.double()) if w is not None else 1.0
        dx_scale = (rstd[:, None] * w_eff * dy.double()).norm().item() + \
            (dz.double().norm().item() if dz is not None else 0)
        xhat = _reference(src.double(), None, None, eps_eff, rms, False)
        checks = [("y", y, ty, y64, y64.norm().item(), dtype), ("dx", x.grad, tdx, dx64, dx_scale, dtype)]
        if res is not None:
            checks.append(("dresidual", res.grad, tdres, dx64, dx_scale, case["residual_dtype"]))
        if w is not None:
            checks.append(("dweight", w.grad, tdw, w64.grad, (dy.double() * xhat).abs().sum(0).norm().item(), w.dtype))
        if b is not None:
            checks.append(("dbias", b.grad, tdb, b64.grad, dy.double().abs().sum(0).norm().item(), b.dtype))
        for name, ours, theirs, expected, scale, out_dtype in checks:
            err = _error(ours, expected, scale)
            floor = FLOOR[out_dtype]
            torch_err = _error(theirs, expected, scale) if theirs is not None else 0.0
            allowed = max(2 * torch_err, floor) if torch_err == torch_err else floor
            assert err <= allowed, f"{name}: error {err:.3g} > {allowed:.3g} (torch {torch_err:.3g}) ({ctx})"


@pytest.mark.parametrize("index", range(CASES), ids=[f"case_{i}" for i in range(CASES)])
def test_fuzz(index):
    rng = random.Random(SEED + index)
    case = _draw(rng)
    ctx = f"GPU_FUZZ_SEED={SEED} case_{index}: {case}"
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + index)
    n, rms, pdt = case["n"], case["rms"], case["param_dtype"]
    eps = case["eps"]
    if case["module"]:
        cls = shardnorm.RMSNorm if rms else shardnorm.LayerNorm
        kw = dict(elementwise_affine=case["affine"], device=DEVICE, dtype=pdt,
                  zero_centered_gamma=case["zero_centered"])
        if not rms:
            kw["bias"] = case["bias"]
        module = cls(n, eps, **kw)
        w, b = module.weight, getattr(module, "bias", None) if not rms else None
        with torch.no_grad():  # random parameters, not torch's ones and zeros
            if w is not None:
                w.copy_(torch.randn(n, generator=gen, device=DEVICE))
            if b is not None:
                b.copy_(torch.randn(n, generator=gen, device=DEVICE))

        def norm(x, res):
            return module(x) if res is None else module(x, res)
    else:
        w = torch.randn(n, generator=gen, device=DEVICE).to(pdt).requires_grad_() if case["weight"] else None
        b = torch.randn(n, generator=gen, device=DEVICE).to(pdt).requires_grad_() if case["bias"] else None
        kw = dict(zero_centered_gamma=case["zero_centered"])

        def norm(x, res):
            if rms:
                return shardnorm.rms_norm(x, n, w, eps, **kw) if res is None else \
                    shardnorm.add_rms_norm(x, res, n, w, eps, **kw)
            return shardnorm.layer_norm(x, n, w, b, eps, **kw) if res is None else \
                shardnorm.add_layer_norm(x, res, n, w, b, eps, **kw)
    for call in range(3):  # fresh data each call; parameter grads reset in between
        for p in (w, b):
            if p is not None:
                p.grad = None
        _one_call(case, norm, w, b, gen, f"{ctx}, call {call}")
