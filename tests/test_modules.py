"""Drop-in modules: torch.nn compatibility, convert(), torch.compile."""

import contextlib

import pytest
import torch

import shardnorm
from conftest import reference_norm, rel_err

PAIRS = [
    (torch.nn.LayerNorm, shardnorm.LayerNorm, dict()),
    (torch.nn.LayerNorm, shardnorm.LayerNorm, dict(bias=False)),
    (torch.nn.LayerNorm, shardnorm.LayerNorm, dict(elementwise_affine=False)),
    (torch.nn.RMSNorm, shardnorm.RMSNorm, dict()),
    (torch.nn.RMSNorm, shardnorm.RMSNorm, dict(eps=1e-5, elementwise_affine=False)),
]


@pytest.mark.parametrize("torch_cls,ours_cls,kw", PAIRS)
def test_same_as_torch_nn(backend, device, torch_cls, ours_cls, kw):
    shape = (3, 40)
    theirs = torch_cls(shape, device=device, **kw)
    ours = ours_cls(shape, device=device, **kw)
    assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name in ("normalized_shape", "eps", "elementwise_affine"):
        assert getattr(ours, name) == getattr(theirs, name)
    with torch.no_grad():  # random params, then load both ways
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, *shape, device=device)
    assert rel_err(ours(x), theirs(x)) < 1e-5
    theirs.load_state_dict({k: v + 1 for k, v in ours.state_dict().items()})
    ours.load_state_dict(theirs.state_dict())
    assert rel_err(ours(x), theirs(x)) < 1e-5


@pytest.mark.parametrize("torch_cls,ours_cls", [(torch.nn.LayerNorm, shardnorm.LayerNorm),
                                                 (torch.nn.RMSNorm, shardnorm.RMSNorm)])
def test_numpy_sizes_and_eps_as_torch_takes_them(torch_cls, ours_cls):
    """Sizes and eps read from numpy (a config array): torch's norms take numpy integers and floats, so do the
    drop-ins, `convert` and the functional calls, which hold and pass them as Python ints and floats."""
    np = pytest.importorskip("numpy")
    n, eps = np.int64(24), np.float32(1e-3)
    x = torch.randn(4, 24)
    theirs = torch_cls(n, eps=eps)
    with torch.no_grad():
        theirs.weight.normal_()
    for ours in (ours_cls(n, eps=eps), ours_cls([np.int32(24)], eps=eps),
                 shardnorm.convert(torch.nn.Sequential(theirs), warn=False).model[0]):
        ours.load_state_dict(theirs.state_dict())
        assert ours.normalized_shape == (24,) and type(ours.normalized_shape[0]) is int and type(ours.eps) is float
        assert rel_err(ours(x), theirs(x)) < 1e-5
    assert rel_err(shardnorm.rms_norm(x, n, eps=eps), torch.nn.functional.rms_norm(x, (24,), eps=float(eps))) < 1e-5


def test_dtype_and_device_arguments():
    m = shardnorm.RMSNorm(16, dtype=torch.bfloat16, device="meta")
    assert m.weight.dtype == torch.bfloat16 and m.weight.device.type == "meta"


@pytest.mark.parametrize("cls", [shardnorm.LayerNorm, shardnorm.RMSNorm])
def test_zero_centered_gamma(backend, device, cls):
    m = cls(64, zero_centered_gamma=True, device=device)
    assert torch.equal(m.weight, torch.zeros_like(m.weight)) and "zero_centered_gamma=True" in repr(m)
    with torch.no_grad():
        m.weight.normal_()
    plain = cls(64, device=device)
    plain.load_state_dict({k: v + 1 if k == "weight" else v for k, v in m.state_dict().items()})
    x = torch.randn(4, 64, device=device)
    assert rel_err(m(x), plain(x)) < 1e-5


def test_module_residual_forward(backend, device):
    m = shardnorm.RMSNorm(32, device=device)
    with torch.no_grad():
        m.weight.normal_()
    x, r = torch.randn(2, 3, 32, device=device), torch.randn(2, 3, 32, device=device)
    y, z = m(x, residual=r)
    assert rel_err(z, x + r) < 1e-6 and rel_err(y, m(x + r)) < 1e-6


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("cls", [shardnorm.LayerNorm, shardnorm.RMSNorm])
def test_forward_without_grad(backend, device, cls, mode):
    """Without grad mode: same values as float64, no graph, and the residual path's sum too."""
    m = cls(48, device=device)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x, r = torch.randn(3, 5, 48, device=device), torch.randn(3, 5, 48, device=device)
    bias = getattr(m, "bias", None)
    with mode():
        y = m(x)
        y2, z = m(x, residual=r)
    assert y.grad_fn is None and y2.grad_fn is None and not y.requires_grad
    rms, eps = cls is shardnorm.RMSNorm, m.eps or torch.finfo(torch.float32).eps
    assert rel_err(y, reference_norm(x, m.weight, bias, None, eps, rms)) < 1e-5
    assert rel_err(y2, reference_norm(x, m.weight, bias, r, eps, rms)) < 1e-5 and rel_err(z, x + r) < 1e-6


