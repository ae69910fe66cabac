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
