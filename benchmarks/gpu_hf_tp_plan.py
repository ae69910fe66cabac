"""GPU proof for the Hugging Face adapter (shardnorm.integrations.transformers) on 2 GPUs, NCCL.

    torchrun --nproc-per-node 2 benchmarks/gpu_hf_tp_plan.py --out $OUT

Cases (each recorded, errors included, in $OUT/gpu_hf_tp_plan.json and .md):
- grads: a small Qwen3 loaded with `tp_plan="auto"` (tp=2), 2 micro-batches, fp32: every norm grad vs the
  single-process G1 + G2, stock transformers beside it (its q/k-norm grads are 2*G1 + G2), and the
  `torch.distributed.all_reduce` calls each issues for the norm grads per step.
- trainer_tp: `transformers.Trainer` on the tp_plan model, gradient_accumulation_steps=2, clipping on, with
  `enable(trainer)` vs the reference (same samples as one micro-batch of 4, where stock is exact) vs stock with
  2 micro-batches; losses, reducer collectives per step, mean step time.
- trainer_fsdp2: Trainer with Accelerate FSDP2 (`fsdp="full_shard auto_wrap"`, by `_no_split_modules` and by
  `transformer_layer_cls_to_wrap`) on the converted model vs the plain DDP Trainer run (stock norms): losses.
Needs transformers + accelerate, no DeepSpeed. Runs in about a minute.
"""

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS, GAS, SEQ, VOCAB = 10, 2, 64, 512


def log(msg):
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, flush=True)


def save_qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)


def norm_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().double().cpu()
            for n, p in model.named_parameters() if "norm" in n and p.grad is not None}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@contextlib.contextmanager
