"""`convert` and the DeepSpeed section on the models that trip them: aliases, buffers, typos, dtypes where
`zero_centered_gamma`'s weight - 1 rounds, errors that must leave the model as it was, torch.func transforms,
meta tensors, and the log/warnings that say what happened."""

import copy
import logging

import pytest
import torch
from torch import nn

import shardnorm
import shardnorm.integrations.deepspeed as sd
from shardnorm.conversion import NormWrapperError, convert_module


def _seeded(seed: int) -> torch.Generator:
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def _shardnorm_norms(model):
    return [m for m in model.modules() if isinstance(m, (shardnorm.LayerNorm, shardnorm.RMSNorm))]


# ---- zero_centered_gamma: the same function bit for bit, or a refusal before anything changes ----------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zero_centered_gamma_refuses_weights_whose_shift_rounds(dtype):
    """weight - 1 rounds in the weight's dtype (bf16: 0.01 -> scale 0.0117, 0.3 -> 0.3008): refused, naming the key and
    the dtype, with the model unchanged (still torch's norm, weights bitwise the same)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 4)).to(dtype)
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.01, 0.1, 0.3, 1.7], dtype=torch.float64).to(dtype))
    before = model[1].weight.detach().clone()
    with pytest.raises(sd.ShardnormConfigError) as err:
        sd.apply(model, {"shardnorm": {"zero_centered_gamma": True}})
    assert err.value.key == "shardnorm.zero_centered_gamma"
    assert str(dtype) in str(err.value) and "1.weight" in str(err.value)
    assert type(model[1]) is nn.RMSNorm and torch.equal(model[1].weight, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zero_centered_gamma_keeps_the_function_bitwise(dtype):
    """Weights whose shift is exact (here within [0.5, 2], Sterbenz): output and every grad bitwise those of the
    model converted without the option."""
    g = _seeded(11)

    def model_and_output(zero_centered: bool):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.RMSNorm(16), nn.Linear(16, 4)).to(dtype)
        with torch.no_grad():
            for norm in (model[1], model[2]):
                norm.weight.copy_(torch.empty(16, dtype=torch.float64).uniform_(0.5, 2.0, generator=gen).to(dtype))
        sd.apply(model, {"shardnorm": {"zero_centered_gamma": zero_centered}})
        assert all(m.zero_centered_gamma == zero_centered for m in _shardnorm_norms(model))
        y = model(x)
        y.backward(dy)
        return y, [p.grad for p in model.parameters()], model

    x = torch.randn(6, 16, generator=g).to(dtype)
    dy = torch.randn(6, 4, generator=g).to(dtype)
    gen = torch.Generator().manual_seed(12)
    y_plain, grads_plain, _ = model_and_output(False)
    gen = torch.Generator().manual_seed(12)
    y_zc, grads_zc, model = model_and_output(True)
    assert torch.equal(y_plain, y_zc)
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_zc))



class GemmaRMSNorm(nn.Module):
    """A model's own copy of Gemma's norm (matched by class name): scale 1 + weight, stored weight unchanged."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(n))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class TiedNorms(nn.Module):
    """Norms between two Linears, `b` sharing `a`'s weight Parameter (tied, as in weight-shared blocks);
    `alias`: `b` also registered as `c`, so one Parameter is reached through two modules and three names."""

    def __init__(self, a: nn.Module, b: nn.Module, alias: bool = False):
        super().__init__()
        self.proj, self.a, self.b, self.head = nn.Linear(8, 8), a, b, nn.Linear(8, 8)
        if alias:
            self.c = self.b
        self.order = ("a", "b", "c") if alias else ("a", "b")

    def forward(self, x):
        h = self.proj(x)
        for name in self.order:
            h = getattr(self, name)(h) * 3  # the scale makes a wrong weight show at full size in the output
        return self.head(h)


def _tied(a: nn.Module, b: nn.Module, g: torch.Generator, alias: bool = False) -> TiedNorms:
    model = TiedNorms(a, b, alias)
    with torch.no_grad():
        a.weight.copy_(torch.empty(8).uniform_(0.5, 2.0, generator=g))  # weight - 1 exact in fp32
    b.weight = a.weight
    return model


