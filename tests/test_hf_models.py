"""`shardnorm.convert` on real Hugging Face models: exact, checkpoints unchanged, nothing swapped on a guess.

Every architecture in `hf_tiny.ARCHITECTURES` (tiny random configs, fp32, norm weights moved off
their init so a scale error shows): logits and every parameter grad after `convert` equal the
unconverted model's, the state_dict is identical, and `save_pretrained` -> plain `from_pretrained`
gives the unconverted model back. Every class in shardnorm's table that the installed transformers
defines is checked on its own against the class's own forward, in fp32 and (for the families that
cast differently) in bf16.
"""

import copy
import importlib
import re
import warnings

import pytest
import torch

import shardnorm
from shardnorm import settings
from conftest import rel_err
from hf_tiny import ARCHITECTURES, HIDDEN, batch, tiny_model
from shardnorm.conversion import NormWrapperError, convert_module, wrappers_of
from shardnorm.norm_families import FLOAT32_SCALE_EPS, KNOWN, LLAMA, lookup

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# architectures whose only norms shardnorm cannot express: what is left alone, and why
LEFT_ALONE = {"olmo": "OlmoLayerNorm", "qwen3_next": "Qwen3NextRMSNormGated"}


def _norm_count(model) -> int:
    """How many modules shardnorm's table (or torch's own norm classes) covers, counted without convert."""
    return sum(lookup(m) is not None and getattr(m, "with_scale", True) for m in model.modules())


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_convert_is_exact_on_hf_architecture(model_type, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    settings.reload()  # read once per process
    model = tiny_model(model_type, seed=len(model_type))
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _norm_count(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = shardnorm.convert(model)
    model, count = result
    assert count == expected and count == len(result.converted)
    assert count == sum(isinstance(m, (shardnorm.RMSNorm, shardnorm.LayerNorm)) for m in model.modules())
    left = {s.cls for s in result.skipped}
    assert left == ({LEFT_ALONE[model_type]} if model_type in LEFT_ALONE else set()), result.skipped
    assert bool(left) == any("left" in str(w.message) and LEFT_ALONE.get(model_type, "?") in str(w.message)
                             for w in caught)
    if model_type != "olmo":
        assert count > 0
    assert all(p is params[n] for n, p in model.named_parameters()), "convert must keep the Parameter objects"

    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], state[k]) for k in state), "state_dict values changed"

    inputs = batch(model, seed=1)
    want_logits, want_grads = _loss_and_grads(reference, inputs)
    got_logits, got_grads = _loss_and_grads(model, inputs)
    assert rel_err(got_logits, want_logits) <= TOL
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert rel_err(got_grads[name], want) <= TOL, f"{model_type}: grad of {name}"

    model.save_pretrained(tmp_path)
    auto = type(reference)
    reloaded = auto.from_pretrained(tmp_path).float().eval()
    assert not any(isinstance(m, (shardnorm.RMSNorm, shardnorm.LayerNorm)) for m in reloaded.modules())
    with torch.no_grad():
        assert rel_err(reloaded(**inputs).logits, want_logits) <= TOL


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_converted_decoder_matches_unconverted(arch):
    """torch.compile of a converted decoder (the norms traced as shardnorm's ops; Gemma's 1 + weight): logits
    and every parameter grad equal the unconverted model's in eager, fp32. (Qwen3 compiled: test_hf_trainer.py.)"""
    reference = tiny_model(arch, seed=3)
    model = shardnorm.convert(copy.deepcopy(reference)).model
    inputs = batch(reference, seed=4)
    expected = reference(**inputs)
    expected.loss.backward()
    torch._dynamo.reset()
    got = torch.compile(model)(**inputs)
    got.loss.backward()
    torch._dynamo.reset()
    assert rel_err(got.logits, expected.logits) < TOL
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, q.grad) < TOL, name


def test_convert_through_the_triton_kernels(triton_backend):
    """Gemma (scale 1 + weight) with the Triton kernels (interpreted on CPU without a GPU)."""
    model = tiny_model("gemma", seed=3).to(triton_backend)
    reference = copy.deepcopy(model)
    model, count = shardnorm.convert(model)
    assert count == _norm_count(reference) > 0
    inputs = {k: v.to(triton_backend) for k, v in batch(model, seed=4, rows=1, seq=4).items()}
    want_logits, want_grads = _loss_and_grads(reference, inputs)
    got_logits, got_grads = _loss_and_grads(model, inputs)
    assert rel_err(got_logits, want_logits) <= TOL
    for name, want in want_grads.items():
        assert rel_err(got_grads[name], want) <= TOL, name


# ---- every class in the table, on its own, against its own forward -------------------------------------


