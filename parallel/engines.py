"""One optimizer step over a step's micro-batches, for each way the model can run.

`TorchEngine` drives a plain model (the single-process `--check` reference) or an FSDP2 × TP model;
`DeepSpeedEngine` drives a model wrapped by DeepSpeed from a DeepSpeed JSON config. Both use the same
loss, AdamW and learning-rate schedule, so their losses are comparable step by step.
"""

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardnorm
import shardnorm.fsdp
from shardnorm.integrations.deepspeed_config import ShardnormConfigError
from parallel.config import ConfigError, TrainConfig
from parallel.metrics import logger


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_optimizer(model: nn.Module, train: TrainConfig):
    """AdamW with linear warm-up, then cosine decay to 10% of the peak learning rate (torch's
    LinearLR then CosineAnnealingLR: step k of the warm-up runs at lr * (k + 1) / (warmup + 1))."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(0.9, 0.95), eps=train.adam_eps,
                                  weight_decay=train.weight_decay)
    return optimizer, build_scheduler(optimizer, train)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig):
    """`build_optimizer`'s schedule, for `train.steps` steps."""
    schedulers = torch.optim.lr_scheduler
    cosine = schedulers.CosineAnnealingLR(optimizer, T_max=max(1, train.steps - train.warmup_steps),
                                          eta_min=0.1 * train.lr)
    if not train.warmup_steps:
        return cosine
    warmup = schedulers.LinearLR(optimizer, start_factor=1 / (train.warmup_steps + 1),
                                 end_factor=1.0, total_iters=train.warmup_steps)
    return schedulers.SequentialLR(optimizer, [warmup, cosine], milestones=[train.warmup_steps])


def schedule_at(train: TrainConfig, done: int, groups: int = 1) -> dict:
    """The state of this run's schedule (`train.steps`, `lr`, `warmup_steps`) after `done` steps: what a run started
    with these settings has then. Stepped on an optimizer of its own: the schedule depends on the settings alone."""
    optimizer = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)],
                                lr=train.lr)
    scheduler = build_scheduler(optimizer, train)
    optimizer.step()  # no grads, no update: the scheduler only checks that it comes first
    for _ in range(done):
        scheduler.step()
    return scheduler.state_dict()


def retarget_schedule(scheduler, train: TrainConfig, done: int) -> None:
    """Put `scheduler` (built from `train`) and its optimizer where this run's schedule is after `done` steps, in
    place of a checkpoint's schedule saved with other settings."""
    scheduler.load_state_dict(schedule_at(train, done, len(scheduler.optimizer.param_groups)))
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"], group["initial_lr"] = lr, train.lr