TIED = {  # the norms, and whether `a` is a shardnorm norm already (zero_centered_gamma off) before apply
    "torch_rms_norms": (lambda g: _tied(nn.RMSNorm(8), nn.RMSNorm(8), g), False),
    "layer_norm_and_rms_norm": (lambda g: _tied(nn.LayerNorm(8), nn.RMSNorm(8), g), False),
    "converted_and_torch": (lambda g: _tied(nn.RMSNorm(8), nn.RMSNorm(8), g), True),
    "two_modules_three_names": (lambda g: _tied(nn.RMSNorm(8), nn.RMSNorm(8), g, alias=True), False),
}


@pytest.mark.parametrize("case", list(TIED))
def test_zero_centered_gamma_shifts_a_tied_weight_once(case):
    """Norms sharing one weight Parameter: it is stored as weight - 1 once (not once per module, which left
    weight - 2 and moved the output by up to 6), every norm holding it reads 1 + weight, and the output is the
    unconverted model's, checked against float64 on fresh data."""
    g = _seeded(31)
    build, a_converted = TIED[case]
    model = build(g)
    reference = copy.deepcopy(model).double()  # torch's norms in float64
    if a_converted:
        model.a = convert_module(model.a, name="a")
    weight = model.a.weight
    before = weight.detach().clone()
    x = torch.randn(5, 8, generator=g)
    expected = model(x)
    sd.apply(model, {"shardnorm": {"zero_centered_gamma": True}})
    assert model.a.weight is weight and model.b.weight is weight
    assert torch.equal(weight.detach(), before - 1)
    assert len(_shardnorm_norms(model)) == 2 and all(m.zero_centered_gamma for m in _shardnorm_norms(model))
    fresh = torch.randn(7, 8, generator=g)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(fresh).double(), reference(fresh.double()), rtol=1e-5, atol=1e-5)


SHARED = {  # a norm's weight also held by something zero_centered_gamma does not re-centre, and its name
    "linear_bias": (lambda g: _share(g, "head", "bias"), None, "head.bias (Linear)"),
    "unconverted_norm": (lambda g: _tied(nn.RMSNorm(8), nn.LayerNorm(8), g), ["RMSNorm"], "b.weight (LayerNorm)"),
    "zero_centered_norm": (lambda g: _tied(nn.RMSNorm(8), shardnorm.RMSNorm(8, zero_centered_gamma=True), g), None,
                           "b.weight (RMSNorm)"),
    "gemma_norm": (lambda g: _tied(nn.RMSNorm(8), GemmaRMSNorm(8), g), None, "b.weight (GemmaRMSNorm)"),
    "norm_bias": (lambda g: _share(g, "b", "bias"), None, "b.bias (LayerNorm)"),
}


def _share(g: torch.Generator, owner: str, attr: str) -> TiedNorms:
    model = TiedNorms(nn.RMSNorm(8), nn.LayerNorm(8))
    with torch.no_grad():
        model.a.weight.copy_(torch.empty(8).uniform_(0.5, 2.0, generator=g))
    setattr(getattr(model, owner), attr, model.a.weight)
    return model


@pytest.mark.parametrize("case", list(SHARED))
def test_zero_centered_gamma_refuses_a_weight_shared_with_what_it_does_not_shift(case):
    """Storing weight - 1 would change the math of everything else holding that Parameter (a Linear's bias, a norm
    not converted, one already scaling by 1 + weight, a bias slot): refused, naming the weight and its other
    holder, with the model unchanged."""
    g = _seeded(41)
    build, replace, holder = SHARED[case]
    model = build(g)
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8, generator=g)
    expected = model(x)
    section = {"zero_centered_gamma": True} | ({"replace": replace} if replace else {})
    with pytest.raises(sd.ShardnormConfigError) as err:
        sd.apply(model, {"shardnorm": section})
    assert err.value.key == "shardnorm.zero_centered_gamma"
    assert "a.weight is the same Parameter as " + holder in str(err.value)
    assert "Nothing was converted" in str(err.value)
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(x), expected)


def test_convert_keeps_each_norms_math_on_a_weight_shared_across_families():
    """`convert` never rewrites weights: a Gemma-style norm (1 + weight) and a torch RMSNorm (weight) sharing one
    Parameter each keep their own function, the stored weight unchanged."""
    g = _seeded(51)
    model = _tied(GemmaRMSNorm(8), nn.RMSNorm(8), g)
    before = model.a.weight.detach().clone()
    x = torch.randn(5, 8, generator=g)
    expected = model(x)
    assert shardnorm.convert(model).count == 2
    assert model.a.zero_centered_gamma and not model.b.zero_centered_gamma and model.a.weight is model.b.weight
    assert torch.equal(model.a.weight.detach(), before)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)

class QKNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.q_norm = nn.RMSNorm(4)

    def forward(self, x):
        return self.q_norm(self.q_proj(x).unflatten(-1, (2, 4))).flatten(-2)


def test_apply_refuses_autotp_step_before_converting():
    """`"grad_reduce": "step"` under AutoTP through apply(): the error comes before the model changes (no conversion,
    no weight - 1 rewrite), so the model is left as the user had it."""
    pytest.importorskip("deepspeed")
    model = nn.Sequential(QKNorm(), nn.LayerNorm(8))
    weights = [p.detach().clone() for p in model.parameters()]
    config = {"tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*q_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True}]}},
        "shardnorm": {"zero_centered_gamma": True, "grad_reduce": "step"}}
    with pytest.raises(sd.ShardnormConfigError) as err:
        sd.apply(model, config)
    assert err.value.key == "shardnorm.grad_reduce"
    assert not _shardnorm_norms(model)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


# ---- convert: aliases, buffers, class names, all or nothing -------------------------------------------------

class AliasedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.final_norm = self.norm  # one module under two names

    def forward(self, x):
        return self.final_norm(self.norm(self.proj(x)))


@pytest.mark.parametrize("section", [None, {"zero_centered_gamma": True}])
def test_alias_stays_one_module(section):
    g = _seeded(21)
    model = AliasedNorm()
    with torch.no_grad():
        model.norm.weight.copy_(torch.empty(8).uniform_(0.5, 2.0, generator=g))
    x = torch.randn(3, 8, generator=g)
    expected = model(x)
    if section is None:
        result = shardnorm.convert(model)
        assert result.count == 1 and result.converted == ["norm"]
    else:
        sd.apply(model, {"shardnorm": section})
    assert isinstance(model.norm, shardnorm.RMSNorm) and model.final_norm is model.norm
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)


def test_torch_norm_buffers_move_over():
    """Buffers registered on a torch norm keep their state_dict keys, values and persistence."""
    model = nn.Sequential(nn.LayerNorm(8))
    model[0].register_buffer("calibration", torch.arange(8.0))
    model[0].register_buffer("scratch", torch.zeros(2), persistent=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shardnorm.convert(model)
    assert isinstance(model[0], shardnorm.LayerNorm)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model[0].scratch, torch.zeros(2))


def test_torch_norm_with_submodules_is_left_alone_and_reported():
    model = nn.Sequential(nn.LayerNorm(8))
    model[0].add_module("probe", nn.Identity())
    with pytest.warns(UserWarning, match="submodules"):
        result = shardnorm.convert(model)
    assert result.count == 0 and type(model[0]) is nn.LayerNorm and result.skipped[0].name == "0"


@pytest.mark.parametrize("classes, bad", [(["LlamaRMSNrom"], "LlamaRMSNrom"), (["LayerNorm", "*RMSNrom"], "*RMSNrom")])
def test_unknown_class_names_raise(classes, bad):
    model = nn.Sequential(nn.LayerNorm(8))
    with pytest.raises(ValueError, match=f"'{bad.replace('*', '[*]')}'"):
        shardnorm.convert(model, classes)
    assert type(model[0]) is nn.LayerNorm
    with pytest.raises(sd.ShardnormConfigError, match="did you mean") as err:
        sd.read_section({"shardnorm": {"replace": classes}})
    assert err.value.key == f"shardnorm.replace[{classes.index(bad)}]"


def test_known_and_extra_class_names_pass():
    class MyNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(8)), 1e-6

    model = nn.Sequential(MyNorm(), nn.LayerNorm(8))
    result = shardnorm.convert(model, ["MyNorm", "*LayerNorm"], extra={MyNorm: shardnorm.norm_families.LLAMA4})
    assert result.count == 2
    assert sd.parse_section({"replace": ["*RMSNorm", "T5LayerNorm", "LayerNorm"]}).replace is not None


def test_refused_module_leaves_the_model_unconverted():
    """A hooked norm after a plain one: NormWrapperError, and the plain one was not swapped either."""
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8))
    model[1].register_forward_hook(lambda *args: None)
    with pytest.raises(NormWrapperError):
        shardnorm.convert(model)
    assert type(model[0]) is nn.LayerNorm and type(model[1]) is nn.RMSNorm


# ---- what happened is said --------------------------------------------------------------------------------

def test_convert_logs_what_it_converted(caplog):
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.RMSNorm(8))
    with caplog.at_level(logging.INFO, logger="shardnorm"):
        shardnorm.convert(model)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("shardnorm")]
    assert any("converted 2 norm module(s)" in m and "0, 2" in m for m in messages), messages


