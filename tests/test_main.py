"""`python -m shardnorm`: the environment report, as a user runs it, and with `--model` what `convert` would convert."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardnorm

ROOT = Path(__file__).resolve().parents[1]
HUNG_S = 600  # for a hung process, not a slow one: the report takes seconds


def report(*args: str, status: int = 0, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           **env_vars}
    result = subprocess.run([sys.executable, "-m", "shardnorm", *args], cwd=ROOT, env=env, text=True,
                            capture_output=True, timeout=HUNG_S)
    assert result.returncode == status, result.stderr[-3000:]
    return result


def test_report_names_versions_device_and_settings():
    lines = report(SHARDNORM_BACKEND="torch").stdout.splitlines()
    fields = {line.split()[0]: line.split(None, 1)[1] for line in lines if not line.startswith(" ")}
    assert fields["torch"].startswith(torch.__version__)
    assert fields["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert {"triton", "transformers", "deepspeed", "GPU", "SHARDNORM_BACKEND"} <= set(fields)
    assert fields["GPU"].startswith("cuda:0" if torch.cuda.is_available() else "no GPU")
    assert fields["SHARDNORM_BACKEND"] == "torch"
    assert "backend=torch" in next(line for line in lines if line.startswith("settings in effect"))


def test_model_lists_what_convert_would_convert(tmp_path):
    """A local config dir (no weights: the model is built on the meta device)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    config.save_pretrained(tmp_path)
    out = report("--model", str(tmp_path)).stdout
    assert f"{tmp_path}: Qwen3ForCausalLM" in out
    # per layer: input, post-attention, q and k norms; and the final norm
    assert re.search(r"^convert would convert +9 norm module\(s\): Qwen3RMSNorm x9$", out, re.M), out
    assert re.search(r"^and leave alone +0 norm-like module\(s\)$", out, re.M), out


def test_model_report_builds_the_class_the_checkpoint_names(tmp_path):
    """An encoder-decoder saved with its `architectures` (as a checkpoint is): the report builds that class and counts
    its norms (it built BartForCausalLM, the decoder alone: 37 of 62); a dir without a config says so in one line,
    and the command exits 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, architectures=["BartForConditionalGeneration"])
    config.save_pretrained(tmp_path / "bart")
    with torch.device("meta"):
        expected = shardnorm.convert(transformers.BartForConditionalGeneration(config), warn=False).count
    out = report("--model", str(tmp_path / "bart")).stdout
    assert f"{tmp_path / 'bart'}: BartForConditionalGeneration" in out, out
    assert re.search(rf"^convert would convert +{expected} norm module\(s\)", out, re.M), out
    result = report("--model", str(tmp_path / "missing"), status=1)  # a script checking the model learns it too
    assert "no model config could be read" in result.stdout and "Traceback" not in result.stderr, result.stderr
