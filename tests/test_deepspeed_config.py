"""The "shardnorm" DeepSpeed config section: validation, the shipped configs, apply()."""

import json

import pytest
import torch

import shardnorm
import shardnorm.integrations.deepspeed as sd
from deepspeed_harness import CONFIGS, load_config, norm_model
from shardnorm.integrations.deepspeed_config import ShardnormSection

SHIPPED = sorted(p.name for p in CONFIGS.glob("zero*.json"))  # hf_*.json: "auto" values, run by test_docs_examples


@pytest.mark.parametrize("section, key", [
    ({"enable": True}, "shardnorm.enable"),
    ({"enabled": 1}, "shardnorm.enabled"),
    ({"enabled": "yes"}, "shardnorm.enabled"),
    ({"replace": "LayerNorm"}, "shardnorm.replace"),
    ({"replace": []}, "shardnorm.replace"),
    ({"replace": ["LayerNorm", "LayerNorm"]}, "shardnorm.replace"),
    ({"replace": ["LayerNorm", 3]}, "shardnorm.replace[1]"),
    ({"replace": ["torch.nn.LayerNorm"]}, "shardnorm.replace[0]"),
    ({"zero_centered_gamma": "false"}, "shardnorm.zero_centered_gamma"),
    ({"grad_reduce": "per_layer"}, "shardnorm.grad_reduce"),
    ({"grad_reduce": None}, "shardnorm.grad_reduce"),
    ({"bucket_cap_mb": 0}, "shardnorm.bucket_cap_mb"),
    ({"bucket_cap_mb": -1.5}, "shardnorm.bucket_cap_mb"),
    ({"bucket_cap_mb": True}, "shardnorm.bucket_cap_mb"),
    ({"bucket_cap_mb": "25"}, "shardnorm.bucket_cap_mb"),
    ({"bucket_cap_mb": float("nan")}, "shardnorm.bucket_cap_mb"),
    ({"bucket_cap_mb": float("inf")}, "shardnorm.bucket_cap_mb"),
    (["enabled"], "shardnorm"),
    (True, "shardnorm"),
])
def test_bad_section_names_its_key(section, key):
    with pytest.raises(sd.ShardnormConfigError) as err:
        sd.read_section({"train_micro_batch_size_per_gpu": 1, "shardnorm": section})
    assert err.value.key == key and str(err.value).startswith(f"{key}: ")


def test_defaults_and_values():
    assert sd.parse_section({}) == ShardnormSection()
    section = sd.parse_section({"replace": ["LayerNorm", "*RMSNorm"], "zero_centered_gamma": True,
                                "grad_reduce": "deepspeed", "bucket_cap_mb": 0.5})
    assert section.replace == ("LayerNorm", "*RMSNorm") and section.zero_centered_gamma
    assert section.grad_reduce == "deepspeed" and section.bucket_cap_mb == 0.5


def test_bad_config_argument():
    with pytest.raises(sd.ShardnormConfigError, match=r"^config: "):
        sd.apply(torch.nn.LayerNorm(4), "/no/such/config.json")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_round_trip(name, tmp_path):
    """Each configs/deepspeed file: valid section, same section after a JSON round trip, and DeepSpeed
    itself accepts the whole file (it ignores the top-level "shardnorm" section)."""
    config = load_config(name)
    section = sd.read_section(CONFIGS / name)
    assert section is not None and section == sd.parse_section(config["shardnorm"])
    copy = tmp_path / name
    copy.write_text(json.dumps(config))
    assert sd.read_section(str(copy)) == section
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer"):
        assert key in config, f"{name} lacks {key}"
    assert config["optimizer"]["type"] == "AdamW" and not config.get("bf16", {}).get("enabled", False)
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(config)
    assert ds.zero_optimization_stage == int(name[len("zero")]) and ds.gradient_accumulation_steps == 2


def _norm_classes(model):
    return [type(m) for m in model.modules() if "Norm" in type(m).__name__]


def test_apply_converts_and_keeps_parameters():
    model = norm_model(0)
    before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(5, 8)
    expected = model(x)
    assert sd.apply(model, load_config("zero2.json")) is model
    assert _norm_classes(model) == [shardnorm.LayerNorm, shardnorm.RMSNorm, shardnorm.RMSNorm, shardnorm.RMSNorm]
    assert all(p is before[name] for name, p in model.named_parameters())
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_apply_replace_and_zero_centered_gamma():
    model = norm_model(0)
    x = torch.randn(5, 8)
    expected = model(x)
    sd.apply(model, {"shardnorm": {"replace": ["LlamaRMSNorm"], "zero_centered_gamma": True}})
    norms = [m for m in model.modules() if isinstance(m, shardnorm.RMSNorm)]
    assert len(norms) == 2 and isinstance(model[1], torch.nn.LayerNorm) and isinstance(model[4], torch.nn.RMSNorm)
    assert all(m.zero_centered_gamma for m in norms)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_zero_centered_gamma_names_an_ungatherable_zero3_param():
    """A ZeRO-3 parameter DeepSpeed cannot gather (here: marked partitioned, but no partitioning state) is a
    clear error naming the module, and the weight is left as it was."""
    pytest.importorskip("deepspeed")
    model = norm_model(0)
    weight = model[4].weight
    weight.ds_id, weight.ds_shape = 0, tuple(weight.shape)
    before = weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"could not gather the ZeRO-3 parameter 4\.weight \(full shape \(16,\)\)"):
        sd.apply(model, {"shardnorm": {"zero_centered_gamma": True}})
    assert torch.equal(weight.detach(), before)


@pytest.mark.parametrize("config", [{}, {"shardnorm": {"enabled": False, "replace": ["LayerNorm"]}}])
def test_absent_or_disabled_leaves_model_untouched(config):
    model = norm_model(0)
    classes = _norm_classes(model)
    assert sd.apply(model, config) is model and _norm_classes(model) == classes


def test_disabled_section_is_still_validated():
    with pytest.raises(sd.ShardnormConfigError, match=r"^shardnorm\.bucket_cap_mb: "):
        sd.apply(norm_model(0), {"shardnorm": {"enabled": False, "bucket_cap_mb": 0}})


def test_convert_model_reads_a_config_path_as_its_dict(tmp_path):
    """`integrations.transformers.convert_model(model, deepspeed_config=PATH)` follows the file's "shardnorm" section
    as `apply` and a dict do (a search of the path's string for the word "shardnorm" would ignore the section)."""
    from shardnorm.integrations.transformers import convert_model

    path = tmp_path / "zero2.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "shardnorm": {"enabled": False}}))
    model = norm_model(0)
    classes = _norm_classes(model)
    convert_model(model, deepspeed_config=str(path))
    assert _norm_classes(model) == classes  # the section turns conversion off
