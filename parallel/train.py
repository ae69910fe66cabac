"""Train the Llama-style decoder with shardnorm (or torch) norms; the project's main job.

    launch/train.sh configs/tiny_cpu.toml [section.key=value ...] [--norm torch] [--check]

or directly `torchrun --nproc-per-node N -m parallel.train CONFIG ...` from the repository root.
Rank 0 logs every step and writes metrics.jsonl, summary.json and loss.png to the output dir;
`--check` then re-runs the same steps in one process with torch norms and compares the losses.
With `checkpoint.dir=D` it saves to D (every `checkpoint.every` steps) and, started again, resumes
from the latest complete checkpoint there (parallel/checkpoint.py). Stopped by SIGINT or SIGTERM, rank 0
says which checkpoint the same command would resume from, and the job exits with 128 + the signal's number.
"""

from parallel.stop import Stopped, StopSignals

# Run as the job: from here on, before the imports (seconds of them), a stop ends the run with one line
# saying how to resume (main()).
STOP = StopSignals() if __name__ == "__main__" else None

import contextlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh

from parallel.checkpoint import Checkpointer, resume_hint
from parallel.checkpoint_store import CheckpointError
from parallel.collectives import profiled_collectives
from parallel.config import Config, ConfigError, parse_args
from parallel.data import BatchSampler, load_tokens
from parallel.engines import DeepSpeedEngine, TorchEngine
from parallel.launcher import REPORTED
from parallel.metrics import MetricsLogger, logger, setup_logging
from parallel.model import build_model
from parallel.parallelize import parallelize, uses_norm_reducer
from parallel.run_dirs import hold_run_dirs
from parallel.runtime import CollectivePhase, Runtime, init_runtime, shutdown


