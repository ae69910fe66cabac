"""The two backends (Triton kernels, torch reference) return the same outputs, absent ones as None."""

import pytest
import torch

from conftest import backend_device
from shardnorm import reference




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
