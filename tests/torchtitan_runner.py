"""Run torchtitan 0.3's own trainer (`torchtitan.train.main`), stock or with shardnorm, and record per step
the loss, the grad norm (torchtitan's, before clipping) and the all-reduces of forward + backward: on CPU with gloo for tests/test_torchtitan.py, on
GPUs with NCCL when TORCHTITAN_RUNNER_DEVICE=cuda (the GPU runs came from benchmarks/gpu_torchtitan.sh, removed in
d7c3b12: `git show d7c3b12^:benchmarks/gpu_torchtitan.sh`).

torchtitan 0.3 cannot start on a machine without an accelerator: `torchtitan.tools.utils` picks
"cuda" when `torch._utils._get_available_device_type()` finds none, and `Trainer.__init__` then
calls `torch.cuda.set_device` ("module 'torch._C' has no attribute '_cuda_setDevice'" on CPU-only
torch). `use_cpu()` points the modules that read that choice at a CPU device module; everything
else is torchtitan's code. Its default attention (FlexAttention) has no CPU backward
("FlexAttention does not support backward on CPU"), so `sdpa_on_cpu` swaps it for torchtitan's
`ScaledDotProductAttention` through torchtitan's own `--override.imports` mechanism, in both the
stock and the shardnorm run. Its default `spmd_backend="spmd_types"` fails in `fully_shard` on a
CPU gloo run ("When dp_mesh_dims is provided, all parameters must be DTensors"), so both runs use
`partial_dtensor`, which shardnorm's adapter needs anyway. torchtitan 0.3 also calls
`torch.distributed.set_timeout` after the first step, which torch 2.13 does not have (only the
private `distributed_c10d._set_pg_timeout`): `alias_set_timeout()` aliases it.

Usage: torchrun --nproc_per_node 2 -m tests.torchtitan_runner OUT_JSON --module tests.torchtitan_runner
--config stock_debugmodel|shardnorm_debugmodel|stock_qwen3|shardnorm_qwen3 [torchtitan CLI ...]
"""

import importlib
import json
import os
import sys
import types

import torch
from torchtitan.config.override import derive, override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from parallel.collectives import AllReduceCounter


class _CPUDevice(types.ModuleType):
    """torch.cpu plus the few `torch.cuda` calls torchtitan's trainer and metrics make."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def get_device_name(self, *args):
        return "cpu"

    def get_device_properties(self, *args):
        return types.SimpleNamespace(total_memory=2**36, name="cpu")

    def memory_stats(self, *args):
        return {}

    def reset_peak_memory_stats(self, *args):
        pass

    def empty_cache(self):
        pass

    def current_device(self):
        return 0

    def set_device(self, *args):
        pass


def alias_set_timeout() -> bool:
    """torchtitan 0.3 calls `torch.distributed.set_timeout` after step 1; torch 2.11 / 2.13 have only the
    private `_set_pg_timeout`. Returns whether the alias was needed."""
    if hasattr(torch.distributed, "set_timeout"):
        return False
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch.distributed.set_timeout = _set_pg_timeout
    return True


def use_cpu() -> None:
    device = _CPUDevice("torchtitan_cpu_device")
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiler"):
        module = importlib.import_module(name)
        if hasattr(module, "device_module"):
            module.device_module = device
        if hasattr(module, "device_type"):
            module.device_type = "cpu"


@override(target=FlexAttention.Config, description="SDPA: FlexAttention has no CPU backward")
def sdpa_on_cpu(cfg):
    return derive(cfg, ScaledDotProductAttention.Config)


def make_assets(path) -> None:
    """The smallest tokenizer and c4_test-style dataset torchtitan's HuggingFace loaders accept (the wheel
    ships neither): path/tokenizer, path/c4_test."""
    import random
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path = Path(path)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "norm", "shard", "grad", "token", "layer", "mesh", "rank", "step"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(256)]
    (path / "tokenizer").mkdir(parents=True, exist_ok=True)
    (path / "c4_test").mkdir(parents=True, exist_ok=True)
    (path / "c4_test" / "data.json").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]))
    tok.save(str(path / "tokenizer" / "tokenizer.json"))
    (path / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))


def _runnable(config):
    config.parallelism.spmd_backend = "partial_dtensor"
    config.activation_checkpoint = None
    config.validator.enable = False
    config.checkpoint.enable = False
    config.training.disable_cuda_graphs = True
    return config


def stock_debugmodel():
    return _runnable(llama3_debugmodel())


def shardnorm_debugmodel():
    from shardnorm.integrations.torchtitan import with_shardnorm

    return _runnable(with_shardnorm(llama3_debugmodel()))


def stock_qwen3():
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    return _runnable(qwen3_debugmodel())


def shardnorm_qwen3():
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    from shardnorm.integrations.torchtitan import with_shardnorm

    return _runnable(with_shardnorm(qwen3_debugmodel()))


def main(out_path: str) -> None:
    """Run torchtitan's trainer; record per step the loss and the all-reduces of forward + backward."""
    record_extra = {"set_timeout_aliased": alias_set_timeout()}
    if os.environ.get("TORCHTITAN_RUNNER_DEVICE", "cpu") == "cpu":
        use_cpu()
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer
    from torchtitan import train

    record = {"loss": [], "grad_norm": [], "fwd_bwd_all_reduces": [], "reducer_collectives": [], **record_extra}
    fwd_bwd, log = Trainer.forward_backward_step, MetricsProcessor.log
    step_counts: list[int] = []

    def counted_fwd_bwd(self, **kwargs):
        with AllReduceCounter() as counter:
            out = fwd_bwd(self, **kwargs)
        step_counts.append(counter.count)
        return out

    def logged(self, step, loss, *args, **kwargs):
        record["loss"].append(float(loss))
        record["grad_norm"].append(float(args[1]))  # log(step, loss, max_loss, grad_norm): before clipping
        record["fwd_bwd_all_reduces"].append(sum(step_counts))
        step_counts.clear()
        reducer = getattr(self.model_parts[0], "_shardnorm_reducer", None)
        record["reducer_collectives"].append(getattr(reducer, "collectives", None))
        return log(self, step, loss, *args, **kwargs)

    Trainer.forward_backward_step, MetricsProcessor.log = counted_fwd_bwd, logged
    train.main()
    if os.environ.get("RANK", "0") == "0":
        with open(out_path, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    out, sys.argv = sys.argv[1], [sys.argv[0]] + sys.argv[2:]
    importlib.import_module("tests.torchtitan_runner").main(out)