def count_all_reduce(box):
    original = dist.all_reduce

    def counted(*args, **kwargs):
        box[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def case_grads(path, device):
    import shardnorm
    from transformers import AutoModelForCausalLM

    from shardnorm.integrations.transformers import convert_model

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, SEQ), generator=g).to(device) for _ in range(GAS)]
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    loss(single, batches[0]).backward()
    g1 = norm_grads(single)
    loss(single, batches[1]).backward()
    expected = norm_grads(single)
    out = {}
    for name in ("stock", "shardnorm"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
        if name == "shardnorm":
            model = convert_model(model)
        calls = [0]
        with count_all_reduce(calls):
            for i, ids in enumerate(batches):
                ctx = shardnorm.accumulate(model) if name == "shardnorm" and i < GAS - 1 else contextlib.nullcontext()
                with ctx:
                    loss(model, ids).backward()
        got = norm_grads(model)
        errs = {n: rel(got[n], expected[n]) for n in expected}
        out[name] = {"max_rel_err_vs_G1+G2": max(errs.values()),
                     "q_norm_rel_err": errs["model.layers.0.self_attn.q_norm.weight"],
                     "q_norm_rel_err_vs_2G1+G2": rel(got["model.layers.0.self_attn.q_norm.weight"],
                                                     expected["model.layers.0.self_attn.q_norm.weight"]
                                                     + g1["model.layers.0.self_attn.q_norm.weight"]),
                     "norm_grad_all_reduces_per_step": calls[0]}
    return out


def _import_trainer():
    from transformers import Trainer, TrainingArguments

    return Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer:
    """A TrainerCallback-like timer (added through the callback handler) for the mean optimizer-step time."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self
        self.times, self._t = [], None

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                torch.cuda.synchronize()
                outer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                torch.cuda.synchronize()
                outer.times.append(time.perf_counter() - outer._t)

        self.callback = _CB()

    def mean_ms(self):
        t = self.times[2:] or self.times
        return 1e3 * sum(t) / max(len(t), 1)


def run_trainer(path, out_dir, batch, gas, tp, use_shardnorm, **kwargs):
    from transformers import AutoModelForCausalLM

    from shardnorm.integrations.transformers import enable

    Trainer, TrainingArguments = _import_trainer()
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=gas,
                             max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                             seed=0, data_seed=0, max_grad_norm=1.0, lr_scheduler_type="constant",
                             disable_tqdm=True, **kwargs)
    load = {"tp_plan": "auto"} if tp else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(8 * STEPS * 4), callbacks=[timer.callback])
    if use_shardnorm:
        enable(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"losses": losses, "step_ms": timer.mean_ms(), "wrapped": type(trainer.model_wrapped).__name__}
    cb = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "ShardnormCallback"]
    if cb:
        result["norm_grad_collectives_per_step"] = cb[0].num_buckets
    return result


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and len(a) == len(b) else float("nan")


def case_trainer_tp(path, root):
    ref = run_trainer(path, f"{root}/ref", 4, 1, True, False)
    ours = run_trainer(path, f"{root}/ours", 2, GAS, True, True)
    stock = run_trainer(path, f"{root}/stock", 2, GAS, True, False)
    return {"reference_gas1_batch4": ref, "shardnorm_gas2": ours, "stock_gas2": stock,
            "shardnorm_max_rel_loss_diff": max_rel(ours["losses"], ref["losses"]),
            "stock_max_rel_loss_diff": max_rel(stock["losses"], ref["losses"])}


def case_trainer_fsdp2(path, root):
    plain = run_trainer(path, f"{root}/ddp", 2, GAS, False, False)
    out = {"plain_ddp": plain}
    for label, cfg in (("no_split_modules", {"version": 2}),
                       ("transformer_layer_cls_to_wrap", {"version": 2,
                                                          "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})):
        try:
            r = run_trainer(path, f"{root}/fsdp_{label}", 2, GAS, False, True, fsdp="full_shard auto_wrap",
                            fsdp_config=cfg)
            r["max_rel_loss_diff_vs_ddp"] = max_rel(r["losses"], plain["losses"])
            out[label] = r
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_hf_tp_plan_out"))
    out = Path(parser.parse_args().out)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    out.mkdir(parents=True, exist_ok=True)
    root = out / "work"
    path = str(root / "qwen3")
    if rank == 0:
        save_qwen3(path)
    dist.barrier()
    import transformers

    results = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "gpu": torch.cuda.get_device_name()}}
    for name, fn in (("grads", lambda: case_grads(path, torch.device("cuda", local))),
                     ("trainer_tp", lambda: case_trainer_tp(path, str(root))),
                     ("trainer_fsdp2", lambda: case_trainer_fsdp2(path, str(root)))):
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = round(time.time() - t0, 1)
        log(f"{name}: {json.dumps(results[name], default=str)[:1500]}")
        dist.barrier()
    if rank == 0:
        (out / "gpu_hf_tp_plan.json").write_text(json.dumps(results, indent=2, default=str))
        lines = ["# HF adapter on 2 GPUs", "", f"versions: {results['versions']}", "",
                 "| case | result |", "|---|---|"]
        g = results.get("grads", {})
        for k in ("stock", "shardnorm"):
            if k in g:
                lines.append(f"| grads {k} | max rel err vs G1+G2 {g[k]['max_rel_err_vs_G1+G2']:.2e}, q_norm vs "
                             f"2*G1+G2 {g[k]['q_norm_rel_err_vs_2G1+G2']:.2e}, norm-grad all-reduces/step "
                             f"{g[k]['norm_grad_all_reduces_per_step']} |")
        t = results.get("trainer_tp", {})
        if "shardnorm_gas2" in t:
            lines.append(f"| Trainer tp=2 gas=2 | shardnorm max rel loss diff {t['shardnorm_max_rel_loss_diff']:.2e} "
                         f"(collectives/step {t['shardnorm_gas2'].get('norm_grad_collectives_per_step')}, "
                         f"{t['shardnorm_gas2']['step_ms']:.1f} ms/step); stock {t['stock_max_rel_loss_diff']:.2e} "
                         f"({t['stock_gas2']['step_ms']:.1f} ms/step) |")
        f = results.get("trainer_fsdp2", {})
        for k in ("no_split_modules", "transformer_layer_cls_to_wrap"):
            if k in f:
                v = f[k]
                lines.append(f"| Trainer FSDP2 ({k}) | " + (v["error"][:200] if "error" in v else
                             f"{v['wrapped']}, max rel loss diff vs DDP {v['max_rel_loss_diff_vs_ddp']:.2e}") + " |")
        for k in ("grads", "trainer_tp", "trainer_fsdp2"):
            if "error" in results.get(k, {}):
                lines.append(f"| {k} | ERROR {results[k]['error'][:300]} |")
        (out / "gpu_hf_tp_plan.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
