"""`norm_fwd(..., y=out)`: the forward writes y into a given tensor, bitwise what the allocating call returns."""

import pytest
import torch

from conftest import backend_device
from shardnorm import reference
from shardnorm.kernels import config, norm_fwd


def _forward(backend):
    return norm_fwd if backend == "triton" else reference.norm_fwd


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n,dtype,residual", [(1000, torch.bfloat16, False), (1000, torch.float32, True),
                                              (config.MAX_FUSED_N_FWD + 96, torch.bfloat16, False)],
                         ids=["one_pass_bf16", "one_pass_fp32_residual", "long"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_out_is_bitwise_the_allocating_call(backend, rms, n, dtype, residual, offset):
    device = backend_device(backend)
    fwd = _forward(backend)
    rows = 3
    x = (torch.randn(rows, n) * 3 + 1).to(dtype).to(device)
    w = torch.randn(n).to(device)
    b = None if rms else torch.randn(n).to(device)
    res = torch.randn(rows, n).to(dtype).to(device) if residual else None
    y, z, mean, rstd = fwd(x, w, b, res, 1e-5, rms, False)
    buffer = torch.full((rows * n + offset,), float("nan"), dtype=dtype, device=device)
    out = buffer[offset:].view(rows, n)  # contiguous; with offset 1 not 16-byte aligned
    y2, z2, mean2, rstd2 = fwd(x, w, b, res, 1e-5, rms, False, y=out)
    assert y2.data_ptr() == out.data_ptr()
    assert torch.equal(out, y) and not torch.isnan(out).any()
    assert torch.equal(rstd2, rstd)
    if not rms:
        assert torch.equal(mean2, mean)
    if residual:
        assert torch.equal(z2, z)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_must_match_x(backend):
    device = backend_device(backend)
    fwd = _forward(backend)
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    bad = {"shape": torch.empty(4, 32, device=device), "dtype": torch.empty(4, 64, dtype=torch.bfloat16, device=device),
           "contiguous": torch.empty(64, 4, device=device).t()}
    for what, out in bad.items():
        with pytest.raises(ValueError, match="y must be a contiguous tensor"):
            fwd(x, w, None, None, 1e-5, True, False, y=out)
    with pytest.raises(TypeError, match="y must be a tensor"):
        fwd(x, w, None, None, 1e-5, True, False, y=[0.0])


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True], ids=["no_params", "params"])
def test_backends_return_the_same_outputs_and_absent_ones_as_none(rms, affine):
    """`ops` picks either backend: the reference returns what the kernels return, None where an output is absent
    (z without a residual, mean for RMSNorm, dweight/dbias without weight/bias)."""
    from shardnorm import kernels

    seed = torch.seed()
    print(f"seed {seed}")
    rows, n = 3, 40
    outs = {}
    for backend, fwd, bwd in (("triton", kernels.norm_fwd, kernels.norm_bwd),
                              ("torch", reference.norm_fwd, reference.norm_bwd)):
        device = backend_device(backend)
        torch.manual_seed(seed)
        x, dy = torch.randn(rows, n).to(device), torch.randn(rows, n).to(device)
        w = torch.randn(n).to(device) if affine else None
        b = torch.randn(n).to(device) if affine and not rms else None
        y, z, mean, rstd = fwd(x, w, b, None, 1e-5, rms, False)
        dx, dw, db = bwd(dy, None, x, w, mean, rstd, b is not None, rms, False)
        outs[backend] = [t if t is None else t.cpu() for t in (y, z, mean, rstd, dx, dw, db)]
    names = ("y", "z", "mean", "rstd", "dx", "dweight", "dbias")
    absent = [name for name, t in zip(names, outs["triton"]) if t is None]
    assert absent == ["z"] + ["mean"] * rms + ["dweight"] * (not affine) + ["dbias"] * (rms or not affine)
    for name, got, want in zip(names, outs["torch"], outs["triton"]):
        assert (got is None) == (want is None), f"{name}: reference {got!r}, kernels {want!r}"
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
