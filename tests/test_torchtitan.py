"""shardnorm in torchtitan 0.3: its converter registry, its CLI config selection, its own trainer on CPU, and the model
its parallelize wrapper hands to `shardnorm.convert` (the scope of `keep_output=False`)."""

import json
import os
import subprocess
import sys

import pytest

import optional_packages

optional_packages.importorskip("torchtitan")

from torchtitan.models.common import RMSNorm as TitanRMSNorm  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from shardnorm.integrations.torchtitan import ShardnormConverter, ShardnormRMSNorm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _norm_configs(model_config):
    return [cfg for _, cfg, _, _ in model_config.traverse(TitanRMSNorm.Config, recurse=True)]


def test_converter_in_model_registry():
    """torchtitan's own registry applies the converter: every RMSNorm becomes shardnorm's, modules build."""
    stock = model_registry("debugmodel").model
    spec = model_registry("debugmodel", converters=[ShardnormConverter.Config()])
    norms = _norm_configs(spec.model)
    assert len(norms) == len(_norm_configs(stock)) == 2 * len(stock.layers) + 1
    assert all(type(c) is ShardnormRMSNorm.Config for c in norms)
    module = norms[0].build()
    assert isinstance(module, ShardnormRMSNorm) and module.weight.shape == (stock.dim,)


def test_converter_refuses_a_model_without_rmsnorm():
    from torchtitan.models.common import Linear

    with pytest.raises(ValueError, match="found no torchtitan RMSNorm.Config"):
        ShardnormConverter.Config().build().convert(Linear.Config(in_features=4, out_features=4))


def _train(tmp_path, config: str, steps: int) -> dict:
    out = tmp_path / f"{config}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.torchtitan_runner", str(out), "--module", "tests.torchtitan_runner", "--config", config,
           "--hf_assets_path", str(tmp_path / "tokenizer"), "--dataloader.dataset_path", str(tmp_path / "c4_test"),
           "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
           "--training.steps", str(steps), "--training.mixed_precision_param", "float32",
           "--parallelism.tensor_parallel_degree", "2", "--debug.seed", "7",
           "--override.imports", "tests.torchtitan_runner.sdpa_on_cpu", "--dump_folder", str(tmp_path / "out"),
           # torchtitan's collective timeouts (300 s to start, 100 s per collective after step 1) and the run's:
           # limits for a hang, not for a busy machine's speed
           "--comm.init_timeout_seconds", "1800", "--comm.train_timeout_seconds", "1800"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_torchtitan_trainer_tp2_accumulation_matches_stock(tmp_path):
    """torchtitan's trainer, llama3 debug model, tp=2 with sequence parallelism, 2 micro-batches per step:
    shardnorm's losses equal stock torchtitan's (fp32 params), and the norm grads take one reducer
    all-reduce per step where stock takes one per norm parameter per micro-batch."""
    from tests.torchtitan_runner import make_assets

    make_assets(tmp_path)
    steps, micro_batches = 3, 2
    stock = _train(tmp_path, "stock_debugmodel", steps)
    ours = _train(tmp_path, "shardnorm_debugmodel", steps)
    # the first step's grads come from identical weights: their norm (all params, before clipping) must
    # agree to fp32 summation noise; a norm grad lost or reduced twice moves it by ~1e-3
    assert abs(stock["grad_norm"][0] - ours["grad_norm"][0]) <= 1e-5 * stock["grad_norm"][0], (stock, ours)
    for step, (a, b) in enumerate(zip(stock["loss"], ours["loss"]), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: stock loss {a}, shardnorm {b}"
    assert len(ours["loss"]) == steps
    assert ours["loss"][-1] < ours["loss"][0]
    assert ours["reducer_collectives"] == list(range(1, steps + 1))  # one bucket, once per optimizer step
    norm_params = len(_norm_configs(model_registry("debugmodel").model))
    for s, o in zip(stock["fwd_bwd_all_reduces"], ours["fwd_bwd_all_reduces"]):
        assert s - o == norm_params * micro_batches - 1, (stock, ours)


@pytest.mark.distributed
def test_torchtitan_qwen3_qk_norms_tp2_match_stock(tmp_path):
    """qwen3's debug model at tp=2: its per-head q/k norms stay replicated (torchtitan's own parallelize redistributes
    their inputs by `forward`'s parameter names: a `residual` never passed would raise KeyError), and the losses equal
    stock torchtitan's."""
    from tests.torchtitan_runner import make_assets

    make_assets(tmp_path)
    stock, ours = _train(tmp_path, "stock_qwen3", 2), _train(tmp_path, "shardnorm_qwen3", 2)
    for step, (a, b) in enumerate(zip(stock["loss"], ours["loss"]), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: stock loss {a}, shardnorm {b}"
    assert len(ours["loss"]) == 2


def test_parallelize_wrapper_scopes_keep_output_false():
    """`keep_output=False` acts in the forward of a model handed to `shardnorm.convert`; torchtitan builds its model
    from configs, so the parallelize wrapper hands it over: the consumers save a handle, and no norm warns."""
    import warnings

    import torch

    from shardnorm import output_recompute
    from shardnorm.integrations.torchtitan import parallelize_with_shardnorm

    def build(keep_output):
        torch.manual_seed(0)
        norm = ShardnormRMSNorm.Config(normalized_shape=16, keep_output=keep_output).build()
        return torch.nn.Sequential(norm, torch.nn.Linear(16, 16))

    def parallelize(model, *, parallel_dims):  # no parallelism: torchtitan's parallelize leaves the model as it is
        return model

    x = torch.randn(4, 16)
    grads = {}
    for keep in (True, False):
        model = parallelize_with_shardnorm(parallelize)(build(keep), parallel_dims=None)
        output_recompute.counters(reset=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="shardnorm", category=UserWarning)
            model(x).square().sum().backward()
        counts = output_recompute.counters()
        assert counts["saved_as_handle"] == counts["recomputed"] == (0 if keep else 1), (keep, counts)
        grads[keep] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
