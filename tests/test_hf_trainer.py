"""`shardnorm.integrations.transformers.enable(trainer)` in real `transformers.Trainer` runs, 2 ranks on gloo.

- DeepSpeed: ZeRO-2 and ZeRO-3 (model built under `zero.Init`) configs carrying a "shardnorm" section, the
  Trainer calling `deepspeed.initialize` itself: the section takes effect (norms converted; zero-centered
  under ZeRO-3) and the losses match the plain (DDP, torch norms) Trainer run.
- FSDP2 on the converted model, wrapped where Accelerate's own FSDP2 auto-wrap policy says
  (`fsdp2_prepare_auto_wrap_policy` with a real `FullyShardedDataParallelPlugin`: by the model's
  `_no_split_modules`, and by `transformer_cls_names_to_wrap`): losses match a single process. (Accelerate 1.15
  runs FSDP only on GPUs, so on CPU its policy is applied with `fully_shard` here; the Trainer's FSDP2 path on 2
  GPUs ran in benchmarks/gpu_hf_tp_plan.py, removed in d7c3b12: `git show d7c3b12^:benchmarks/gpu_hf_tp_plan.py`.)
All Trainer runs: gradient_accumulation_steps=2, 5 steps, clipping at 1.0; one spawn for everything. A tp_plan
model cannot go through the Trainer on CPU either (Accelerate allows its ParallelismConfig only on GPUs,
DeepSpeed or FSDP2): tests/test_hf_tp_plan.py covers it with an Accelerate loop.
`torch_compile=True` runs in one process, against the eager Trainer on the model's own norms.
"""

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import DEVICE, spawn

transformers = pytest.importorskip("transformers")

STEPS, GAS, SEQ, TOL = 5, 2, 8, 1e-5


def _import_trainer():
    from transformers import Trainer

    return Trainer


def _save_tiny_qwen3(path, seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=10, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)


class _Tokens(torch.utils.data.Dataset):
    """Fresh random token sequences, all of length SEQ (every micro-batch has the same token count)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, batch, gas, **kwargs):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=gas,
                             max_steps=STEPS, learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                             seed=0, data_seed=0, max_grad_norm=1.0, lr_scheduler_type="constant",
                             dataloader_num_workers=0, disable_tqdm=True, use_cpu=True, **kwargs)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _close(a, b, what):
    assert len(a) == len(b) == STEPS, (what, a, b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= TOL * abs(y), f"{what}: step {step} loss {x} vs {y}"


def _accelerate_fsdp2_policy(model, wrap_names):
    """The modules Accelerate's FSDP2 path would `fully_shard` on its own (before the root)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=wrap_names)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return [m for m in model.modules() if policy(m)]