class LlamaRMSNorm(torch.nn.Module):
    """The Hugging Face shape of an RMSNorm (a stand-in for the class transformers defines)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.variance_epsilon)).to(x.dtype)


@pytest.mark.parametrize("cls", [shardnorm.LayerNorm, shardnorm.RMSNorm])
def test_torch_jit_trace_records_the_norm(backend, device, cls):
    """`torch.jit.trace` keeps the ops it sees as the traced module's program: the norm is recorded as its op (a
    kernel launched directly is no op: tracing failed on the sizes the tracer hands out as tensors, and a traced
    module would have lost the launch). The traced module runs new inputs of the traced shapes (as jit.trace
    promises), the residual form included, with the eager module's outputs and grads."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(16, 16), cls(16)

        def forward(self, x, residual):
            y, z = self.norm(self.lin(x), residual)
            return self.norm(y) + z

    block = Block().to(device)
    traced = torch.jit.trace(block, (torch.randn(2, 5, 16, device=device), torch.randn(2, 5, 16, device=device)))
    x, residual = torch.randn(2, 5, 16, device=device), torch.randn(2, 5, 16, device=device)
    outputs, grads = [], []
    for module in (traced, block):
        x_ = x.clone().requires_grad_()
        out = module(x_, residual)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append([x_.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    assert torch.equal(*outputs)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torch_jit_script_refuses_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), shardnorm.RMSNorm(8))
    with pytest.raises(TypeError, match=r"shardnorm.RMSNorm cannot be compiled by torch.jit.script"):
        torch.jit.script(model)
    assert isinstance(model[1], shardnorm.RMSNorm)  # the model is left as it was


