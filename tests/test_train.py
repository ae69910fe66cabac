"""The main job end to end through its launchers, on 2 CPU processes (gloo), as a user runs it.

Each run is a real `launch/train.sh` / `launch/deepspeed.sh` subprocess; rank 0's summary.json,
metrics.jsonl and loss.png are checked afterwards. About 2-3 minutes on a 2-core machine.
"""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from parallel.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny_cpu.toml"
# a limit for a hung job, not a slow one: a busy machine makes these runs several times slower
HUNG_S = 1800


def launch(script: str, *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    # the launcher picks devices and backends itself (conftest sets TRITON_INTERPRET for kernels); a world of 2,
    # which the tests' layouts assume, on any host (the launcher's default is one process per visible GPU)
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHARDNORM_BACKEND", "TRITON_INTERPRET")} | {"NPROC": "2"} | env_vars
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=HUNG_S)


def run_ok(script: str, out_dir: Path, *args: str) -> tuple[dict, list[dict]]:
    summary, records, _ = run_with_output(script, out_dir, *args)
    return summary, records


def run_with_output(script: str, out_dir: Path, *args: str) -> tuple[dict, list[dict], str]:
    """`run_ok`'s summary and records, and the run's stdout and stderr."""
    if "--check" in args and torch.cuda.is_available():
        # cuBLAS sums a sharded matmul in another order than the whole one, and 40 steps at tiny_cpu's lr grow
        # that fp32 rounding to ~5e-4 of the loss (2 H200s); on CPU (gloo) the default 1e-4 holds
        args = (*args, "train.check_rtol=2e-3")
    result = launch(script, *args, f"train.out_dir={json.dumps(str(out_dir))}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "summary:" in result.stdout
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out_dir / "summary.json").read_text()), records, result.stdout + result.stderr


@pytest.mark.distributed
def test_default_config_trains_and_matches_single_process(tmp_path):
    summary, records = run_ok("train.sh", tmp_path, TINY, "--check", "train.profile_step=3")
    train = tomllib.loads((ROOT / TINY).read_text())["train"]
    steps = train["steps"]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert (summary["norm"], summary["dp"], summary["tp"]) == ("shardnorm", 1, 2)
    assert summary["check_passed"] and summary["check_max_rel_diff"] <= summary["check_rtol"]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < 0.6 * first, (first, last)
    assert summary["final_loss"] == last
    assert summary["tokens_per_s"] > 0 and summary["step_time_s"] > 0
    assert summary["peak_mem_gib"] > 0
    # each step's host time per phase (tp=2 with shardnorm: the reducer's finalize_grads), inside the step's time
    for r in records:
        phases = r["host_ms"]
        assert set(phases) == {"forward", "backward", "finalize_grads", "clip_grad_norm", "optimizer", "gpu_wait"}
        assert min(phases.values()) >= 0 and sum(phases.values()) <= r["step_time_s"] * 1e3, r
    # the profiled step: all sequence-parallel norm grads in one bucket, one all-reduce; left out of timing
    assert (summary["profiled_step"], summary["norm_grad_all_reduces"]) == (3, 1)
    timing_skip = train.get("timing_skip", TrainConfig.timing_skip)
    assert summary["timed_steps"] == steps - timing_skip - 1 and records[2]["profiled"]

    compare = subprocess.run([sys.executable, "-m", "parallel.compare", str(tmp_path), "--plot",
                              str(tmp_path / "compare.png")], cwd=ROOT, text=True,
                             capture_output=True)
    assert compare.returncode == 0, compare.stderr
    assert "| shardnorm | false | dp=1 × tp=2 | float32 |" in compare.stdout
    assert (tmp_path / "compare.png").exists()