def _fsdp2_with_accelerate_policy(rank, world, path):
    """Converted model, FSDP2 where Accelerate's auto-wrap policy points (the model's `_no_split_modules`, or
    `transformer_cls_names_to_wrap`: the same layers), vs one process on both ranks' data; 3 steps."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from shardnorm.integrations.transformers import convert_model

    g = torch.Generator().manual_seed(11)
    batches = [[torch.randint(0, 64, (2 * world, SEQ), generator=g) for _ in range(GAS)] for _ in range(3)]
    model = convert_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert sum(type(m).__module__ == "shardnorm.modules" for m in model.modules()) == 9
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    wrapped = _accelerate_fsdp2_policy(model, None)
    assert len(wrapped) == 2 and wrapped == _accelerate_fsdp2_policy(model, ["Qwen3DecoderLayer"]), wrapped
    for m in wrapped:
        fully_shard(m)
    fully_shard(model)

    def train(m, shard):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses = []
        for step in batches:
            for ids in step:
                ids = ids.chunk(world)[rank] if shard else ids
                loss = m(input_ids=ids, labels=ids).loss
                (loss / GAS).backward()
                losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return losses

    expected = [x.item() for x in train(single, False)]
    got = train(model, True)
    for x in got:
        dist.all_reduce(x)
    for i, (x, y) in enumerate(zip(got, expected)):
        assert abs(x.item() / world - y) <= TOL * y, f"FSDP2 micro-batch {i}: {x.item() / world} vs {y}"


def _ds_config(stage, section):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "shardnorm": section}


def _runs_body(rank, world, root):
    from transformers import AutoModelForCausalLM

    import shardnorm
    from shardnorm.integrations.transformers import enable

    Trainer = _import_trainer()
    path = f"{root}/qwen3"
    if rank == 0:
        _save_tiny_qwen3(path, seed=5)
    dist.barrier()
    data = _Tokens(2 * GAS * STEPS, seed=9)

    def run(engine, use_shardnorm=True, **kwargs):
        args = _args(f"{root}/out", 2, GAS, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # under zero.Init for ZeRO-3
        trainer = Trainer(model=model, args=args, train_dataset=data)
        if use_shardnorm:
            enable(trainer)
        norms = [m for m in trainer.model.modules() if isinstance(m, shardnorm.RMSNorm)]
        trainer.train()
        wrapped = trainer.model_wrapped
        assert type(wrapped).__name__ == engine, type(wrapped)
        return trainer, norms, _losses(trainer)

    _, _, plain = run("DistributedDataParallel", use_shardnorm=False)
    _fsdp2_with_accelerate_policy(rank, world, path)
    results = {}
    for stage, section in ((2, {"replace": ["*RMSNorm"]}), (3, {"zero_centered_gamma": True})):
        trainer, norms, losses = run("DeepSpeedEngine", deepspeed=_ds_config(stage, section))
        assert len(norms) == 9 and all(m.zero_centered_gamma == (stage == 3) for m in norms), stage
        if stage == 3:
            assert all(hasattr(m.weight, "ds_id") for m in norms), "model not built under zero.Init"
        _close(losses, plain, f"rank {rank} ZeRO-{stage} + shardnorm section vs plain Trainer")
        results[stage] = losses
    if rank == 0:
        print(f"\nTrainer losses: plain {plain}\n ZeRO-2 {results[2]}\n ZeRO-3 {results[3]}")


@pytest.mark.distributed
@pytest.mark.skipif(DEVICE == "cuda", reason="CPU runs by design: Trainer with use_cpu on gloo")
def test_trainer_deepspeed_section_and_fsdp(tmp_path):
    spawn(_runs_body, 2, str(tmp_path))


def test_trainer_torch_compile(tmp_path):
    """transformers' own Trainer with `torch_compile=True` after `enable(trainer)` (one process): the norms traced as
    shardnorm's ops, its losses equal the eager Trainer's with the model's own norms (fp32, gradient
    accumulation 2, clipping)."""
    from shardnorm.integrations.transformers import enable

    path = tmp_path / "qwen3"
    _save_tiny_qwen3(path, seed=5)
    data = _Tokens(4 * STEPS, seed=6)

    def run(out, compiled: bool, shardnorm_on: bool):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=_args(str(tmp_path / out), 2, GAS, torch_compile=compiled),
                                       train_dataset=data)
        if shardnorm_on:
            enable(trainer)
        trainer.train()
        return _losses(trainer)

    _close(run("compiled", compiled=True, shardnorm_on=True), run("eager", compiled=False, shardnorm_on=False),
           "compiled Trainer with shardnorm vs eager Trainer with the model's own norms")


def _tiny_llama():
    """A one-layer Llama config (transformers' logging quiet)."""
    transformers.logging.set_verbosity_error()
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2)


def test_enable_refuses_a_trainer_with_model_init(tmp_path):
    """A Trainer built with `model_init` makes a new model in train(): enable(trainer) names that, where the norms it
    converted would be silently dropped (the run would train the model's own norms)."""
    from shardnorm.integrations.transformers import enable

    config = _tiny_llama()
    trainer = transformers.Trainer(model_init=lambda: transformers.LlamaForCausalLM(config),
                                   args=_args(str(tmp_path), 1, 1))
    with pytest.raises(ValueError, match="has a model_init, which train\\(\\) calls to build a new model"):
        enable(trainer)


def test_enable_twice_asks_for_nothing_new(tmp_path):
    """A second enable(trainer) returns the converted model with the same options and refuses other ones, naming
    them (it changed nothing, silently: the model was converted, its reducer built, by the first)."""
    from shardnorm.integrations.transformers import enable

    config = _tiny_llama()
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=_args(str(tmp_path), 1, 1))
    model = enable(trainer)
    assert enable(trainer) is model
    with pytest.raises(ValueError, match=r"ran for this Trainer already.*keep_output=False \(enabled with True\)"):
        enable(trainer, keep_output=False)
    with pytest.raises(ValueError, match=r"bucket_cap_mb=4 \(enabled with "):
        enable(trainer, bucket_cap_mb=4)