@pytest.mark.parametrize("name", ["shard_norm", "ShardNorm", "shardnrom", "shardnorms"])
def test_near_miss_section_name_warns(name):
    model = nn.Sequential(nn.LayerNorm(8))
    with pytest.warns(UserWarning, match=f"no \"shardnorm\" section but has '{name}'"):
        assert sd.apply(model, {"zero_optimization": {"stage": 2}, name: {"enabled": True}}) is model
    assert type(model[0]) is nn.LayerNorm


@pytest.mark.parametrize("name", ["shard_norm", "ShardNorm"])
def test_transformers_adapter_warns_on_a_near_miss_section(name):
    """convert_model / enable(trainer) read the DeepSpeed config too: a misspelled section is named there."""
    pytest.importorskip("transformers")
    from shardnorm.integrations.transformers import convert_model

    model = nn.Sequential(nn.LayerNorm(8))
    config = {"zero_optimization": {"stage": 2}, name: {"enabled": False}}
    with pytest.warns(UserWarning, match=f"no \"shardnorm\" section but has '{name}'"):
        assert convert_model(model, deepspeed_config=config) is model
    assert type(model[0]) is shardnorm.LayerNorm  # no section: the defaults convert


def test_unrelated_sections_do_not_warn(recwarn):
    sd.apply(nn.Sequential(nn.LayerNorm(8)), {"zero_optimization": {"stage": 2}, "sparse_attention": {},
                                               "tensor_parallel": {}, "steps_per_print": 1})
    assert not [w for w in recwarn if "section" in str(w.message)]


# ---- torch.func, forward-mode AD, meta tensors ----------------------------------------------------------------

TRANSFORMS = {
    "vmap": (lambda f, x: torch.func.vmap(f)(x.unsqueeze(1)), "torch.func.vmap"),
    "grad": (lambda f, x: torch.func.grad(lambda t: f(t).sum())(x), "torch.func.grad"),
    "jacrev": (lambda f, x: torch.func.jacrev(f)(x), "jacrev"),
    "jvp": (lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)), "torch.func.jvp"),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_torch_func_transforms_raise_naming_the_transform(backend, device, transform):
    run, named = TRANSFORMS[transform]
    norm = shardnorm.RMSNorm(8, device=device)
    x = torch.randn(3, 8, generator=_seeded(31)).to(device)
    with pytest.raises(NotImplementedError, match=named) as err:
        run(norm, x)
    assert "torch.nn.functional" in str(err.value)


def test_forward_mode_ad_raises_clearly(backend, device):
    import torch.autograd.forward_ad as fwAD

    norm = shardnorm.LayerNorm(8, device=device)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD") as err:
        norm(fwAD.make_dual(torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)))
    assert "torch.nn.functional" in str(err.value)


@pytest.mark.parametrize("residual", [False, True])
def test_meta_tensors_with_triton_backend(triton_backend, residual):
    """SHARDNORM_BACKEND=triton on meta tensors: shapes and dtypes through forward and backward."""
    norm = shardnorm.LayerNorm(8, device="meta")
    x = torch.empty(3, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = norm(x, residual=torch.empty_like(x)) if residual else norm(x)
    y = out[0] if residual else out
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == x.shape and norm.weight.grad.shape == (8,) and norm.bias.grad.shape == (8,)


def test_accelerate_dispatched_model_is_refused_naming_the_hook():
    """A model dispatched by Accelerate (device_map, offload): its norms carry Accelerate's device hook, whose
    per-instance forward has the class forward's name; the error names the hook and the order that works (it named
    the norm's own forward and pointed at tensor parallelism)."""
    accelerate = pytest.importorskip("accelerate")
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    accelerate.dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)
    with pytest.raises(NormWrapperError, match="Accelerate's device hook .*convert it before dispatching"):
        shardnorm.convert(model)


def test_a_float64_norm_is_left_alone_with_the_reason():
    """shardnorm's norms take float32, bfloat16 and float16: a float64 norm converted would fail at its first
    forward, so convert leaves it alone, says why, and the model runs as it did (against a copy never converted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).double()
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="left 1 norm module.*LayerNorm x1: its parameters are float64, and "
                                         "shardnorm's norms take float32"):
        result = shardnorm.convert(model)
    assert result.count == 0 and type(model[1]) is torch.nn.LayerNorm
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(model(x), reference(x))
