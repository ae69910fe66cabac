"""torch.compile folds the residual add in front of a shardnorm norm into the norm's op (compile_fusion.py):
on real Hugging Face decoders, on the Triton kernels, exactly in the forward, and never where it would change
a result."""

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
