"""Shared test setup: backends, devices, the float64 reference and error metric.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (set here, before
triton is first imported), so CI proves the kernels and not only the torch path.
"""

import os
import sys
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's caches of this test run only: its FX-graph cache keys a graph by the ops' names, not their
# schemas, so a graph cached by an older shardnorm (another norm_bwd signature) would be replayed here.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="shardnorm-tests-inductor-"))
# the launchers the tests start (launch/train.sh, launch/deepspeed.sh) run under the interpreter running the
# tests, whichever environment that is, rather than setting up the repository's .venv
os.environ.setdefault("PYTHON", sys.executable)

BACKENDS = ("triton", "torch")


def backend_device(backend: str) -> torch.device:
    """Triton runs on the GPU where there is one, else interpreted on CPU; torch runs on CPU."""
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _settings_reread_after_each_test():
    """shardnorm reads its settings once per process: a test that changed a SHARDNORM_* variable (and had it undone)
    must not leave its value behind for the next test."""
    yield
    from shardnorm import settings

    settings.reload()


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    from shardnorm import settings

    monkeypatch.setenv("SHARDNORM_BACKEND", request.param)
    settings.reload()
    yield request.param
    monkeypatch.undo()
    settings.reload()


@pytest.fixture
def triton_backend():
    """The Triton kernels whatever the tensors' device (interpreted on CPU): SHARDNORM_BACKEND=triton with the
    settings read again (a bare setenv is not seen: shardnorm reads its settings once); yields the device."""
    from shardnorm import settings

    before = os.environ.get("SHARDNORM_BACKEND")
    os.environ["SHARDNORM_BACKEND"] = "triton"
    assert settings.reload().backend == "triton"
    yield backend_device("triton")
    if before is None:
        del os.environ["SHARDNORM_BACKEND"]
    else:
        os.environ["SHARDNORM_BACKEND"] = before
    settings.reload()


@pytest.fixture
def device(backend):
    return backend_device(backend)


@pytest.fixture(params=["direct", "partial"])
def grads_path(request, monkeypatch):
    """The one-pass backward's two ways to dgamma/dbeta of a small input: one program stores them
    (`config.direct_grads`), or partial rows and the column sum (its size limit set to 0)."""
    import importlib

    from shardnorm.kernels import config

    norm_bwd = importlib.import_module("shardnorm.kernels.norm_bwd")  # the module, not its function
    if request.param == "partial":
        monkeypatch.setattr(config, "DIRECT_GRADS_MAX_ELEMENTS", 0)
    norm_bwd._plan.cache_clear()  # plans remember each M's choice
    yield request.param
    norm_bwd._plan.cache_clear()


def reference_norm(x, weight, bias, residual, eps, rms, zero_centered=False):
    """float64 norm of x (or of x + residual, added in torch's promoted dtype first, as the op does)."""
    src = (x + residual) if residual is not None else x
    xd = src.double()
    if rms:
        y = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    else:
        y = (xd - xd.mean(-1, keepdim=True)) * torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + 1 if zero_centered else weight.double())
    if bias is not None:
        y = y + bias.double()
    return y


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||actual - expected|| / ||scale|| (default: expected) in float64; NaN anywhere makes it inf."""
    diff = (actual.double().cpu() - expected.double().cpu()).norm().item()
    scale = (expected if scale is None else scale).double().norm().item()
    if diff != diff:
        return float("inf")
    return diff / scale if scale > 0 else diff
