"""Shared pieces of the DeepSpeed tests: device/backend choice, configs, models, a plain-torch reference.

Device: as `tests/spawn_ranks` chooses it: CPU with gloo (DS_ACCELERATOR=cpu) by default, CUDA
with NCCL, each rank on its local GPU, with SHARDNORM_TEST_DEVICE=cuda.
"""

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spawn_ranks import DEVICE, rank_device

if DEVICE == "cpu":
    os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
HIDDEN = 16


def load_config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def use_test_device(rank: int) -> torch.device:
    """`spawn_ranks.rank_device`, with deepspeed.comm set up on the default group."""
    import deepspeed

    device = rank_device(rank)
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return device


class LlamaRMSNorm(nn.Module):
    """A Hugging Face style RMSNorm (weight + variance_epsilon), as Llama defines it."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class PrenormBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = LlamaRMSNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def norm_model(seed: int) -> nn.Module:
    """Linear + every kind of norm shardnorm converts (4 norms), with non-trivial norm weights."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, HIDDEN), nn.LayerNorm(HIDDEN), PrenormBlock(HIDDEN), PrenormBlock(HIDDEN),
                          nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, 1))
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.Linear):
                for p in m.parameters(recurse=False):
                    p.add_(0.1 * torch.randn_like(p))
    return model


def micro_batches(seed: int, steps: int, gas: int, world: int, rows: int, shape: tuple) -> list:
    """[step][micro][rank] -> (x, target): the same fresh random data on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [[[(torch.randn(rows, *shape, generator=g), torch.randn(rows, *shape[:-1], 1, generator=g))
              for _ in range(world)] for _ in range(gas)] for _ in range(steps)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def config_adamw(ds_config: dict):
    """The torch optimizer DeepSpeed builds from the config's AdamW with torch_adam."""
    params = {k: v for k, v in ds_config["optimizer"]["params"].items() if k != "torch_adam"}
    return lambda parameters: torch.optim.AdamW(parameters, **params)


def train_reference(model: nn.Module, ds_config: dict, batches: list, device, make_optimizer, cat_dim: int = 0):
    """Train a copy of `model` with plain torch as DeepSpeed would: average over ranks (concatenated
    along cat_dim) and micro-batches, clip, step. Returns (model, [loss per micro-batch])."""
    model = copy.deepcopy(model).to(device)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in batches:
        for micro in step:
            x = torch.cat([x for x, _ in micro], cat_dim).to(device)
            target = torch.cat([t for _, t in micro], cat_dim).to(device)
            loss = loss_fn(model(x), target)
            (loss / len(step)).backward()
            losses.append(loss.item())
        if ds_config.get("gradient_clipping", 0) > 0:
            nn.utils.clip_grad_norm_(model.parameters(), ds_config["gradient_clipping"])
        opt.step()
        opt.zero_grad()
    return model, losses


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).norm().item()
    return diff / max(expected.detach().double().norm().item(), 1e-30)


def mean_over_ranks(value: float, device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def full_params(model: nn.Module) -> dict:
    """name -> full value of every parameter (gathered under ZeRO-3), in torch.nn terms
    (a zero-centered norm's weight w as its scale 1 + w)."""
    from deepspeed.runtime.zero import GatheredParameters
    from shardnorm.integrations.deepspeed_conversion import shardnorm_modules

    zero_centered = {id(m.weight) for m in shardnorm_modules(model) if m.zero_centered_gamma}
    with GatheredParameters(list(model.parameters())):
        return {name: (p + 1 if id(p) in zero_centered else p).detach().clone() for name, p in model.named_parameters()}