@pytest.mark.distributed
def test_data_parallel_fsdp_with_torch_norms(tmp_path):
    """dp=2 × tp=1: FSDP2 reduce-scatter with accumulation; the --norm switch."""
    summary, records = run_ok("train.sh", tmp_path, TINY, "--norm", "torch", "--check",
                              "parallel.tp=1", "train.steps=4", "train.timing_skip=1")
    assert (summary["norm"], summary["dp"], summary["tp"]) == ("torch", 2, 1)
    assert summary["check_passed"] and len(records) == 4


@pytest.mark.distributed
def test_compiled_blocks_deeper_than_the_recompile_limit(tmp_path):
    """torch.compile per block with shardnorm's sequence-parallel norms under FSDP2 x TP: more blocks
    than dynamo's recompile limit (8) must compile once, not once per block, and match --check."""
    summary, records = run_ok("train.sh", tmp_path, TINY, "--compile", "--check", "model.n_layers=9",
                              "train.steps=3", "train.timing_skip=1")
    assert summary["compile"] and summary["check_passed"] and len(records) == 3


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_zero3(tmp_path):
    """Also: the run leaves no DeepSpeed shared-memory workspace behind (on CPU DeepSpeed's all-reduce maps one per
    rank, 66 MB, and never unlinks it; `parallel.runtime.release_deepspeed_shm`)."""
    summary, records, output = run_with_output("deepspeed.sh", tmp_path, TINY, "--check",
                                               "parallel.deepspeed_config=configs/deepspeed/zero3.json",
                                               "train.steps=4", "train.timing_skip=1")
    assert (summary["engine"], summary["dp"], summary["tp"]) == ("deepspeed", 2, 1)
    assert summary["check_passed"] and len(records) == 4
    port = re.search(r"--master_port[= ](\d+)", output).group(1)
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_config_s_shardnorm_section_error_is_one_line(tmp_path):
    """A bad key in the DeepSpeed JSON's "shardnorm" section (checked by the ranks, when the engine starts): the job's
    one line naming the setting, the file and the key, exit code 2; no traceback per rank."""
    ds_config = tmp_path / "zero2.json"
    ds_config.write_text(json.dumps({**json.loads((ROOT / "configs/deepspeed/zero2.json").read_text()),
                                     "shardnorm": {"bogus": 1}}))
    result = launch("deepspeed.sh", TINY, "train.steps=2", "train.timing_skip=1",
                    f"parallel.deepspeed_config={json.dumps(str(ds_config))}",
                    f"train.out_dir={json.dumps(str(tmp_path / 'out'))}")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert result.stderr.count(f"config error: parallel.deepspeed_config: {ds_config}: shardnorm.bogus: unknown "
                               "key") == 1, output[-3000:]
    assert "Traceback" not in output and " failed: " not in output, output[-3000:]


def check_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel.config", TINY, *args], cwd=ROOT,
                          text=True, capture_output=True)