def build_engine(cfg: Config, runtime: Runtime, dp: int, tp: int):
    """The parallelized model with its optimizer, and this rank's data-parallel index."""
    deepspeed = cfg.parallel.engine == "deepspeed"
    # DeepSpeed converts torch norms itself, from the "shardnorm" section of its config
    norm = "torch" if deepspeed else cfg.train.norm
    model = build_model(cfg.model, norm, runtime.device, cfg.train.seed)
    if runtime.is_main:
        logger.info("%s: %.2fM parameters, %s norms, engine %s, dp=%d × tp=%d on %s", cfg.name,
                    sum(p.numel() for p in model.parameters()) / 1e6, cfg.train.norm,
                    cfg.parallel.engine, dp, tp, runtime.device)
    if deepspeed:
        return DeepSpeedEngine(model, cfg.train, cfg.parallel.deepspeed_config, cfg.data.batch_size,
                               keep_output=cfg.model.norm_keep_output), runtime.rank
    mesh = init_device_mesh(runtime.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    engine = TorchEngine(parallelize(model, mesh, cfg.train), cfg.train,
                         norm_reducer=uses_norm_reducer(cfg.train.norm, tp))
    return engine, mesh["dp"].get_local_rank()


def train(cfg: Config, runtime: Runtime, metrics: MetricsLogger, dp: int, tp: int, stop: StopSignals) -> dict:
    """Run the steps (after resuming from a checkpoint, if there is one); returns the profiled
    step's norm-grad collectives (empty without train.profile_step). A stop signal during the steps ends them
    on every rank at the same step's loss all-reduce (`StopSignals.deferred`), raising `Stopped`."""
    engine, dp_rank = build_engine(cfg, runtime, dp, tp)
    collectives: dict = {}
    tokens = load_tokens(cfg.data.path, cfg.data.corpus_bytes, cfg.train.seed)
    sampler = BatchSampler(tokens, cfg.data.seq_len, cfg.data.batch_size, cfg.train.grad_accum,
                           cfg.train.seed, dp_rank, dp)
    checkpointer = Checkpointer(cfg, runtime, dp, tp)
    phase = CollectivePhase(cfg.parallel.timeout_s, runtime.rank)
    with phase("resuming from a checkpoint"):
        first_step = checkpointer.resume(engine, sampler) + 1
    if first_step > cfg.train.steps:  # nothing left to train (resume() has said so)
        # nothing to report either: out_dir's files stay as they are (metrics.start, which rewrites metrics.jsonl,
        # does not run, and main() reports only when there are records)
        return {}
    if 0 < cfg.train.profile_step < first_step and runtime.is_main:
        logger.warning("train.profile_step = %d is before step %d, where this run resumes: no step is profiled; set "
                       "train.profile_step to a step from %d on", cfg.train.profile_step, first_step, first_step)
    if cfg.train.compile and runtime.is_main:
        # else the first step is silent for as long as it compiles
        logger.info("torch.compile: step %d compiles the blocks first (tiny_cpu on 2 CPU cores: 0.5 to 2 min; "
                    "longer for larger models), the steps after it run compiled", first_step)
    metrics.start(first_step, checkpointer.records)
    tokens_per_step = dp * cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum
    with stop.deferred():  # a stop ends the steps on every rank at the same step's loss all-reduce
        for step in range(first_step, cfg.train.steps + 1):
            micro_batches = sampler.next_step(runtime.device)
            runtime.reset_peak_memory()
            start = runtime.now()
            lr = engine.lr
            profiled = step == cfg.train.profile_step
            profiler = (profiled_collectives(runtime.device.type == "cuda",
                                             str(cfg.out_dir / f"profile_rank{runtime.rank}.json.gz"))
                        if profiled else contextlib.nullcontext())
            with phase(f"step {step}: forward, backward and optimizer step"), profiler as found:
                loss = engine.step(micro_batches)
            seconds = runtime.now() - start
            if profiled:
                collectives = {"profiled_step": step, **found}
                if runtime.is_main:
                    logger.info("step %d norm-grad collectives: %s", step, found)
            with phase(f"step {step}: the loss all-reduce"):
                mean_loss, signum = runtime.mean_over_ranks(loss, stop.signum)
            metrics.log_step({"step": step, "loss": mean_loss, "lr": lr,
                              "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / seconds,
                              "step_time_s": seconds, "host_ms": engine.host_ms,
                              "peak_mem_gib": runtime.peak_memory_gib(),
                              **({"profiled": True} if profiled else {})})
            if signum is not None:  # every rank here, this step
                raise Stopped(signum)
            with phase(f"step {step}: saving a checkpoint"):
                checkpointer.after_step(step, engine, sampler, metrics.records)
    return collectives


def reference_losses(cfg: Config, device: torch.device, dp: int) -> list[float]:
    """The same steps in this process alone: torch norms, no sharding, the whole global batch."""
    model = build_model(cfg.model, "torch", device, cfg.train.seed)
    engine = TorchEngine(model, cfg.train)
    tokens = load_tokens(cfg.data.path, cfg.data.corpus_bytes, cfg.train.seed)
    sampler = BatchSampler(tokens, cfg.data.seq_len, cfg.data.batch_size * dp,
                           cfg.train.grad_accum, cfg.train.seed)
    return [engine.step(sampler.next_step(device)) for _ in range(cfg.train.steps)]


def check(records: list[dict], reference: list[float], rtol: float) -> dict:
    """Each logged step's loss against the reference's loss of the same step."""
    losses = [r["loss"] for r in records]
    reference = [reference[r["step"] - 1] for r in records]
    differences = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    # a NaN compares false with everything: max() would pass it by unless it came first
    worst = math.nan if any(map(math.isnan, differences)) else max(differences)
    passed = worst <= rtol
    logger.info("check: max relative loss difference vs single-process torch norms over %d "
                "steps: %.3e (rtol %.0e) %s", len(losses), worst, rtol,
                "PASSED" if passed else "FAILED")
    return {"check_max_rel_diff": worst, "check_rtol": rtol, "check_passed": passed}


def report(cfg: Config, runtime: Runtime, metrics: MetricsLogger, world_size: int, dp: int, tp: int,
           collectives: dict) -> None:
    """Rank 0 after training: the summary, with --check the single-process comparison, and the files."""
    summary = metrics.summarize(cfg.train.timing_skip, {
        "config": cfg.name, "norm": cfg.train.norm,
        # torch's norms have no such option: the key is left out for them
        **({"norm_keep_output": cfg.model.norm_keep_output} if cfg.train.norm == "shardnorm" else {}),
        "engine": cfg.parallel.engine,
        "world_size": world_size, "dp": dp, "tp": tp, "compile": cfg.train.compile,
        "dtype": cfg.train.dtype, "device": str(runtime.device),
        "memory_kind": runtime.memory_kind, **collectives})
    reference = None
    if cfg.train.check:
        reference = reference_losses(cfg, runtime.device, dp)
        summary.update(check(metrics.records, reference, cfg.train.check_rtol))
    metrics.finish(summary, reference)
    if not summary.get("check_passed", True):
        sys.exit(1)


def main() -> None:
    stop = STOP or StopSignals()
    # Under TP the root returns its logits as a view of the local shard; the loss never modifies
    # them in place, which is what FSDP2 warns about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg, _ = parse_args()
        dp, tp = cfg.mesh_shape(world_size)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(REPORTED)  # the launcher adds nothing to the error
    metrics = None
    try:
        stop.arm()
        runtime = init_runtime(deepspeed=cfg.parallel.engine == "deepspeed",
                               timeout_s=cfg.parallel.timeout_s)
        setup_logging(runtime.is_main)
        hold_run_dirs(cfg, runtime.is_main, runtime.from_main)
        metrics = MetricsLogger(cfg.out_dir, cfg.train.steps, runtime.is_main, cfg.train.tensorboard)
        collectives = train(cfg, runtime, metrics, dp, tp, stop)
        shutdown()
        if runtime.is_main and metrics.records:
            report(cfg, runtime, metrics, world_size, dp, tp, collectives)
    except (ConfigError, CheckpointError) as e:  # a directory in use; a checkpoint that does not fit
        shutdown(wait_for_peers=False)
        if runtime.is_main:
            print(f"{'config' if isinstance(e, ConfigError) else 'checkpoint'} error: {e}", file=sys.stderr)
        sys.exit(REPORTED)  # the launcher adds nothing to the error
    except BaseException as error:
        if isinstance(error, Stopped):  # said before the shutdown, which a launcher stopping the ranks may cut short
            _say_stopped(cfg, metrics, error.signum)
            with contextlib.suppress(Stopped):  # a second signal
                shutdown(wait_for_peers=False)
            sys.exit(128 + error.signum)  # the shell's code for a process ended by the signal
        try:
            shutdown(wait_for_peers=False)  # the launcher stops the other ranks
            # a collective that failed because a peer has left: that peer may have been stopped before this rank
            peer_gone = isinstance(error, RuntimeError) and world_size > 1
            signum = stop.wait(5) if peer_gone else stop.signum
        except Stopped:  # the signal came during the above
            signum = stop.signum
        if signum is None:
            raise
        _say_stopped(cfg, metrics, signum)
        sys.exit(128 + signum)


def _say_stopped(cfg: Config, metrics: MetricsLogger | None, signum: int) -> None:
    """Rank 0's one line for a stop: after which step, and what the same command resumes from."""
    if os.environ.get("RANK", "0") != "0":
        return
    done = metrics.records[-1]["step"] if metrics and metrics.records else 0
    name = signal.Signals(signum).name
    if done < cfg.train.steps:
        logger.warning("stopped by %s %s; %s", name, f"after step {done} of {cfg.train.steps}" if done else
                       "before the first step", resume_hint(cfg))
        return
    # in the report: a checkpoint of the last step resumes with nothing to train, and so reports nothing
    logger.warning("stopped by %s after the last step (%d), in the run's report (summary.json, loss.png%s): "
                   "metrics.jsonl in %s holds every step; a resume from a checkpoint of the last step trains "
                   "nothing and reports nothing", name, done, ", --check's reference run" if cfg.train.check else "",
                   cfg.out_dir)


if __name__ == "__main__":
    main()