class HostPhases:
    """Host wall time of one step, per phase, in ms: read at the phase boundaries without synchronizing, so a
    phase's time is what the host spent issuing its work. `gpu_wait` is the loss read that ends the step: near
    zero when the host is the bottleneck, most of the step when the GPU is."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1e3
        self._last = now


class TorchEngine:
    """Gradient accumulation without communication until the last micro-batch, then one step.

    `norm_reducer`: the model's sequence-parallel shardnorm norms reduce their grads over tp through
    shardnorm's reducer (attached by parallel.parallelize), once per step.
    """

    def __init__(self, model: nn.Module, train: TrainConfig, norm_reducer: bool = False):
        self.model, self.max_grad_norm, self.norm_reducer = model, train.max_grad_norm, norm_reducer
        self.optimizer, self.scheduler = build_optimizer(model, train)
        self.host_ms: dict[str, float] = {}

    def _micro_batch(self, last: bool):
        """Neither FSDP (over dp) nor shardnorm's reducer (over tp) reduce before the last one."""
        return contextlib.nullcontext() if last else shardnorm.accumulate(self.model)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step; `host_ms` then holds its host time per phase (`HostPhases`)."""
        phases = HostPhases()
        total = 0.0
        for i, (inputs, targets) in enumerate(micro_batches):
            with self._micro_batch(last=i == len(micro_batches) - 1):
                loss = cross_entropy(self.model(inputs), targets) / len(micro_batches)
                phases.mark("forward")
                loss.backward()
                phases.mark("backward")
            total += loss.detach()
        if self.norm_reducer:
            shardnorm.finalize_grads(self.model)
            phases.mark("finalize_grads")
        if self.max_grad_norm:
            with torch.profiler.record_function("clip_grad_norm"):  # parallel.collectives leaves it out
                nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            phases.mark("clip_grad_norm")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        phases.mark("optimizer")
        total = float(total)
        phases.mark("gpu_wait")
        self.host_ms = phases.ms
        return total

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save_checkpoint(self, path: Path) -> None:
        """Model and optimizer through torch.distributed.checkpoint, each rank writing its shards.
        Between steps only: shardnorm.fsdp.save refuses while grads are accumulated (none are after
        step(), which zeroes them)."""
        shardnorm.fsdp.save(str(path / "dcp"), self.model, self.optimizer)

    def load_checkpoint(self, path: Path) -> None:
        """DCP reshards: the saving run's dp × tp layout need not be this one's."""
        shardnorm.fsdp.load(str(path / "dcp"), self.model, self.optimizer)


class DeepSpeedEngine:
    """The TOML owns batch size, accumulation, clipping, precision and the optimizer; the DeepSpeed
    JSON owns ZeRO and the "shardnorm" section (turned off for `--norm torch`), which
    shardnorm.integrations.deepspeed.initialize applies to the model's torch norms."""

    def __init__(self, model: nn.Module, train: TrainConfig, ds_config_path: str,
                 micro_batch_size: int, keep_output: bool = True):
        import shardnorm.integrations.deepspeed

        config = json.loads(open(ds_config_path).read())
        replaced = [key for key in ("optimizer", "scheduler", "train_batch_size") if key in config]
        if replaced:
            logger.info("%s: %s replaced by the [train] settings", ds_config_path,
                        ", ".join(replaced))
        for key in replaced:
            del config[key]
        config.update(train_micro_batch_size_per_gpu=micro_batch_size,
                      gradient_accumulation_steps=train.grad_accum,
                      gradient_clipping=train.max_grad_norm)
        config.setdefault("bf16", {})["enabled"] = train.dtype == "bfloat16"
        section = config.setdefault("shardnorm", {})
        section["enabled"] = train.norm == "shardnorm"
        if section["enabled"]:  # model.norm_keep_output, which the summary reports, over the JSON's
            section["keep_output"] = keep_output
        optimizer, scheduler = build_optimizer(model, train)
        try:
            self.engine, self.optimizer, _, self.scheduler = shardnorm.integrations.deepspeed.initialize(
                model=model, config=config, optimizer=optimizer, lr_scheduler=scheduler)
        except ShardnormConfigError as e:  # the same on every rank, checked before the model changes
            raise ConfigError(f"parallel.deepspeed_config: {ds_config_path}: {e}") from None
        self.model = self.engine.module
        self.host_ms: dict[str, float] = {}
        logger.info("DeepSpeed (ZeRO stage %d): %d shardnorm norms in the model",
                    self.engine.zero_optimization_stage(),
                    sum(isinstance(m, shardnorm.RMSNorm) for m in self.model.modules()))

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """DeepSpeed scales each micro-batch loss and steps at the accumulation boundary itself; `host_ms` as
        `TorchEngine.step`'s, its optimizer phase DeepSpeed's `engine.step()` (reductions, clipping included)."""
        phases = HostPhases()
        total = 0.0
        for inputs, targets in micro_batches:
            loss = cross_entropy(self.engine(inputs), targets)
            phases.mark("forward")
            self.engine.backward(loss)
            phases.mark("backward")
            self.engine.step()
            phases.mark("optimizer")
            total += loss.detach() / len(micro_batches)
        total = float(total)
        phases.mark("gpu_wait")
        self.host_ms = phases.ms
        return total

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    TAG = "deepspeed"

    def save_checkpoint(self, path: Path) -> None:
        """DeepSpeed's own checkpoint (each rank its ZeRO partition), lr scheduler included."""
        if self.engine.micro_steps % self.engine.gradient_accumulation_steps():
            raise RuntimeError("refusing to checkpoint in the middle of gradient accumulation "
                               f"(micro-step {self.engine.micro_steps}): save after a step")
        self.engine.save_checkpoint(str(path), tag=self.TAG, save_latest=False)

    def load_checkpoint(self, path: Path) -> None:
        """The LR scheduler is left to the caller (train_state.pt): a run with other schedule settings replaces it,
        and a schedule of another shape (with or without warm-up) would not load."""
        loaded, _ = self.engine.load_checkpoint(str(path), tag=self.TAG, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {path}/{self.TAG}")
