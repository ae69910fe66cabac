"""Shared pieces of the FSDP tests: the main job's Llama-style model and engine at a tiny size, fresh
random token batches, the single-process reference run and full-parameter comparison.

Device: `spawn_ranks.DEVICE` / `rank_device`: gloo on CPU, or NCCL on CUDA with
SHARDNORM_TEST_DEVICE=cuda and >= 2 GPUs.
"""

import torch
import torch.distributed as dist
from conftest import rel_err
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import shardnorm
import shardnorm.fsdp

from parallel.config import ModelConfig, TrainConfig
from parallel.engines import TorchEngine, cross_entropy
from parallel.model import build_model

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
# adam_eps 1e-6: Adam divides by sqrt(v) + eps, so with torch's 1e-8 an element whose grad cancels to
# ~1e-9 turns fp32 summation-order noise (sharded vs whole matmuls) into a visible update; it made the
# 1e-5 parameter check fail about once in 8 runs. Grads are also compared directly (step_grads).
TRAIN = TrainConfig(steps=3, grad_accum=2, lr=5e-4, warmup_steps=1, max_grad_norm=0.0, adam_eps=1e-6)
SEQ, ROWS = 8, 2  # tokens per sequence; sequences per data-parallel rank and micro-batch
TOL = 1e-5


def make_model(seed: int, device, norm: str = "shardnorm") -> nn.Module:
    """The main job's model with random (not ones) norm weights, identical on every rank and to the
    CPU reference: built from the CPU generator, then moved (a CUDA build would draw other numbers)."""
    model = build_model(CFG, norm, torch.device("cpu"), seed).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model


def token_batches(seed: int, dp: int, steps: int = TRAIN.steps) -> list:
    """[step][micro-batch] -> (inputs, targets) of the global batch: ROWS * dp fresh random sequences."""
    g = torch.Generator().manual_seed(seed + 2)
    windows = torch.randint(256, (steps, TRAIN.grad_accum, ROWS * dp, SEQ + 1), generator=g)
    return [[(w[:, :-1], w[:, 1:]) for w in step] for step in windows]


def rank_rows(step: list, dp_rank: int, device) -> list:
    rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    return [(x[rows].to(device), y[rows].to(device)) for x, y in step]


def train(engine: TorchEngine, batches: list, dp_rank: int, device) -> list[float]:
    """Losses of the global batch (mean over all ranks: equal rows per data-parallel rank)."""
    losses = []
    for step in batches:
        loss = torch.tensor([engine.step(rank_rows(step, dp_rank, device))], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def step_grads(model: nn.Module, micro_batches: list) -> dict[str, torch.Tensor]:
    """name -> full grad after one step's micro-batches (as TorchEngine runs them), then zeroed.

    Checked apart from the params because Adam's update hides a grad scaled by a constant (e.g. a
    norm grad reduced twice). Plain or FSDP2 models."""
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with shardnorm.accumulate(model) if not last else torch.enable_grad():
            (cross_entropy(model(x), y) / len(micro_batches)).backward()
    shardnorm.finalize_grads(model)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.detach().cpu()
        p.grad = None
    return grads


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> full (unsharded) value, for plain, FSDP1 and FSDP2 models alike."""
    options = StateDictOptions(full_state_dict=True) if dist.is_initialized() else None
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}


def reference(seed: int, batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in this process alone, on the whole global batch."""
    model = make_model(seed, "cpu")
    engine = TorchEngine(model, TRAIN)
    losses = [engine.step(step) for step in batches]
    return losses, full_params(model)


def assert_grads_match(what: str, grads: dict, ref_grads: dict, tol: float = TOL) -> None:
    assert grads.keys() == ref_grads.keys(), f"{what}: {sorted(grads)} vs {sorted(ref_grads)}"
    for name, grad in grads.items():
        err = rel_err(grad, ref_grads[name])
        assert err <= tol, f"{what}: grad of {name} rel err {err:.2e}"


def assert_matches(what: str, losses, params, ref_losses, ref_params, tol: float = TOL) -> None:
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= tol * abs(b), f"{what}: step {step + 1} loss {a} vs {b}"
    assert params.keys() == ref_params.keys(), f"{what}: {sorted(params)} vs {sorted(ref_params)}"
    for name, value in params.items():
        err = rel_err(value, ref_params[name])
        assert err <= tol, f"{what}: {name} rel err {err:.2e} after {len(losses)} steps"
