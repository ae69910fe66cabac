"""Second-order grads (a gradient penalty: grad with create_graph=True, then backward through it) equal torch's.

A backward run with grad mode on (`ops._NormFunction.backward`) computes the grads with differentiable torch ops from
the saved input, on every backend; the reference is torch's own norm in float64 on the same data.
"""

import pytest
import torch
import torch.nn.functional as F

import shardnorm
from conftest import rel_err


def _torch_norm(x, weight, bias, eps, rms, zero_centered):
    scale = weight + 1 if zero_centered else weight
    if rms:
        return F.rms_norm(x, (x.shape[-1],), scale, eps)
    return F.layer_norm(x, (x.shape[-1],), scale, bias, eps)


def _shardnorm(x, weight, bias, residual, eps, rms, zero_centered):
    n = (x.shape[-1],)
    if residual is None:
        if rms:
            return shardnorm.rms_norm(x, n, weight, eps, zero_centered_gamma=zero_centered), None
        return shardnorm.layer_norm(x, n, weight, bias, eps, zero_centered_gamma=zero_centered), None
    if rms:
        return shardnorm.add_rms_norm(x, residual, n, weight, eps, zero_centered_gamma=zero_centered)
    return shardnorm.add_layer_norm(x, residual, n, weight, bias, eps, zero_centered_gamma=zero_centered)


def _penalty_grads(norm, leaves, probe, probe_z):
    """d/d(leaves) of ||d(<y, probe> + <z, probe_z>)/d(x, residual, weight)||^2: the second-order grads of a
    gradient penalty, through the first backward."""
    y, z = norm(*leaves)
    loss = (y * probe).sum() + ((z * probe_z).sum() if z is not None else 0)
    inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    penalty = sum((g.double() ** 2).sum() for g in first)
    return torch.autograd.grad(penalty, inputs, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("variant", ["plain", "bias", "residual", "zero_centered"])
def test_gradient_penalty_matches_torch_float64(backend, device, rms, variant):
    if rms and variant == "bias":
        pytest.skip("RMSNorm has no bias")
    torch.manual_seed(0)
    M, N, eps = 6, 40, 1e-5
    zero_centered = variant == "zero_centered"
    x = torch.randn(M, N, device=device) * 2 + 0.5
    weight = torch.randn(N, device=device)
    bias = torch.randn(N, device=device) if variant == "bias" else None
    residual = torch.randn(M, N, device=device) if variant == "residual" else None
    probe, probe_z = torch.randn(M, N, device=device), torch.randn(M, N, device=device)

    def ours(x, weight, bias, residual):
        return _shardnorm(x, weight, bias, residual, eps, rms, zero_centered)

    def reference(x, weight, bias, residual):
        z = x + residual if residual is not None else None
        return _torch_norm(z if z is not None else x, weight, bias, eps, rms, zero_centered), z

    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    got = _penalty_grads(ours, leaves, probe, probe_z)
    expected = _penalty_grads(reference, leaves64, probe.double(), probe_z.double())
    assert len(got) == len(expected)
    for name, g, e in zip(("x", "weight", "bias", "residual"), got, expected):
        assert rel_err(g, e) < 1e-4, f"{name}: {rel_err(g, e):.2e}"


def test_first_order_grads_unchanged_by_create_graph(backend, device):
    """create_graph's differentiable math gives the same first-order grads as the kernels' backward."""
    torch.manual_seed(1)
    x = torch.randn(8, 96, device=device, requires_grad=True)
    w = torch.randn(96, device=device, requires_grad=True)
    b = torch.randn(96, device=device, requires_grad=True)
    dy = torch.randn(8, 96, device=device)
    y = shardnorm.layer_norm(x, (96,), w, b)
    plain = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
    graph = torch.autograd.grad(y, (x, w, b), dy, create_graph=True)
    for p, g in zip(plain, graph):
        assert rel_err(g, p) < 1e-5


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_norm_fwd_op_has_the_norms_grads(backend, device, rms, residual):
    """`torch.ops.shardnorm.norm_fwd` called on its own under autograd (what a torch.export-ed model runs): its
    grads, first and second order, are the functional call's bitwise (the same backend and math)."""
    torch.manual_seed(0)
    n = 40
    leaf = lambda *shape: torch.randn(*shape, device=device).requires_grad_()  # noqa: E731
    x, w, b = leaf(6, n), leaf(n), None if rms else leaf(n)
    r = leaf(6, n) if residual else None
    inputs = [t for t in (x, r, w, b) if t is not None]

    def functional():
        if rms:
            return shardnorm.add_rms_norm(x, r, n, w, 1e-5) if residual else (shardnorm.rms_norm(x, n, w, 1e-5),)
        return shardnorm.add_layer_norm(x, r, n, w, b, 1e-5) if residual else \
            (shardnorm.layer_norm(x, n, w, b, 1e-5),)

    def op():
        y, z, _, _ = torch.ops.shardnorm.norm_fwd(x, w, b, r, 1e-5, rms, False)
        return (y, z) if residual else (y,)

    results = []
    for fn in (functional, op):
        outs = fn()
        loss = sum((o * torch.linspace(-1, 1, n, device=device, dtype=o.dtype)).square().sum() for o in outs)
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in grads), inputs)
        results.append([o.detach() for o in outs] + [g.detach() for g in grads] + list(second))
    unequal = [i for i, (a, e) in enumerate(zip(*results)) if not torch.equal(a, e)]
    assert not unequal, f"the op's outputs / grads differ from the functional call's at {unequal}"


@pytest.mark.parametrize("strict", [False, True])
def test_exported_model_trains_like_the_eager_one(backend, device, strict):
    """torch.export holds each norm as `shardnorm::norm_fwd`, whose own autograd formula gives the exported module
    the eager model's grads: non-strict export inlines the norms' autograd.Function into it; strict export would run
    the Function's forward with grad mode off and keep no backward (every grad before the norm silently None), so
    an exporting call takes the op itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), shardnorm.RMSNorm(16), torch.nn.Linear(16, 16),
                                shardnorm.LayerNorm(16)).to(device)
    x = torch.randn(3, 16, device=device)
    exported = torch.export.export(model, (x,), strict=strict).module()
    assert any(n.target is torch.ops.shardnorm.norm_fwd.default for n in exported.graph.nodes)
    for m in (model, exported):
        m(x).square().sum().backward()
    theirs = dict(exported.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, theirs[name].grad), name