def _installed_table_classes() -> list:
    """(name, class) for every class in shardnorm's table that the installed transformers defines."""
    import inspect
    import pkgutil

    import transformers.models as models

    found = {}
    for pkg in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{pkg.name}.modeling_{pkg.name}")
        except Exception:  # noqa: BLE001 - a model package without (importable) modeling code
            continue
        for name, cls in vars(module).items():
            if name in KNOWN and inspect.isclass(cls) and cls.__module__ == module.__name__:
                found.setdefault(name, cls)
    return sorted(found.items())


def _instance(cls):
    for kwargs in ({}, {"eps": 1e-5}):
        for args in ((HIDDEN,), ()):
            try:
                return cls(*args, **kwargs) if args else cls(hidden_size=HIDDEN, **kwargs)
            except TypeError:
                continue
    raise TypeError(f"cannot build {cls.__name__}")


@pytest.fixture(scope="module")
def table_classes():
    classes = _installed_table_classes()
    assert len(classes) >= 150, f"only {len(classes)} of the table's {len(KNOWN)} classes found in transformers"
    return classes


def test_every_table_class_matches_its_own_forward(table_classes, monkeypatch):
    """fp32, hidden 64 and 40: output, input grad and weight/bias grads of each class vs. the converted module."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    settings.reload()  # read once per process
    failures = []
    for name, cls in table_classes:
        hf = _instance(cls)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.5 * torch.randn_like(p))
        new = convert_module(hf, name=name)
        if new is None:
            failures.append(f"{name}: not converted")
            continue
        x = torch.randn(3, 5, HIDDEN, requires_grad=True)
        dy = torch.randn(3, 5, HIDDEN)
        grads = []
        for m in (hf, new):
            y = m(x)
            grads.append((y, *torch.autograd.grad(y, [x, *m.parameters()], dy)))
        for want, got in zip(*grads):
            if rel_err(got, want) > TOL:
                failures.append(f"{name}: rel err {rel_err(got, want):.2e}")
    assert not failures, failures


@pytest.mark.parametrize("model_type", ["llama", "gemma", "olmo2", "t5"])
def test_bf16_within_bf16_rounding_of_hf(model_type, monkeypatch):
    """bf16: HF Llama/T5 round the normalized x to bf16 before scaling, Gemma/OLMo2 scale in fp32; shardnorm
    scales in fp32 and rounds once. Its output is within bf16 rounding of the HF module's, and at least as
    close to the float64 result."""
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    settings.reload()  # read once per process
    model = tiny_model(model_type, seed=5)
    hf = next(m for m in model.modules() if lookup(m) is not None)
    hf = copy.deepcopy(hf).to(torch.bfloat16)
    new = convert_module(copy.deepcopy(hf))
    x = (3 * torch.randn(64, HIDDEN)).to(torch.bfloat16)
    y_hf, y_new = hf(x), new(x)
    assert y_new.dtype == y_hf.dtype == torch.bfloat16
    family = lookup(hf)
    xd, w = x.double(), hf.weight.double() + (1 if family.zero_centered_gamma else 0)
    exact = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + getattr(hf, family.eps_attr)) * w
    assert rel_err(y_new, y_hf) <= 2 ** -7, "beyond bf16 rounding of the HF module"
    assert rel_err(y_new, exact) <= rel_err(y_hf, exact) * 1.05 + 1e-6


def test_t5_in_fp16_with_its_fp32_feed_forward_output(tmp_path, monkeypatch):
    """transformers loads T5 in fp16 with `wo` kept in fp32 (`_keep_in_fp32_modules`): x reaches the norms in fp32,
    and T5's norm returns its fp16 weight's dtype for the fp16 layers after it. A converted T5 does the same
    (`NormFamily.half_weight_output`): the model runs, with the unconverted model's loss and grads."""
    import transformers

    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    settings.reload()
    tiny_model("t5", seed=4).save_pretrained(tmp_path)
    models = [transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float16) for _ in range(2)]
    assert models[0].encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    shardnorm.convert(models[1])
    inputs = batch(models[0], seed=4)
    losses = []
    for model in models:
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss)
    assert rel_err(losses[1], losses[0]) <= 1e-3
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        # fp16 grads are 2-4e-2 from float64's with T5's own norms. The farthest here (5.6e-2 against float64: the last
        # decoder block's feed-forward norm and wi) come from one ReLU input of 1536 near zero (1.3e-3 in float64)
        # whose sign the fp16 rounding flips: T5 rounds x to fp16 before the scale, shardnorm scales in fp32
        assert p.grad.dtype == q.grad.dtype and rel_err(q.grad.float(), p.grad.float()) <= 8e-2, name


# ---- what convert leaves alone or refuses -------------------------------------------------------------