@pytest.mark.parametrize("override, message", [
    ("model.n_layer=2", "model.n_layer: unknown key (did you mean model.n_layers?)"),
    ("train.seq_len=64", "train.seq_len: unknown key (did you mean data.seq_len?)"),
    ("train.steps=abc", "train.steps: expected int, got str"),
    ("train.compile=1", "train.compile: expected bool, got int"),
    # values are TOML: what it does not read as a number or a bool is a string, which says nothing of why
    ("train.lr=.001", "train.lr: expected float, got str '.001': write a TOML number (0.001, 1e-3, 20)"),
    ("train.check=True", "train.check: expected bool, got str 'True': write true or false"),
    ("train.norm=apex", "train.norm: 'apex' is not one of shardnorm, torch"),
    # torch takes seeds below 2**64 (and ended in a traceback per rank at the first one above)
    ("train.seed=18446744073709551616", "train.seed: must be from 0 to 2**64 - 1 (torch's seeds), got "
     "18446744073709551616"),
    ("optim.lr=1", "optim: unknown section"),
    ("train.steps", "override 'train.steps': expected section.key=value"),
    ("model.n_kv_heads=3", "model.n_kv_heads: 3 does not divide model.n_heads"),
    ("parallel.dp=2", "parallel.dp × parallel.tp = 2 × 2 = 4, but the world size is 2"),
    # the DeepSpeed engine never read train.compile, yet its summary said compile=True
    ("parallel.engine=deepspeed parallel.tp=1 train.compile=true",
     "train.compile: the DeepSpeed engine does not compile the model here"),
    # refused before any process starts: unchecked, each ends in a traceback once training has started (the sampler;
    # the first save; the metrics files)
    ("data.corpus_bytes=129", "data.corpus_bytes: 129 bytes are too few for windows of data.seq_len + 1 = 129 "
     "tokens: set data.corpus_bytes above 129 or lower data.seq_len"),
    ("checkpoint.dir=pyproject.toml", "checkpoint.dir: pyproject.toml is a file, not a directory: name a directory"),
    ("checkpoint.dir=pyproject.toml/ck", "checkpoint.dir: pyproject.toml/ck cannot be created: pyproject.toml is a "
     "file; name a directory"),
    ("train.out_dir=pyproject.toml", "train.out_dir: pyproject.toml is a file, not a directory"),
    # no process can create anything in /proc, root included (whom permission bits do not stop)
    ("train.out_dir=/proc/shardnorm-out", "train.out_dir: /proc is not writable"),
    ("checkpoint.dir=/proc/shardnorm-ck", "checkpoint.dir: /proc is not writable"),
    # checked before any process starts: each rank reading it would end in a traceback
    ("parallel.engine=deepspeed parallel.tp=1 parallel.deepspeed_config=configs/tiny_cpu.toml",
     "parallel.deepspeed_config: configs/tiny_cpu.toml is not valid JSON: Expecting value: line 1 column 1"),
    # a checkpoint.dir that no checkpoint would ever be saved to: known only when one is needed
    ("checkpoint.dir=/tmp/shardnorm-ck checkpoint.at_end=false", "checkpoint.at_end: false with checkpoint.every = 0 "
     "saves no checkpoint to checkpoint.dir"),
])
def test_config_errors_name_the_key(override, message):
    result = check_config(*override.split(), "--world-size", "2")
    assert result.returncode != 0
    assert f"config error: {message}" in result.stderr


def test_overrides_and_flags_apply():
    result = check_config("train.steps=7", "model.tie_embeddings=true", "--norm", "torch",
                          "--compile", "--world-size", "2")
    assert result.returncode == 0, result.stderr
    for line in ("steps = 7", "tie_embeddings = true", 'norm = "torch"', "compile = true"):
        assert line in result.stdout.splitlines()


def test_launcher_rejects_bad_config_before_starting():
    result = launch("train.sh", TINY, "parallel.dp=2")
    assert result.returncode != 0
    assert "config error: parallel.dp × parallel.tp" in result.stderr
    assert "step" not in result.stdout


@pytest.mark.parametrize("setting", ["data.corpus_bytes=100", "data.path", "checkpoint.dir", "train.out_dir"])
def test_launcher_refuses_unusable_data_and_paths_before_starting(tmp_path, setting):
    """A corpus too short for one window, a file where a directory goes: one line naming the setting and the fix,
    before torchrun starts, instead of a traceback per rank once training has started."""
    short, a_file = tmp_path / "short.txt", tmp_path / "a_file"
    short.write_text("a few words")
    a_file.write_text("")
    override = {"data.path": f"data.path={json.dumps(str(short))}", "train.out_dir": "",
                "checkpoint.dir": f"checkpoint.dir={json.dumps(str(a_file))}"}.get(setting, setting)
    out_dir = a_file if setting == "train.out_dir" else tmp_path / "out"
    result = launch("train.sh", TINY, *filter(None, [override]), "train.steps=2",
                    f"train.out_dir={json.dumps(str(out_dir))}")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    key = setting.split("=")[0]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"config error: {key}: "), result.stderr[-3000:]
    assert "step" not in result.stdout


