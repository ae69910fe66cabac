"""Save the main job at optimizer-step boundaries and resume it exactly (docs/training.md, "Checkpoint and resume").

A checkpoint holds what the next step depends on: the model and optimizer (the engine's own format:
torch.distributed.checkpoint shards for FSDP2 × TP, DeepSpeed's checkpoint for DeepSpeed), the LR
scheduler, the data position (the window generator, the same on every rank), every rank's RNG
states, and the step. It is only taken after `optimizer.step()` and `zero_grad()`, when no grads are
accumulated: shardnorm's norm-grad reducer holds nothing then (`shardnorm.fsdp.save` refuses
otherwise), so nothing mid-accumulation needs saving.

Crash safety (parallel/checkpoint_store.py): every rank writes into `.tmp-step-<N>/`, then rank 0
writes `complete.json` listing every file's size and renames the directory to `step-<N>/`.
"""

import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel import checkpoint_store as store
from parallel.checkpoint_store import CheckpointError
from parallel.config import Config
from parallel.engines import retarget_schedule
from parallel.metrics import logger
from parallel.runtime import Runtime

# settings a resumed run must share with the saved one, or its batches differ from the saved run's
DATA_KEYS = {"seed": "train.seed", "seq_len": "data.seq_len", "grad_accum": "train.grad_accum"}
# settings a run is compared by (--norm, bf16 against fp32): a resume with others would report the saved run's steps
# as this setting's, and a comparison run sharing checkpoint.dir would continue the other run instead of starting
RUN_KEYS = {"norm": "train.norm", "dtype": "train.dtype"}
# settings of the LR schedule: with values other than the saved ones, a resumed run follows its own (resume())
SCHEDULE_KEYS = {"steps": "train.steps", "lr": "train.lr", "warmup_steps": "train.warmup_steps"}
# where the batches come from: another corpus is this run's choice, but a resumed run says so (resume())
CORPUS_KEYS = {"data_path": "data.path", "corpus_bytes": "data.corpus_bytes"}
# optimizer settings: AdamW's come back with its state (param_groups), a resumed run sets its own again (resume())
OPTIMIZER_KEYS = {"weight_decay": "train.weight_decay", "adam_eps": "train.adam_eps",
                  "max_grad_norm": "train.max_grad_norm"}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _save_synced(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_states(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        states["numpy"] = sys.modules["numpy"].random.get_state()
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def zero_stage(deepspeed_config: str) -> int:
    """The ZeRO stage of a DeepSpeed JSON (DeepSpeed's default: 0, no ZeRO); the config check has read it."""
    return json.loads(Path(deepspeed_config).read_text()).get("zero_optimization", {}).get("stage", 0)


def use_optimizer_settings(optimizer, train) -> None:
    """This run's AdamW settings in `optimizer`'s param groups: loading a checkpoint's state puts the saved ones there
    (torch's and DeepSpeed's optimizers alike). Clipping reads train.max_grad_norm each step."""
    for group in optimizer.param_groups:
        group["weight_decay"], group["eps"] = train.weight_decay, train.adam_eps


def resume_hint(cfg: Config) -> str:
    """What running the same command again does, for a run that stopped early: which checkpoint it resumes
    from (the one `checkpoint.load` names, else the latest complete one in `checkpoint.dir`), or that it starts
    over."""
    c = cfg.checkpoint
    latest = store.latest(c.dir, warn=lambda message: None) if c.dir else None
    if c.load:
        try:
            loaded, info = store.resolve(c.load, warn=lambda message: None)
        except CheckpointError as error:  # deleted since the run loaded it
            return f"checkpoint.load no longer names a usable checkpoint ({error})"
        hint = f"the same command resumes from {loaded} (step {info['step']}, checkpoint.load) again"
        if latest and latest[0] != loaded:
            hint += f"; without checkpoint.load it resumes from {latest[0]} (step {latest[1]['step']})"
        return hint
    if not c.dir:
        return ("checkpoint.dir is not set, so there is no checkpoint: the same command starts over "
                "(checkpoint.dir=DIR checkpoint.every=N makes a run resumable)")
    if latest is None:
        return f"no checkpoint in {c.dir} yet: the same command starts over"
    return f"the last checkpoint is {latest[0]} (step {latest[1]['step']}): the same command resumes from it"


class Checkpointer:
    """Saves every `checkpoint.every` steps (and at the end) into `checkpoint.dir`; resumes from
    `checkpoint.load` or the latest complete checkpoint in `checkpoint.dir`."""

    def __init__(self, cfg: Config, runtime: Runtime, dp: int, tp: int):
        self.cfg, self.runtime, self.dp, self.tp = cfg, runtime, dp, tp
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        self.saved_step = 0
        # rank 0: the metrics records of the steps up to the checkpoint resumed from (None: it holds none)
        self.records: list[dict] | None = None
        self.info = {"engine": cfg.parallel.engine, "world_size": runtime.world_size, "dp": dp,
                     "tp": tp, "global_rows": cfg.data.batch_size * dp, "config": cfg.name,
                     "dtype": cfg.train.dtype, "norm": cfg.train.norm, "model": dataclasses.asdict(cfg.model),
                     **{k: getattr(cfg.train if k != "seq_len" else cfg.data, k)
                        for k in (*DATA_KEYS, *SCHEDULE_KEYS, *OPTIMIZER_KEYS)},
                     # the generated corpus's size; a file's is the file's
                     "data_path": cfg.data.path, "corpus_bytes": None if cfg.data.path else cfg.data.corpus_bytes,
                     "zero_stage": zero_stage(cfg.parallel.deepspeed_config)
                     if cfg.parallel.engine == "deepspeed" else None}

    # ---- resume ------------------------------------------------------------------------------------

    def _find(self) -> Path | None:
        """Rank 0 picks the checkpoint (warning once about torn ones), every rank gets its path."""
        found = error = None
        if self.runtime.is_main:
            try:
                if self.cfg.checkpoint.load:
                    found, _ = store.resolve(self.cfg.checkpoint.load, logger.warning)
                elif self.root is not None:
                    latest = store.latest(self.root, logger.warning)
                    found = latest[0] if latest else None
            except CheckpointError as e:
                error = f"checkpoint.load: {e}"
        found, error = _broadcast((found and str(found), error))
        if error:
            raise CheckpointError(error)
        return Path(found) if found else None

    def _check_deepspeed_layout(self, path: Path, saved: dict) -> None:
        """DeepSpeed's checkpoints load only on the layout that saved them: as many ranks, the same ZeRO stage."""
        now = self.info
        if saved["world_size"] != now["world_size"]:
            raise CheckpointError(f"{path} was written by {saved['world_size']} DeepSpeed ranks, "
                                  f"this run has {now['world_size']}: DeepSpeed's ZeRO partitions "
                                  "do not reshard; resume on the same number of processes")
        if saved.get("zero_stage", now["zero_stage"]) != now["zero_stage"]:
            stage = saved["zero_stage"]
            example = Path(f"configs/deepspeed/zero{stage}.json")
            raise CheckpointError(f"parallel.deepspeed_config: {path} was saved with ZeRO stage {stage}, "
                                  f"{self.cfg.parallel.deepspeed_config} has stage {now['zero_stage']}: DeepSpeed's "
                                  f"checkpoints do not load into another stage; resume with a config of stage {stage}"
                                  + (f" ({example})" if example.is_file() else ""))

    def _check_compatible(self, path: Path, saved: dict) -> None:
        now = self.info
        if saved["engine"] != now["engine"]:
            raise CheckpointError(f"{path} was written by parallel.engine={saved['engine']}, "
                                  f"this run is {now['engine']}")
        if now["engine"] == "deepspeed":
            self._check_deepspeed_layout(path, saved)
        changed = {k: (v, now["model"][k]) for k, v in saved.get("model", now["model"]).items()
                   if now["model"].get(k) != v and k != "norm_keep_output"}  # that one is memory, not the model
        # loading would fail inside DCP (other shapes) or, for settings without weights, train another model
        if changed:
            raise CheckpointError(f"{path} holds another model: " + ", ".join(
                f"model.{k} = {old} there, {new} here" for k, (old, new) in changed.items()) +
                "; set them as saved to continue it")
        if saved["global_rows"] != now["global_rows"]:
            raise CheckpointError(
                f"data.batch_size: {path} was trained on {saved['global_rows']} sequences per "
                f"micro-batch (data.batch_size × dp = {saved['global_rows'] // saved['dp']} × "
                f"{saved['dp']}), this run has {self.cfg.data.batch_size} × {self.dp}: set "
                f"data.batch_size={saved['global_rows'] // self.dp} to continue on the same batches"
                if saved["global_rows"] % self.dp == 0 else
                f"data.batch_size: {path} was trained on {saved['global_rows']} sequences per "
                f"micro-batch, which dp={self.dp} does not divide")
        for key, name in DATA_KEYS.items():
            if saved[key] != now[key]:
                raise CheckpointError(f"{name}: {path} was trained with {saved[key]}, this run "
                                      f"has {now[key]}; the data would not continue where it stopped")
        for key, name in RUN_KEYS.items():
            if saved.get(key, now[key]) != now[key]:
                raise CheckpointError(f"{name}: {path} was trained with {name} = {saved[key]}, this run has "
                                      f"{now[key]}: to train with {now[key]} from the start, give this run a "
                                      f"checkpoint.dir of its own; to continue that run, set {name}={saved[key]}")

    def resume(self, engine, sampler) -> int:
        """Restore the latest (or the named) checkpoint into `engine` and `sampler`; its step, or 0."""
        path = self._find()
        if path is None:
            return 0
        start = time.perf_counter()
        saved = store.read_marker(path)
        self._check_compatible(path, saved)
        if saved["step"] >= self.cfg.train.steps:  # nothing to load either: parallel/train.py runs no step
            if self.runtime.is_main:
                logger.warning("nothing to train: %s is at step %d and train.steps = %d; set train.steps above %d "
                               "to train on%s", path, saved["step"], self.cfg.train.steps, saved["step"],
                               " (and nothing to check: --check compares the steps a run trains)"
                               if self.cfg.train.check else "")
            return saved["step"]
        schedule_changed, optimizer_changed = self._changed(saved, SCHEDULE_KEYS), self._changed(saved, OPTIMIZER_KEYS)
        # data.corpus_bytes sizes the generated corpus only: where data.path differs, that (the first) says it all
        corpus_changed = self._changed(saved, CORPUS_KEYS)[:1]
        changed = schedule_changed + optimizer_changed + corpus_changed
        if changed and self.cfg.train.check:  # its reference trains every step with this run's settings
            raise CheckpointError(f"train.check: {path} differs from this run in {'; '.join(changed)}, and --check "
                                  "compares with a run that has this run's settings from step 1: drop "
                                  "--check, or check a run started with these settings (a new checkpoint.dir)")
        engine.load_checkpoint(path)
        use_optimizer_settings(engine.optimizer, self.cfg.train)
        if optimizer_changed and self.runtime.is_main:
            logger.warning("%s: %s; the optimizer runs with this run's settings from step %d on", path,
                           "; ".join(optimizer_changed), saved["step"] + 1)
        if corpus_changed and self.runtime.is_main:
            logger.warning("%s: %s; the batches from step %d on come from this run's corpus", path,
                           "; ".join(corpus_changed), saved["step"] + 1)
        state = torch.load(path / "train_state.pt", weights_only=False)
        if not schedule_changed:
            engine.scheduler.load_state_dict(state["scheduler"])
        else:
            # The saved schedule ends at its own train.steps (a cosine past its end rises again): the steps from
            # here on follow this run's schedule, as in a run started with its settings.
            retarget_schedule(engine.scheduler, self.cfg.train, saved["step"])
            if self.runtime.is_main:
                logger.warning("%s: %s; the LR schedule is this run's: step %d runs at lr %.2e (%.2e on the "
                               "saved schedule), as in a run started with these settings", path,
                               "; ".join(schedule_changed), saved["step"] + 1, engine.lr,
                               state["scheduler"]["_last_lr"][0])
        sampler.load_state_dict(state["sampler"])
        rng_file = path / "rng" / f"rank{self.runtime.rank}.pt"
        if rng_file.exists():
            set_rng_states(torch.load(rng_file, weights_only=False), self.runtime.device)
        elif self.runtime.is_main:
            logger.info("%s has the RNG states of %d ranks; ranks beyond keep their seeded ones",
                        path, saved["world_size"])
        self.saved_step = saved["step"]
        if self.runtime.is_main:
            self.records = self._saved_records(path, saved["step"])
            logger.info("resumed from step %d (%s, saved at dp=%d × tp=%d; loaded in %.2f s)",
                        saved["step"], path, saved["dp"], saved["tp"], time.perf_counter() - start)
        return saved["step"]

    def _changed(self, saved: dict, keys: dict) -> list[str]:
        """`setting = saved there, this here` for each of `keys` whose value differs (a checkpoint without the key
        counts as saved with this run's value)."""
        def shown(value):
            return json.dumps(value) if isinstance(value, str) else value

        return [f"{name} = {shown(saved[key])} there, {shown(self.info[key])} here" for key, name in keys.items()
                if saved.get(key, self.info[key]) != self.info[key]]

    def _saved_records(self, path: Path, step: int) -> list[dict]:
        """The records of steps 1 to `step` that the checkpoint holds. train.out_dir's metrics.jsonl is no source
        for them: another run may have written it since (the same out_dir, another checkpoint.dir)."""
        records = store.read_records(path)
        if records is None:
            logger.warning("%s holds no metrics records of its steps: metrics.jsonl, the summary and --check cover "
                           "steps %d to %d only", path, step + 1, self.cfg.train.steps)
            return []
        return [r for r in records if r["step"] <= step]

    # ---- save --------------------------------------------------------------------------------------

    def after_step(self, step: int, engine, sampler, records: list[dict]) -> None:
        """Save if `step` is due: every `checkpoint.every` steps, and the last step with at_end. `records`: rank 0's
        metrics records up to `step`."""
        c = self.cfg.checkpoint
        due = c.every and step % c.every == 0
        last = step == self.cfg.train.steps and c.at_end
        if self.root is not None and (due or last) and step != self.saved_step:
            self.save(step, engine, sampler, records)

    def save(self, step: int, engine, sampler, records: list[dict]) -> None:
        """Collective: every rank writes its part into the temporary dir, then rank 0 seals it."""
        start = time.perf_counter()
        tmp, final = store.temp_dir(self.root, step), store.step_dir(self.root, step)
        if self.runtime.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step-*"):  # left by a job that stopped mid-save
                shutil.rmtree(stale)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        engine.save_checkpoint(tmp)
        _save_synced(rng_states(self.runtime.device), tmp / "rng" / f"rank{self.runtime.rank}.pt")
        if self.runtime.is_main:
            _save_synced({"step": step, "scheduler": engine.scheduler.state_dict(),
                          "sampler": sampler.state_dict()}, tmp / "train_state.pt")
            store.write_records(tmp, records)
        _barrier()  # every rank's files are written
        if self.runtime.is_main:
            store.write_marker(tmp, {"step": step, **self.info})
            if final.exists():  # a torn step-<N> from an earlier attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            fd = os.open(self.root, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            self._prune(step)
        _barrier()
        self.saved_step = step
        if self.runtime.is_main:
            seconds = time.perf_counter() - start
            size = sum(store.list_files(final).values())
            logger.info("saved checkpoint %s (%.1f MB, %.2f s)", final, size / 1e6, seconds)
            with open(self.cfg.out_dir / "checkpoints.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "path": str(final), "bytes": size,
                                    "seconds": seconds}) + "\n")

    def _prune(self, step: int) -> None:
        """Keep the newest `keep_last` complete checkpoints up to `step` (the one just saved among them); drop older
        torn ones. Checkpoints of later steps are another run's, this one resumed from an earlier step in the same
        dir: counting them as the newest would delete this run's own, the one just saved included."""
        complete = 0
        for saved_step, path in store.candidates(self.root):
            if saved_step > step:
                continue
            try:
                store.read_marker(path)
                complete += 1
                if not self.cfg.checkpoint.keep_last or complete <= self.cfg.checkpoint.keep_last:
                    continue
            except CheckpointError:
                pass
            shutil.rmtree(path)