def test_convert_keeps_parameters_and_outputs():
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.LayerNorm(24),
                                torch.nn.Sequential(torch.nn.RMSNorm(24, eps=1e-5), LlamaRMSNorm(24, 1e-4)),
                                torch.nn.LayerNorm(24, bias=False))
    for p in model.parameters():
        torch.nn.init.normal_(p)
    params = {n: p for n, p in model.named_parameters()}
    x = torch.randn(3, 24)
    before = model(x)
    model, count = shardnorm.convert(model)
    assert count == 4
    assert [type(m).__name__ for m in (model[1], model[2][0], model[2][1], model[3])] == \
        ["LayerNorm", "RMSNorm", "RMSNorm", "LayerNorm"]
    assert isinstance(model[2][1], shardnorm.RMSNorm) and model[2][1].eps == 1e-4
    assert all(p is params[n] for n, p in model.named_parameters())
    assert rel_err(model(x), before) < 1e-5
    assert shardnorm.convert(model)[1] == 0  # idempotent
    only_ln, count = shardnorm.convert(torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.RMSNorm(4)),
                                       classes=["LayerNorm"])
    assert count == 1 and type(only_ln[1]) is torch.nn.RMSNorm


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) of shardnorm modules, plain and residual form, compiles without a graph break
    and matches eager and float64 (output, input and parameter grads). Inductor's caches are off through its own
    `config.patch`, which restores the config (monkeypatching it deletes entries on torch 2.13)."""
    import torch._inductor.config as inductor_config

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = shardnorm.RMSNorm(32, eps=1e-5)
            self.ln = shardnorm.LayerNorm(32)
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x, residual):
            h, residual = self.norm(x, residual)
            return self.ln(self.proj(h) + residual)

    model = Block()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    x, r = torch.randn(2, 4, 32, requires_grad=True), torch.randn(2, 4, 32)
    params = [x, *model.parameters()]
    eager = model(x, r)
    eager_grads = torch.autograd.grad(eager.square().sum(), params)

    with inductor_config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(x, r)
        compiled_grads = torch.autograd.grad(compiled.square().sum(), params)
        torch._dynamo.reset()

    x64, r64, w1, w2, b2, pw, pb = (t.detach().double().requires_grad_() for t in (x, r, *model.parameters()))
    h64 = reference_norm(x64, w1, None, r64, 1e-5, rms=True)
    want = reference_norm(h64 @ pw.T + pb, w2, b2, x64 + r64, 1e-5, rms=False)
    want_grads = torch.autograd.grad(want.square().sum(), [x64, w1, w2, b2, pw, pb])
    assert rel_err(compiled, eager) < 1e-6 and rel_err(compiled, want) < 1e-5
    for i, (got, eager_grad, want_grad) in enumerate(zip(compiled_grads, eager_grads, want_grads)):
        assert rel_err(got, eager_grad) < 1e-5 and rel_err(got, want_grad) < 1e-5, i


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_batched_grads_match_torch(backend, device, rms):
    """A backward batched over its grads (`torch.autograd.grad(..., is_grads_batched=True)`, `jacobian(vectorize=True)`)
    gives torch's grads on every backend: the kernels cannot read its batched tensors, so such a backward
    takes torch ops."""
    seed = torch.seed()
    print(f"seed {seed}")
    x = torch.randn(3, 24, device=device, dtype=torch.float64)
    w, b = torch.randn(24, device=device, dtype=torch.float64), torch.randn(24, device=device, dtype=torch.float64)
    cotangents = torch.randn(5, 3, 24, device=device, dtype=torch.float64)

    def norm(library, x, w, b):
        if rms:
            return library.rms_norm(x, (24,), w, 1e-5)
        return library.layer_norm(x, (24,), w, b, 1e-5)

    leaves = [t.float().requires_grad_() for t in (x, w, b)]
    got = torch.autograd.grad(norm(shardnorm, *leaves), leaves[:2], cotangents.float(), is_grads_batched=True)
    leaves64 = [t.requires_grad_() for t in (x, w, b)]
    wanted = torch.autograd.grad(norm(torch.nn.functional, *leaves64), leaves64[:2], cotangents,
                                 is_grads_batched=True)
    for g, r in zip(got, wanted):
        assert g.shape == r.shape and rel_err(g, r) < 1e-5
    w, b = w.detach(), b.detach()
    jacobian = torch.autograd.functional.jacobian(lambda t: norm(shardnorm, t, w.float(), b.float()), x.float(),
                                                  vectorize=True)
    want_jacobian = torch.autograd.functional.jacobian(lambda t: norm(torch.nn.functional, t, w, b), x.detach(),
                                                       vectorize=True)
    assert rel_err(jacobian, want_jacobian) < 1e-5


def test_compiled_autograd_over_an_eager_forward_has_no_graph_break(backend, device):
    """Compiled autograd traces the norms' backward into its graph, fullgraph, over an eager forward (the backward's
    choice between launching the kernels and calling the op read dispatch state Dynamo cannot trace: a break per
    norm), with the eager backward's grads."""
    seed = torch.seed()
    print(f"seed {seed}")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), shardnorm.RMSNorm(16), torch.nn.Linear(16, 16),
                                shardnorm.LayerNorm(16)).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    x = torch.randn(3, 5, 16, device=device)

    def grads(compiled_backward: bool):
        model.zero_grad(set_to_none=True)
        loss = model(x).square().sum()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)) \
                if compiled_backward else contextlib.nullcontext():
            loss.backward()
        return [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = grads(True)
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    for got, want in zip(compiled, grads(False)):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch's CUDA rms_norm is another kernel, with its own default"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_default_eps_is_torchs(dtype, device):
    """eps=None is torch's rms_norm default for every dtype: the float32 epsilon it computes with (ATen's opmath type),
    not the input dtype's (bf16's 7.8e-3 made rows of small values come out up to 99 % smaller), in the function, the
    module and a converted `torch.nn.RMSNorm`, and torch's own call in the input's dtype on that device agrees. Rows
    small enough that eps matters."""
    seed = torch.seed()
    print(f"seed {seed}")
    x = (torch.randn(6, 64) * torch.tensor([1, 1e-1, 1e-2, 1e-3, 3e-4, 1e-4])[:, None]).to(dtype).to(device)
    w = (1 + 0.2 * torch.randn(64)).to(dtype).to(device)
    want = torch.nn.functional.rms_norm(x.double(), (64,), w.double(), eps=torch.finfo(torch.float32).eps)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.nn.functional.rms_norm(x.double(), (64,), w.double()).sub(want).abs().max() > 0.01  # eps matters
    assert rel_err(torch.nn.functional.rms_norm(x, (64,), w), want) < tol
    assert rel_err(shardnorm.rms_norm(x, (64,), w), want) < tol
    norm = shardnorm.RMSNorm(64, dtype=dtype, device=device)
    torch_norm = torch.nn.Sequential(torch.nn.RMSNorm(64, dtype=dtype, device=device))
    with torch.no_grad():
        norm.weight.copy_(w)
        torch_norm[0].weight.copy_(w)
    assert rel_err(norm(x), want) < tol
    shardnorm.convert(torch_norm)
    assert isinstance(torch_norm[0], shardnorm.RMSNorm) and rel_err(torch_norm(x), want) < tol


def test_norm_takes_a_given_eps_without_resolving_it_again(monkeypatch):
    """`functional._norm` uses a given eps as it is (a module resolves it once, for the norm and for its output
    recompute) and resolves only None, to torch's rms_norm default."""
    from shardnorm import functional as F

    seed = torch.seed()
    print(f"seed {seed}")
    calls, resolve = [], F.resolve_eps
    monkeypatch.setattr(F, "resolve_eps", lambda eps: calls.append(eps) or resolve(eps))
    x, w = torch.randn(3, 16), torch.randn(16)
    y, _ = F._norm(x, None, 16, w, None, 0.5, True, False)
    assert calls == []
    assert rel_err(y, reference_norm(x, w, None, None, 0.5, rms=True)) < 1e-5
    y_default, _ = F._norm(x, None, 16, w, None, None, True, False)
    assert calls == [None]
    assert torch.equal(y_default, F._norm(x, None, 16, w, None, torch.finfo(torch.float32).eps, True, False)[0])