def test_generated_corpus_has_the_bytes_asked_for():
    """data.corpus_bytes is the corpus's length (the config check counts windows from it), whatever the size."""
    from parallel.data import generate_corpus

    assert [n for n in range(1, 400) for seed in (0, 1, 2) if len(generate_corpus(n, seed)) != n] == []


def launcher_command(launcher: str, script: Path) -> list[str]:
    """`script` on 2 ranks through parallel.launcher, as launch/train.sh (torchrun) or launch/deepspeed.sh start it."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "parallel.launcher", "torchrun", "--standalone", "--nproc-per-node", "2",
                str(script)]
    from parallel.runtime import free_port

    return [sys.executable, "-m", "parallel.launcher", "deepspeed", "--num_gpus", "2", "--master_port",
            str(free_port()), "--no_local_rank", str(script)]


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("deepspeed", marks=[
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")])])
@pytest.mark.parametrize("rank_does, code, line", [
    # as train.py from its first line on (parallel/stop.py), a rank notes the launcher's SIGTERM rather than dying
    # of it: the launcher stops rank 0 when the other rank exits first, and rank 0 prints the error all the same
    ("signal.signal(signal.SIGTERM, lambda *_: None); "
     "print('config error: model.dim: …', file=sys.stderr) if rank == 0 else None; sys.exit(2)", 2, None),
    ("raise ValueError(f'rank {rank} breaks') if rank == 1 else time.sleep(60)", 1,
     "script.py failed: rank 1 exited with code 1 (its error is above)"),
    ("os.kill(os.getpid(), signal.SIGKILL) if rank == 1 else time.sleep(60)", 128 + 9,
     "script.py failed: rank 1 was ended by SIGKILL"),
])
def test_launcher_reports_a_failed_rank_in_one_line(tmp_path, launcher, rank_does, code, line):
    """The job's own error (exit code 2) comes alone; any other failure gets one line naming the rank, not torchrun's
    traceback and ChildFailedError report, nor DeepSpeed's launcher's lines about killing the ranks and the failed
    command; the exit code is the rank's (128 + the signal's number for a signal)."""
    script = tmp_path / "script.py"
    script.write_text(f"import os, signal, sys, time\nrank = int(os.environ['RANK'])\n{rank_does}\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"DS_ACCELERATOR": "cpu"}
    result = subprocess.run(launcher_command(launcher, script), cwd=ROOT, env=env, text=True, capture_output=True,
                            timeout=HUNG_S)
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    assert "ChildFailedError" not in output and "launch_agent" not in output, output[-3000:]
    assert "failed (exitcode" not in output, output[-3000:]
    assert "exits with return code" not in output and "Killing subprocess" not in output, output[-3000:]
    if line is None:
        assert result.stderr.count("config error") == 1 and " failed: " not in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    else:
        assert result.stderr.count(line) == 1, output[-3000:]


def test_retargeted_schedule_is_a_new_run_s():
    """A run of 8 steps extended to 14: from step 9 on, the LR of a run started with 14 steps (bitwise), not the
    8-step cosine continued past its end, which climbs back to the peak."""
    from parallel.engines import build_optimizer, retarget_schedule

    old, new = TrainConfig(steps=8, warmup_steps=2), TrainConfig(steps=14, warmup_steps=2)
    model = torch.nn.Linear(3, 5)
    optimizer, scheduler = build_optimizer(model, old)
    fresh_optimizer, fresh = build_optimizer(torch.nn.Linear(3, 5), new)
    for _ in range(8):
        for o, s in ((optimizer, scheduler), (fresh_optimizer, fresh)):
            o.step()
            s.step()
    saved = optimizer.state_dict()  # its param group's lr is the old schedule's
    optimizer, scheduler = build_optimizer(model, new)  # the resumed run's, from its settings
    optimizer.load_state_dict(saved)
    retarget_schedule(scheduler, new, 8)
    lrs = []
    for _ in range(9, 15):
        assert scheduler.get_last_lr() == fresh.get_last_lr()
        assert optimizer.param_groups[0]["lr"] == fresh_optimizer.param_groups[0]["lr"]
        lrs.append(scheduler.get_last_lr()[0])
        for o, s in ((optimizer, scheduler), (fresh_optimizer, fresh)):
            o.step()
            s.step()
    assert lrs == sorted(lrs, reverse=True), lrs


@pytest.mark.parametrize("warmup_steps, steps", [(5, 40), (0, 10), (1, 3), (10, 60), (7, 7)])
def test_lr_schedule_is_warmup_then_cosine_to_a_tenth(warmup_steps, steps):
    """torch's LinearLR + CosineAnnealingLR give the schedule's closed form at every step."""
    import math

    import torch

    from parallel.engines import build_optimizer

    lr = 2.5e-3
    model = torch.nn.Linear(3, 5)
    optimizer, scheduler = build_optimizer(model, TrainConfig(lr=lr, warmup_steps=warmup_steps,
                                                              steps=steps))
    for step in range(steps):
        if step < warmup_steps:
            expected = lr * (step + 1) / (warmup_steps + 1)
        else:
            progress = (step - warmup_steps) / max(1, steps - warmup_steps)
            expected = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        assert scheduler.get_last_lr()[0] == pytest.approx(expected, rel=1e-12), step
        assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()


def test_summary_leaves_out_each_process_s_warm_up_steps(tmp_path):
    """A run resumed at step 6 warms up (and compiles) again: the summary's throughput leaves out the first
    `timing_skip` steps of each process, not only the run's first (the resumed step's compile time is not timed)."""
    from parallel.metrics import MetricsLogger

    def step(n, seconds):
        return {"step": n, "loss": 1.0, "lr": 1e-3, "tokens": 100, "step_time_s": seconds, "tokens_per_s": 0.0,
                "peak_mem_gib": 0.1}

    first = MetricsLogger(tmp_path, 8, enabled=True)
    first.start(1)
    for n in range(1, 6):
        first.log_step(step(n, 10.0 if n <= 2 else 1.0))
    first.file.close()
    resumed = MetricsLogger(tmp_path, 8, enabled=True)
    resumed.start(6, first.records)
    for n in range(6, 9):
        resumed.log_step(step(n, 10.0 if n <= 7 else 1.0))
    summary = resumed.summarize(2, {})
    assert summary["timed_steps"] == 4 and summary["step_time_s"] == 1.0, summary  # steps 3, 4, 5 and 8


@pytest.mark.parametrize("first_step", [1, 5])
def test_a_run_s_start_leaves_no_summary_of_the_run_before(tmp_path, first_step):
    """A run in an out_dir that another run finished in: from its first step on, summary.json and loss.png are not
    the other run's (a stop or a crash would leave them beside this run's metrics.jsonl, and parallel.compare takes
    a summary.json for a finished run); checkpoints.jsonl keeps its lines only when the run resumes."""
    from parallel.metrics import MetricsLogger

    for name in ("summary.json", "loss.png", "checkpoints.jsonl"):
        (tmp_path / name).write_text("the run before's\n")
    MetricsLogger(tmp_path, 8, enabled=True).start(first_step)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "loss.png").exists()
    assert (tmp_path / "checkpoints.jsonl").exists() == (first_step > 1)


def test_paths_starting_with_a_tilde_are_in_the_home_directory(tmp_path):
    """The shell leaves `~` alone in `train.out_dir=~/runs` (not a variable assignment): the job expands it (in the
    config file's paths too), instead of writing into a directory named `~` in the current one."""
    result = subprocess.run([sys.executable, "-m", "parallel.config", TINY, "train.out_dir=~/runs",
                             "checkpoint.dir=~/ck", "--world-size", "2"], cwd=ROOT, text=True, capture_output=True,
                            env=os.environ | {"HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"out_dir = {json.dumps(str(tmp_path / 'runs'))}" in lines and f"dir = {json.dumps(str(tmp_path / 'ck'))}" \
        in lines, result.stdout


@pytest.mark.parametrize("config, message", [
    ("configs", "config file configs is a directory: name a TOML file, e.g. configs/tiny_cpu.toml"),
    ("binary", "is not a UTF-8 text file: name a TOML file, e.g. configs/tiny_cpu.toml"),
    ("train.steps=3", "config file train.steps=3 does not exist (the config file comes first: CONFIG "
     "[section.key=value ...])"),
])
def test_config_file_that_cannot_be_read_is_named(tmp_path, config, message):
    """One line naming the file, not a traceback (a directory, bytes that are not text), and for an override given
    first, where the config file goes, what the order is."""
    if config == "binary":
        config = str(tmp_path / "model.bin")
        Path(config).write_bytes(bytes(range(256)))
    result = subprocess.run([sys.executable, "-m", "parallel.config", config, *([TINY] if "=" in config else [])],
                            cwd=ROOT, text=True, capture_output=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("config error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("nan_at", [0, 2])
def test_check_fails_on_a_nan_loss(nan_at):
    """A step whose loss is NaN (in the run or its reference) fails --check wherever it is: max() over relative
    differences passes a NaN by, unless it comes first, as NaN compares false with everything."""
    from parallel.train import check

    reference = [5.0, 4.0, 3.0, 2.5]
    records = [{"step": step, "loss": loss} for step, loss in enumerate(reference, start=1)]
    records[nan_at]["loss"] = float("nan")
    assert not check(records, reference, 1e-4)["check_passed"]
    assert not check([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}], [5.0, float("nan")], 1e-4)["check_passed"]


@pytest.mark.parametrize("script", ["train.sh", pytest.param("deepspeed.sh", marks=pytest.mark.deepspeed)])
def test_ctrl_c_before_the_ranks_start_is_one_line(tmp_path, script):
    """Ctrl-C while the launcher script looks for GPUs (its `import torch` takes seconds): one line and the exit code
    130, as for a Ctrl-C in the launcher itself, not a KeyboardInterrupt traceback from the middle of torch's import.
    A `torch` first on the path that blocks on import, once it says so, stands in for torch's import."""
    import signal
    import time

    ready = tmp_path / "importing"
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"import time\nopen({str(ready)!r}, 'w').close()\n"
                                                    "time.sleep(600)\n")
    env = os.environ | {"PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    # SIGINT as a terminal's foreground job has it: a runner started in the background without job control (a CI
    # script under `cmd &`) passes SIGINT on ignored, and Python then never raises KeyboardInterrupt
    job = subprocess.Popen(["bash", f"launch/{script}", TINY], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while not ready.exists():
        assert job.poll() is None, job.communicate()
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to the whole foreground process group
    out, err = job.communicate(timeout=HUNG_S)
    assert job.returncode == 128 + signal.SIGINT, out[-2000:] + err[-2000:]
    assert err.strip() == "stopped by SIGINT before the ranks started", err[-3000:]


def test_a_stop_in_the_report_says_a_resume_trains_nothing(tmp_path, caplog):
    """A stop after the last step (in the summary or --check's reference run) names no step to resume after: a
    checkpoint of the last step resumes with nothing to train and reports nothing, so "the same command resumes"
    would send the user to a run that never checks."""
    import logging
    import signal

    from parallel.config import load
    from parallel.train import _say_stopped

    cfg = load(TINY, ["train.steps=3", f"train.out_dir={json.dumps(str(tmp_path))}", "train.check=true"])

    class Records:
        records = [{"step": s} for s in (1, 2, 3)]

    with caplog.at_level(logging.WARNING):
        _say_stopped(cfg, Records(), signal.SIGINT)
    assert "stopped by SIGINT after the last step (3), in the run's report (summary.json, loss.png, --check's " \
           "reference run)" in caplog.text, caplog.text
    assert "trains nothing and reports nothing" in caplog.text and "resumes from it" not in caplog.text