def test_unknown_and_mismatched_norms_are_left_alone_and_reported():
    class MyRMSNorm(torch.nn.Module):  # a name that ends in RMSNorm, a forward shardnorm cannot know
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(HIDDEN))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight * 2

    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    model = torch.nn.Sequential(MyRMSNorm(), CohereLayerNorm((4, 16)), Gemma3nRMSNorm(HIDDEN, with_scale=False),
                                torch.nn.LayerNorm(HIDDEN))
    x = torch.randn(2, HIDDEN)
    with pytest.warns(UserWarning, match="MyRMSNorm"):
        result = shardnorm.convert(model)
    assert result.count == 1 and result.converted == ["3"]
    reasons = {s.cls: s.reason for s in result.skipped}
    assert set(reasons) == {"MyRMSNorm", "CohereLayerNorm", "Gemma3nRMSNorm"}
    assert "table" in reasons["MyRMSNorm"] and "shape [4, 16]" in reasons["CohereLayerNorm"]
    assert "with_scale=False" in reasons["Gemma3nRMSNorm"]
    assert type(model[0]) is MyRMSNorm and torch.equal(model[0](x), x * model[0].weight * 2)

    # the explicit opt-in converts a user's own class
    class OwnRMSNorm(MyRMSNorm):
        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (HIDDEN,), self.weight, self.eps)

    own = OwnRMSNorm()
    new, count = shardnorm.convert(torch.nn.Sequential(own), extra={OwnRMSNorm: FLOAT32_SCALE_EPS})
    assert count == 1 and new[0].weight is own.weight and rel_err(new[0](x), own(x)) <= TOL


def test_nothing_to_convert_warns():
    with pytest.warns(UserWarning, match="no norm to convert in Linear"):
        assert shardnorm.convert(torch.nn.Linear(4, 4)).count == 0


def test_wrapped_norms_are_refused_naming_the_module():
    """HF tp_plan's replicated_with_grad_allreduce (its own install_forward: an instance forward that hooks the
    grad all-reduce in transformers 5.23, a module backward hook in 5.17), module hooks: refused, never dropped."""
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    model = tiny_model("qwen3", seed=6)
    q_norm = model.model.layers[1].self_attn.q_norm
    ReplicatedWithGradAllReduce().install_forward(q_norm, mesh=None)
    found = wrappers_of(q_norm)
    assert len(found) == 1 and "ReplicatedWithGradAllReduce.install_forward" in found[0], found
    with pytest.raises(NormWrapperError, match=r"model\.layers\.1\.self_attn\.q_norm \(Qwen3RMSNorm\) carries "
                       + re.escape(found[0])):
        shardnorm.convert(model)
    q_norm = tiny_model("qwen3", seed=6).model.layers[1].self_attn.q_norm
    handle = q_norm.register_forward_hook(lambda m, a, y: y)
    with pytest.raises(NormWrapperError, match="forward hook"):
        convert_module(q_norm, name="q_norm")
    handle.remove()
    assert wrappers_of(q_norm) == [] and isinstance(convert_module(q_norm), shardnorm.RMSNorm)
    assert lookup(q_norm) is LLAMA


def _dtensor_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from spawn_ranks import DEVICE, rank_device

    norm = torch.nn.RMSNorm(HIDDEN, device=rank_device(rank))
    mesh = init_device_mesh(DEVICE, (world_size,))
    norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]))
    assert any("DTensor parameter 'weight'" in w for w in wrappers_of(norm))
    with pytest.raises(NormWrapperError, match=r"blocks\.0 \(RMSNorm\).*DTensor"):
        shardnorm.convert(torch.nn.ModuleDict({"blocks": torch.nn.Sequential(norm)}))


@pytest.mark.distributed
def test_dtensor_parameters_are_refused():
    from spawn_ranks import spawn

    spawn(_dtensor_body, 1)


def test_deepspeed_zero_centered_gamma_keeps_gemma_checkpoints_and_warns_for_llama():
    """The DeepSpeed section's `zero_centered_gamma` stores weight - 1. Gemma norms already scale by 1 + weight:
    left as they are (state_dict unchanged, no warning). A Llama's weights are shifted: warned about."""
    from shardnorm.integrations.deepspeed_config import parse_section
    from shardnorm.integrations.deepspeed_conversion import convert_norms

    section = parse_section({"zero_centered_gamma": True})
    gemma = tiny_model("gemma", seed=7)
    state = {k: v.clone() for k, v in gemma.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemma, count = convert_norms(gemma, section)
    assert count > 0 and all(torch.equal(v, state[k]) for k, v in gemma.state_dict().items())
    llama = tiny_model("llama", seed=7)
    with pytest.warns(UserWarning, match="no longer plain Hugging Face"):
        convert_norms(llama, section)
