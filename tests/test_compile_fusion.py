"""torch.compile folds the adds around a shardnorm norm into its ops (compile_fusion.py): the residual add in
front of the norm into the forward, the sum of the norm's output grads into the backward kernel; on real
Hugging Face decoders, on the Triton kernels, exactly in the forward, and never where it would change a
result."""

import copy

import pytest
import torch
from conftest import reference_norm, rel_err
from hf_tiny import LAYERS, batch, tiny_model

import shardnorm
from shardnorm import compile_fusion


@pytest.fixture(autouse=True)
def _fresh_compiles(monkeypatch):
    """Every compile here traces anew: Inductor's caches would hide what the pass does."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fused_when_compiled(fn, *args):
    before = compile_fusion.counts["fused_adds"]
    out = torch.compile(fn, fullgraph=True)(*args)
    return out, compile_fusion.counts["fused_adds"] - before


class PreNorm(torch.nn.Module):
    """h = a + b; (norm(h), h): h is used after the norm too, so its grad reaches the fused backward's dz."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, a, b):
        h = a + b
        return self.norm(h), h


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_hf_decoder_adds_fused_and_exact(arch, monkeypatch):
    """Every add that feeds a norm (the post-attention norms, each later layer's input norm, the final norm:
    2 per layer) is fused; logits and every parameter grad equal the unconverted model's in eager, fp32."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    reference = tiny_model(arch, seed=3)
    model = shardnorm.convert(copy.deepcopy(reference)).model
    inputs = batch(reference, seed=4)
    expected = reference(**inputs)
    expected.loss.backward()

    before = dict(compile_fusion.counts)
    got = torch.compile(model)(**inputs)
    got.loss.backward()
    assert compile_fusion.counts["fused_adds"] - before.get("fused_adds", 0) == 2 * LAYERS
    # the grads of q + k + v (2 adds) and gate + up (1 add) summed inside each layer's norm backward kernels
    assert compile_fusion.counts["fused_grad_terms"] - before.get("fused_grad_terms", 0) == 3 * LAYERS
    assert rel_err(got.logits, expected.logits) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [True, False])
def test_fused_forward_is_bitwise_and_grads_match(backend, device, dtype, rms):
    """The fused op returns the same y and h as the add and the norm apart, bit for bit (the kernel rounds h
    before normalizing); grads match float64 as closely as the unfused graph's (bf16: one rounding fewer)."""
    n = 96  # not a power of two
    norm = (shardnorm.RMSNorm(n, eps=1e-5) if rms else shardnorm.LayerNorm(n)).to(device=device, dtype=dtype)
    model = PreNorm(norm)
    a = torch.randn(2, 5, n, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(2, 5, n, device=device, dtype=dtype, requires_grad=True)
    eager_y, eager_h = model(a, b)

    (y, h), fused = _fused_when_compiled(model, a, b)
    assert fused == 1
    if backend == "triton" and device.type == "cpu" and dtype != torch.float32:
        # the Triton interpreter rounds fp32 -> bf16 toward zero (GPUs: to nearest even, as torch): h and so y
        # can differ from torch's add by one bf16 step
        assert rel_err(h, eager_h) < 1e-2 and rel_err(y, eager_y) < 2e-2
    else:
        assert torch.equal(h, eager_h) and torch.equal(y, eager_y)

    g_y, g_h = torch.randn_like(y), torch.randn_like(h)
    params = [a, b] + list(norm.parameters())
    got = torch.autograd.grad((y.float() * g_y).sum() + (h.float() * g_h).sum(), params)
    unfused = torch.autograd.grad((eager_y.float() * g_y).sum() + (eager_h.float() * g_h).sum(), params)
    double = [p.detach().double().requires_grad_() for p in params]
    h64 = double[0] + double[1]
    y64 = reference_norm(h64, double[2], double[3] if len(double) > 3 else None, None, norm.eps, rms)
    want = torch.autograd.grad((y64 * g_y.double()).sum() + (h64 * g_h.double()).sum(), double)
    for name, got_grad, unfused_grad, want_grad in zip(("a", "b", "weight", "bias"), got, unfused, want):
        if dtype == torch.float32:
            assert rel_err(got_grad, want_grad) < 1e-5, name
        elif device.type == "cpu" and backend == "triton":  # rounding toward zero (above): bf16-sized errors
            assert rel_err(got_grad, want_grad) < 1e-2, name
        else:  # fused: dx + dz added in fp32 and rounded once; unfused: rounded, added, rounded again
            assert rel_err(got_grad, want_grad) <= 1.01 * rel_err(unfused_grad, want_grad) + 1e-6, name


def test_left_alone_where_fusing_would_change_something(monkeypatch):
    """Not fused, and still right: a dtype-promoting add (the norm's output would take x's dtype), a
    broadcasting add, an add used before the norm, and with SHARDNORM_COMPILE_FUSION=0."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    n = 48
    norm = shardnorm.RMSNorm(n)
    with torch.no_grad():
        norm.weight.normal_()
    a = torch.randn(6, n, dtype=torch.bfloat16)
    cases = {
        "promoting": (lambda x, r: norm(x + r), (a, torch.randn(6, n))),
        "broadcasting": (lambda x, r: norm(x + r), (a.float(), torch.randn(n))),
        "used before": (lambda x, r: (lambda h: (h.sum(), norm(h)))(x + r), (a.float(), a.float().flip(0))),
    }
    for name, (fn, args) in cases.items():
        out, fused = _fused_when_compiled(fn, *args)
        torch._dynamo.reset()
        assert fused == 0, name
        expected = fn(*args)
        for got, want in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(out, tuple) else (expected,)):
            assert got.dtype == want.dtype and rel_err(got, want) < 1e-6, name

    monkeypatch.setenv(compile_fusion.ENV, "0")
    out, fused = _fused_when_compiled(lambda x, r: norm(x + r), a.float(), a.float().flip(0))
    assert fused == 0 and rel_err(out, norm(a.float() + a.float().flip(0))) < 1e-6


class Projections(torch.nn.Module):
    """norm(x) feeding `heads` linears of different widths (q, k, v): the norm's grad is their input grads' sum."""

    def __init__(self, norm: torch.nn.Module, heads: int):
        super().__init__()
        self.norm = norm
        n = norm.weight.shape[0]
        self.heads = torch.nn.ModuleList(torch.nn.Linear(n, 16 * (i + 1), bias=False) for i in range(heads))
        with torch.no_grad():
            for p in self.norm.parameters():
                p.normal_()

    def forward(self, x):
        y = self.norm(x)
        return torch.cat([head(y) for head in self.heads], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [True, False])
def test_grad_sum_summed_inside_the_backward(backend, device, dtype, rms):
    """q + k + v's grads reach the norm's backward as three terms (2 adds fused); every grad matches float64 as
    closely as the unfused graph's (bf16: the kernel adds in fp32, the add kernel rounds each sum)."""
    n = 80  # not a power of two
    norm = (shardnorm.RMSNorm(n, eps=1e-5) if rms else shardnorm.LayerNorm(n)).to(device=device, dtype=dtype)
    model = Projections(norm, heads=3).to(device=device, dtype=dtype)
    x = torch.randn(3, 7, n, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 7, 16 * 6, device=device, dtype=dtype)
    params = [x] + list(model.parameters())

    before = compile_fusion.counts["fused_grad_terms"]
    got = torch.autograd.grad(torch.compile(model, fullgraph=True)(x), params, g)
    assert compile_fusion.counts["fused_grad_terms"] - before == 2
    unfused = torch.autograd.grad(model(x), params, g)
    double = [p.detach().double().requires_grad_() for p in params]
    y64 = reference_norm(double[0], double[1], None if rms else double[2], None, norm.eps, rms)
    heads64 = double[2 if rms else 3:]
    want = torch.autograd.grad(torch.cat([y64 @ w.T for w in heads64], dim=-1), double, g.double())
    for i, (got_grad, unfused_grad, want_grad) in enumerate(zip(got, unfused, want)):
        if dtype == torch.float32:
            assert rel_err(got_grad, want_grad) < 1e-5, i
        else:
            assert rel_err(got_grad, want_grad) <= 1.05 * rel_err(unfused_grad, want_grad) + 2e-3, i


@pytest.mark.parametrize("n", [80, 1000, 20000])  # 20000: the long-row kernels, which add the terms first
@pytest.mark.parametrize("terms", [2, 3])
@pytest.mark.parametrize("rms", [True, False])
def test_norm_bwd_op_with_grad_terms(backend, device, grads_path, n, terms, rms):
    """`shardnorm::norm_bwd(dy, ..., dy2, dy3)` is the backward of the grad dy + dy2 (+ dy3), against float64,
    with a weight (and LayerNorm's bias), bf16 rows and fp32 parameters; short rows both ways to dgamma/dbeta
    (`grads_path`)."""
    gen = torch.Generator().manual_seed(n + terms)
    x = torch.randn(6, n, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(n, generator=gen).to(device)
    b = None if rms else torch.randn(n, generator=gen).to(device)
    dys = [torch.randn(6, n, generator=gen).to(device, torch.bfloat16) for _ in range(terms)]
    _, _, mean, rstd = torch.ops.shardnorm.norm_fwd(x, w, b, None, 1e-5, rms, False)
    dx, dw, db = torch.ops.shardnorm.norm_bwd(dys[0], None, x, w, mean, rstd, b is not None, rms, False, *dys[1:])

    double = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    y64 = reference_norm(*double, None, 1e-5, rms)
    want = torch.autograd.grad(y64, [t for t in double if t is not None], sum(dy.double() for dy in dys))
    assert rel_err(dx, want[0]) < 1e-2 and rel_err(dw, want[1]) < 1e-5
    if b is not None:
        assert rel_err(db, want[2]) < 1e-5
    with pytest.raises(ValueError, match="dy2 has shape"):
        torch.ops.shardnorm.norm_bwd(dys[0], None, x, w, mean, rstd, b is not None, rms, False, dys[1][:3])


def test_grad_sum_left_alone_where_it_cannot_go_in(monkeypatch):
    """Not fused, and still right: four terms (the op takes three) and SHARDNORM_COMPILE_FUSION=0."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    x = torch.randn(5, 40, requires_grad=True)
    g = torch.randn(5, 16 * 10)
    for heads, env in ((4, "1"), (3, "0")):
        monkeypatch.setenv(compile_fusion.ENV, env)
        model = Projections(shardnorm.RMSNorm(40), heads=heads)
        before = compile_fusion.counts["fused_grad_terms"]
        got = torch.autograd.grad(torch.compile(model)(x), [x, model.norm.weight], g[:, :8 * heads * (heads + 1)])
        assert compile_fusion.counts["fused_grad_terms"] == before, (heads, env)
        want = torch.autograd.grad(model(x), [x, model.norm.weight], g[:, :8 * heads * (heads + 1)])
        assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, want)), (heads, env)
        torch._dynamo.reset()


def test_hf_trainer_torch_compile(tmp_path, monkeypatch):
    """transformers' own Trainer with `torch_compile=True` after `enable(trainer)`: the residual adds fuse inside
    the model Trainer compiles, and its losses equal the eager Trainer's with the model's own norms (fp32,
    gradient accumulation 2, clipping)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_trainer import STEPS, _args, _losses, _save_tiny_qwen3, _Tokens

    from shardnorm.integrations.transformers import enable

    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    path = tmp_path / "qwen3"
    _save_tiny_qwen3(path, seed=5)
    data = _Tokens(4 * STEPS, seed=6)

    def run(out, compiled: bool, shardnorm_on: bool):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=_args(str(tmp_path / out), 2, 2, torch_compile=compiled),
                                       train_dataset=data)
        if shardnorm_on:
            enable(trainer)
        trainer.train()
        return _losses(trainer)

    before = compile_fusion.counts["fused_adds"]
    compiled = run("compiled", compiled=True, shardnorm_on=True)
    assert compile_fusion.counts["fused_adds"] - before == 4  # 2 layers: post-attention norms, layer 1's, final
    eager = run("eager", compiled=False, shardnorm_on=False)
    assert len(compiled) == len(eager) == STEPS
    for step, (got, want) in enumerate(zip(compiled, eager)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"


def test_reinstalled_after_the_slot_was_reset(monkeypatch):
    """Inductor's slot emptied after an earlier compile (a `config.patch` leaving, or the user): the next trace
    of the op puts the pass back, and the add fuses."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    monkeypatch.setattr(inductor_config, "pre_grad_custom_pass", None)
    model = PreNorm(shardnorm.RMSNorm(32))
    a, b = torch.randn(4, 32), torch.randn(4, 32)
    (y, h), fused = _fused_when_compiled(model, a, b)
    assert fused == 1 and torch.equal(h, a + b) and rel_err(y, model.norm(a + b)) < 1e-6
