"""Checkpoint and resume of the main job, through its launchers, as a user runs it (2 CPU processes).

An uninterrupted run saving every 2 steps is the reference. A run killed with SIGKILL after a
checkpoint exists, started again with the same command, must log every step's loss equal to the
reference's (bitwise: same layout, same reduction order); a checkpoint resumed on another dp × tp
layout or in one process must match to 1e-5. Torn checkpoints are skipped with a warning naming
them; an explicitly named unreadable one is an error. DeepSpeed resumes through its own checkpoint.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel import checkpoint_store as store
from parallel.runtime import free_port

# every test here starts the main job on 2 processes, or reads the checkpoints such a run wrote (`reference`)
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny_cpu.toml"
# Limits for a hung job, not a slow one: these jobs take under a minute on a quiet 2-core machine and
# several times that while other jobs share it.
HUNG_S = 1800
STEPS = 8
SMALL = ["model.dim=48", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_dim=80", "model.max_seq_len=32", "data.seq_len=32", "data.batch_size=4",
         "data.corpus_bytes=20000", f"train.steps={STEPS}", "train.timing_skip=1"]


def env() -> dict:
    """A world of 2 for launch/train.sh on any host (its default is one process per visible GPU)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("SHARDNORM_BACKEND", "TRITON_INTERPRET")} | {"NPROC": "2"}


def job_args(tmp: Path, *extra: str) -> list[str]:
    return [TINY, *SMALL, f"checkpoint.dir={json.dumps(str(tmp / 'ck'))}", "checkpoint.every=2",
            f"train.out_dir={json.dumps(str(tmp / 'out'))}", *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def losses(tmp: Path) -> dict[int, float]:
    lines = (tmp / "out" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted dp=1 × tp=2 run; its checkpoints are reused below."""
    tmp = tmp_path_factory.mktemp("reference")
    run(["bash", "launch/train.sh", *job_args(tmp)])
    return tmp, losses(tmp)


def children(pid: int) -> list[int]:
    """The processes `pid` started (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, as a crash of the whole job would."""
    tree, todo = [pid], [pid]
    while todo:
        below = children(todo.pop())
        tree += below
        todo += below
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in tree[1:]:
        while Path(f"/proc/{p}").exists() and "Z" not in _state(p):
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def copy_checkpoint(reference: Path, step: int, tmp: Path) -> None:
    shutil.copytree(store.step_dir(reference / "ck", step), store.step_dir(tmp / "ck", step))


def start_until_checkpoint(cmd: list[str], tmp: Path, step: int) -> subprocess.Popen:
    """Start `cmd` (in a session of its own, its output in tmp/first.log) and return once its checkpoint of
    `step` is complete. The job runs at the lowest priority, so that on a busy machine this process still sees
    the checkpoint appear (and can stop the job) before the job has finished its remaining steps."""
    log = open(tmp / "first.log", "w")
    job = subprocess.Popen(["nice", "-n", "19", *cmd], cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    deadline = time.monotonic() + HUNG_S
    while not (store.step_dir(tmp / "ck", step) / store.MARKER).exists():
        assert job.poll() is None, (tmp / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint at step {step}"
        time.sleep(0.02)
    return job


def test_sigkill_then_same_command_resumes_exactly(reference, tmp_path):
    ref_dir, ref = reference
    assert sorted(ref) == list(range(1, STEPS + 1))
    # checkpoint.keep_last = 2 (the default): steps 2 and 4 were deleted
    assert [s for s, _ in store.candidates(ref_dir / "ck")] == [8, 6]
    cmd = ["bash", "launch/train.sh", *job_args(tmp_path)]
    job = start_until_checkpoint(cmd, tmp_path, 4)
    kill_tree(job.pid)  # torchrun and both ranks (in sessions of their own), mid-run
    assert job.wait(HUNG_S) == -signal.SIGKILL
    saved, _ = store.latest(tmp_path / "ck", warn=lambda message: None)
    step = store.read_marker(saved)["step"]
    assert step < STEPS, "the job finished before it was killed"
    # a newer checkpoint whose shard was cut short (as by a full disk): complete.json still there
    torn = store.step_dir(tmp_path / "ck", step + 1)
    shutil.copytree(saved, torn)
    shard = torn / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    result = run(cmd)
    assert f"resumed from step {step} ({saved}" in result.stdout
    assert f"skipping torn checkpoint: {torn} is torn: dcp/__0_0.distcp has 100 bytes" in result.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == ref  # bitwise, every step


@pytest.mark.parametrize("launcher, how", [
    ("train.sh", "ctrl_c"), ("train.sh", "sigterm"),
    pytest.param("deepspeed.sh", "sigterm", marks=[pytest.mark.deepspeed, pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")])])
def test_stop_signal_says_how_to_resume(reference, tmp_path, launcher, how):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) or SIGTERM to the launcher (as
    `kill` or a scheduler does): the launcher passes it on to the ranks, and the job ends with one line from rank
    0 naming the checkpoint the same command resumes from, no traceback, and the exit code 128 + the signal. The
    same command then resumes (on torchrun's layout, exactly: the uninterrupted run's losses)."""
    extra = ["parallel.deepspeed_config=configs/deepspeed/zero2.json"] if launcher == "deepspeed.sh" else []
    cmd = ["bash", f"launch/{launcher}", *job_args(tmp_path, *extra)]
    job = start_until_checkpoint(cmd, tmp_path, 4)
    sig = signal.SIGINT if how == "ctrl_c" else signal.SIGTERM
    if how == "ctrl_c":
        os.killpg(job.pid, sig)  # torchrun starts the ranks in sessions of their own, DeepSpeed in this group
    else:
        job.send_signal(sig)  # the launcher itself (the scripts exec it)
    assert job.wait(HUNG_S) == 128 + sig
    log = (tmp_path / "first.log").read_text()
    saved, info = store.latest(tmp_path / "ck", warn=lambda message: None)
    assert f"WARNING stopped by {sig.name} after step " in log, log[-3000:]
    assert (f"the last checkpoint is {saved} (step {info['step']}): the same command resumes from it"
            in log), log[-3000:]
    assert "Traceback" not in log and "Error" not in log, log[-3000:]

    result = run(cmd)
    assert f"resumed from step {info['step']} ({saved}" in result.stdout
    if launcher == "train.sh":
        assert losses(tmp_path) == reference[1]  # bitwise, every step


@pytest.mark.parametrize("layout", ["dp2xtp1", "one_process"])
def test_resume_on_another_layout(reference, tmp_path, layout):
    """Saved at dp=1 × tp=2; DCP reshards. The global batch (batch_size × dp) stays 4 sequences."""
    ref_dir, ref = reference
    copy_checkpoint(ref_dir, 6, tmp_path)
    if layout == "dp2xtp1":
        result = run(["bash", "launch/train.sh", *job_args(tmp_path, "parallel.tp=1",
                                                           "data.batch_size=2")])
    else:  # a world of one, logging to TensorBoard too
        result = run([sys.executable, "-m", "parallel.train",
                      *job_args(tmp_path, "parallel.tp=1", "train.tensorboard=true")])
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "out" / "tensorboard")).Reload()
        logged = {e.step: e.value for e in events.Scalars("train/loss")}
        assert sorted(logged) == [7, 8]
        assert all(abs(logged[s] - ref[s]) <= 1e-5 * abs(ref[s]) for s in logged)
    assert "resumed from step 6" in result.stdout and "saved at dp=1 × tp=2" in result.stdout
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert all(resumed[step] == ref[step] for step in range(1, 7))  # the checkpoint's records of its steps
    for step in (7, 8):
        assert abs(resumed[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, resumed[step], ref[step])


def test_resume_with_another_global_batch_names_the_setting(reference, tmp_path):
    copy_checkpoint(reference[0], 6, tmp_path)
    result = subprocess.run([sys.executable, "-m", "parallel.train",
                             *job_args(tmp_path, "parallel.tp=1", "data.batch_size=8")],
                            cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode == 2
    assert "checkpoint error: data.batch_size: " in result.stderr
    assert "set data.batch_size=4 to continue on the same batches" in result.stderr


@pytest.mark.parametrize("setting, saved", [("train.norm=torch", "shardnorm"), ("train.dtype=bfloat16", "float32")])
def test_resume_with_another_norm_or_dtype_names_the_setting(reference, tmp_path, setting, saved):
    """The same command with --norm torch (or bf16) after a shardnorm (fp32) run with a checkpoint.dir, as for a
    comparison: refused, naming the setting, instead of continuing the other run's checkpoint (or training nothing
    after it) and reporting its steps as this setting's."""
    copy_checkpoint(reference[0], 6, tmp_path)
    result = subprocess.run([sys.executable, "-m", "parallel.train", *job_args(tmp_path, "parallel.tp=1", setting)],
                            cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    key, value = setting.split("=")
    assert (f"checkpoint error: {key}: {store.step_dir(tmp_path / 'ck', 6)} was trained with {key} = {saved}, this "
            f"run has {value}" in result.stderr), result.stderr[-3000:]
    assert "step    7" not in result.stdout


@pytest.mark.parametrize("launcher", ["one_process", "train.sh"])
def test_resume_into_another_model_names_the_setting(reference, tmp_path, launcher):
    """A checkpoint of 2 layers into a model of 1: the [model] setting named (DCP loaded the subset it found and the
    run would train another model, or fail with a shape error for settings that change shapes). Through torchrun
    too the error comes once, and alone: no traceback and failure report of torchrun's after it."""
    copy_checkpoint(reference[0], 6, tmp_path)
    if launcher == "one_process":
        cmd = [sys.executable, "-m", "parallel.train", *job_args(tmp_path, "parallel.tp=1", "data.batch_size=2",
                                                                  "model.n_layers=1")]
    else:
        cmd = ["bash", "launch/train.sh", *job_args(tmp_path, "model.n_layers=1")]
    result = subprocess.run(cmd, cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode == 2, result.stderr[-3000:]
    error = f"checkpoint error: {tmp_path / 'ck' / 'step-00000006'} holds another model: model.n_layers = 2 there, " \
            "1 here; set them as saved to continue it\n"
    assert result.stderr.count(error) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert "failed (exitcode" not in result.stderr, result.stderr[-3000:]


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_job_error_comes_alone(reference, tmp_path):
    """launch/deepspeed.sh resuming from an fsdp_tp checkpoint: the job's one line and exit code 2, without DeepSpeed's
    node launcher's lines about killing the ranks and the failed command."""
    copy_checkpoint(reference[0], 6, tmp_path)
    result = subprocess.run(["bash", "launch/deepspeed.sh", *job_args(tmp_path)], cwd=ROOT, env=env(), text=True,
                            capture_output=True, timeout=HUNG_S)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    error = f"checkpoint error: {store.step_dir(tmp_path / 'ck', 6)} was written by parallel.engine=fsdp_tp, this " \
            "run is deepspeed\n"
    assert result.stderr.count(error) == 1, output[-3000:]
    assert "Traceback" not in output and "exits with return code" not in output, output[-3000:]
    assert "Killing subprocess" not in output and " failed: " not in output, output[-3000:]


def test_extending_a_finished_run_follows_the_schedule_of_the_new_total(reference, tmp_path):
    """The 8-step run's last checkpoint resumed with train.steps=12: steps 9 to 12 run at the LR of a run started with
    12 steps, falling towards 10% of the peak at its end, not on the 8-step cosine continued past its end, which climbs
    back towards the peak. --check is refused then: its reference runs every step on the 12-step schedule."""
    from parallel.config import load
    from parallel.engines import build_optimizer

    copy_checkpoint(reference[0], STEPS, tmp_path)
    args = job_args(tmp_path, "train.steps=12")
    result = run(["bash", "launch/train.sh", *args])
    records = map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
    lrs = {r["step"]: r["lr"] for r in records if r["step"] > STEPS}  # steps 1 to 8: the checkpoint's records
    assert sorted(lrs) == [9, 10, 11, 12]
    cfg = load(ROOT / TINY, args[1:])
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), cfg.train)  # a run started with 12 steps
    expected = {}
    for step in range(1, 13):
        expected[step] = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
    assert lrs == {step: expected[step] for step in lrs}
    assert lrs[12] < lrs[9] and lrs[12] < 0.15 * cfg.train.lr
    assert f"train.steps = {STEPS} there, 12 here; the LR schedule is this run's: step 9 runs at lr" in result.stdout

    load = json.dumps(str(store.step_dir(reference[0] / "ck", STEPS)))  # the copy is pruned: 10 and 12 are kept
    checked = subprocess.run(["bash", "launch/train.sh", *args, f"checkpoint.load={load}", "--check"], cwd=ROOT,
                             env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert checked.returncode == 2, checked.stderr[-3000:]
    assert "checkpoint error: train.check: " in checked.stderr and "train.steps = 8 there, 12 here" in checked.stderr


def test_resume_with_another_weight_decay_runs_with_it(reference, tmp_path):
    """AdamW's weight_decay and eps come back with the optimizer's state, which a resume loads, so unless set again a
    resume with another train.weight_decay would run with the saved one. It runs with this run's (its losses differ
    from a resume as saved from the step after on), a warning says so, and --check is refused, its reference having
    this run's settings from step 1."""
    def resumed_losses(tmp: Path, *extra: str) -> tuple[dict[int, float], str]:
        copy_checkpoint(reference[0], 6, tmp)
        result = run([sys.executable, "-m", "parallel.train", *job_args(tmp, "parallel.tp=1", *extra)])
        return losses(tmp), result.stdout

    as_saved, _ = resumed_losses(tmp_path / "as_saved")
    decayed, output = resumed_losses(tmp_path / "decayed", "train.weight_decay=10.0")
    assert "train.weight_decay = 0.0 there, 10.0 here; the optimizer runs with this run's settings" in output, output
    assert decayed[7] == as_saved[7] and decayed[8] != as_saved[8]  # step 7's update is the first with the decay
    saved = json.dumps(str(store.step_dir(tmp_path / "as_saved" / "ck", 6)))
    checked = subprocess.run([sys.executable, "-m", "parallel.train", *job_args(
        tmp_path / "checked", "parallel.tp=1", "train.weight_decay=10.0", f"checkpoint.load={saved}"), "--check"],
        cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert checked.returncode == 2 and "checkpoint error: train.check: " in checked.stderr, checked.stderr[-3000:]


def test_resume_on_another_corpus_says_so(reference, tmp_path):
    """A resume with another data.corpus_bytes (or data.path) draws its batches from another corpus than the saved run
    did: a warning names the setting, and --check is refused, its reference drawing every step's batches from this
    run's corpus."""
    copy_checkpoint(reference[0], 6, tmp_path)
    result = run([sys.executable, "-m", "parallel.train", *job_args(tmp_path, "parallel.tp=1",
                                                                    "data.corpus_bytes=30000")])
    assert "data.corpus_bytes = 20000 there, 30000 here; the batches from step 7 on come from this run's corpus" \
        in result.stdout, result.stdout[-3000:]
    checked = subprocess.run([sys.executable, "-m", "parallel.train", *job_args(
        tmp_path, "parallel.tp=1", "data.corpus_bytes=30000", "checkpoint.load=" + json.dumps(
            str(store.step_dir(reference[0] / "ck", 6)))), "--check"],
        cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert checked.returncode == 2, checked.stderr[-3000:]
    assert "checkpoint error: train.check: " in checked.stderr and "data.corpus_bytes = 20000 there" in checked.stderr


def test_profile_step_before_the_resumed_step_says_so(reference, tmp_path):
    """train.profile_step names a step the resumed run does not run: a warning says no step is profiled, which the
    summary alone leaves unsaid (it has no profile's keys)."""
    copy_checkpoint(reference[0], 6, tmp_path)
    result = run([sys.executable, "-m", "parallel.train", *job_args(tmp_path, "parallel.tp=1", "train.profile_step=3")])
    assert ("train.profile_step = 3 is before step 7, where this run resumes: no step is profiled; set "
            "train.profile_step to a step from 7 on") in result.stdout, result.stdout[-3000:]


def test_nothing_left_to_train_reports_nothing(reference, tmp_path):
    """The same command after the run finished, with --check: nothing to train, nothing to check, said so in one
    line; no summary or check from the records metrics.jsonl holds (here another run's), and exit code 0."""
    copy_checkpoint(reference[0], STEPS, tmp_path)
    (tmp_path / "out").mkdir()
    stale = "".join(json.dumps({"step": step, "loss": 9.0, "lr": 1e-3, "tokens": 1, "tokens_per_s": 1.0,
                                "step_time_s": 1.0, "peak_mem_gib": 0.1}) + "\n" for step in range(1, STEPS + 1))
    (tmp_path / "out" / "metrics.jsonl").write_text(stale)
    result = run(["bash", "launch/train.sh", *job_args(tmp_path), "--check"])
    assert (f"nothing to train: {store.step_dir(tmp_path / 'ck', STEPS)} is at step {STEPS} and train.steps = "
            f"{STEPS}; set train.steps above {STEPS} to train on (and nothing to check: --check compares the steps a "
            "run trains)" in result.stdout), result.stdout[-3000:]
    assert "max relative loss difference" not in result.stdout and "summary:" not in result.stdout
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == stale
    assert not (tmp_path / "out" / "summary.json").exists()


def test_resume_reports_on_the_checkpoint_s_steps_not_out_dir_s(reference, tmp_path):
    """A resume with --check into a train.out_dir whose metrics.jsonl is another run's: the steps before the checkpoint
    are those of the run that saved it (the checkpoint holds their records), so --check compares this run's losses
    and passes, and metrics.jsonl holds the saved run's steps, then this run's."""
    copy_checkpoint(reference[0], 6, tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 9.0, "lr": 1e-3, "tokens": 1, "tokens_per_s": 1.0, "step_time_s": 1.0,
                    "peak_mem_gib": 0.1}) + "\n" for step in range(1, STEPS + 1)))
    result = run(["bash", "launch/train.sh", *job_args(tmp_path), "--check"])
    assert f"over {STEPS} steps" in result.stdout and "PASSED" in result.stdout, result.stdout[-3000:]
    assert losses(tmp_path) == reference[1]  # bitwise: the saved steps' records, then the same layout's steps


@pytest.mark.parametrize("key, directory, launcher", [("train.out_dir", "out", "one_process"),
                                                      ("checkpoint.dir", "ck", "one_process"),
                                                      ("train.out_dir", "out", "train.sh")])
def test_a_directory_in_use_by_another_run_is_refused(tmp_path, key, directory, launcher):
    """Two runs at once in one train.out_dir interleave their metrics.jsonl lines, and in one checkpoint.dir each
    deletes the other's checkpoint being written (a traceback then): while a run holds the directory's lock, another is
    refused at start-up, naming the setting and the run that holds it. Every rank ends with rank 0, none is left
    for torchrun to kill."""
    import fcntl

    from parallel.run_dirs import LOCK

    (tmp_path / directory).mkdir()
    with open(tmp_path / directory / LOCK, "w") as held:  # as a running job's rank 0 holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"pid {os.getpid()}")
        held.flush()
        cmd = ([sys.executable, "-m", "parallel.train", *job_args(tmp_path, "parallel.tp=1")]
               if launcher == "one_process" else ["bash", "launch/train.sh", *job_args(tmp_path)])
        result = subprocess.run(cmd, cwd=ROOT, env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert (result.stderr.count(f"config error: {key}: {tmp_path / directory} is in use by another run "
                                f"(pid {os.getpid()})") == 1), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Unable to shutdown process" not in result.stderr, result.stderr[-3000:]
    assert "step " not in result.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()


def corrupt(path: Path, how: str) -> None:
    if how == "no_marker":
        (path / store.MARKER).unlink()
    elif how == "bad_marker":
        (path / store.MARKER).write_text("{not json")
    elif how == "missing_shard":
        (path / "dcp" / "__1_0.distcp").unlink()


@pytest.mark.parametrize("how, message", [
    ("missing", "does not exist"),
    ("no_marker", "has no complete.json: it was not written completely"),
    ("bad_marker", "complete.json is unreadable"),
    ("missing_shard", "is torn: dcp/__1_0.distcp is missing"),
])
def test_explicit_unreadable_checkpoint_is_an_error(reference, tmp_path, how, message):
    path = tmp_path / "ck" / "step-00000006"
    if how != "missing":
        copy_checkpoint(reference[0], 6, tmp_path)
        corrupt(path, how)
    # the check launch/train.sh runs before torchrun; parallel.train runs the same one first
    result = subprocess.run([sys.executable, "-m", "parallel.config", *job_args(
        tmp_path, f"checkpoint.load={json.dumps(str(path))}"), "--world-size", "2"], cwd=ROOT,
        env=env(), text=True, capture_output=True, timeout=HUNG_S)
    assert result.returncode != 0, result.stdout[-2000:]
    assert f"config error: checkpoint.load: {path}" in result.stderr and message in result.stderr
    assert "step " not in result.stdout


def test_latest_skips_torn_and_partial_directories(reference, tmp_path):
    for step in (4, 6, 8):
        shutil.copytree(reference[0] / "ck" / "step-00000006", store.step_dir(tmp_path, step))
    corrupt(store.step_dir(tmp_path, 8), "missing_shard")
    (store.temp_dir(tmp_path, 10) / "dcp").mkdir(parents=True)
    warnings = []
    path, info = store.latest(tmp_path, warnings.append)
    assert path == store.step_dir(tmp_path, 6) and info["step"] == 6
    assert len(warnings) == 2
    assert str(store.temp_dir(tmp_path, 10)) in warnings[0] and "partial" in warnings[0]
    assert f"{store.step_dir(tmp_path, 8)} is torn" in warnings[1]
    assert store.latest(tmp_path / "nothing") is None


def _one_rank_signalled(rank: int, port: int, out) -> None:
    """Steps as train.py runs them: a loss all-reduce per step, under `StopSignals.deferred`. Rank 1 alone gets
    SIGTERM during step 3; out[rank] = (the step this rank stopped at, the signal)."""
    from parallel.runtime import init_runtime
    from parallel.stop import Stopped, StopSignals

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    stop = StopSignals()
    stop.arm()
    runtime = init_runtime(timeout_s=60)
    step = 0
    try:
        with stop.deferred():
            for step in range(1, 10):
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # a step's work goes on: the stop waits for its all-reduce
                    time.sleep(0.2)
                _, signum = runtime.mean_over_ranks(float(step), stop.signum)
                if signum is not None:
                    raise Stopped(signum)
    except Stopped as stopped:
        out[rank] = (step, stopped.signum)
    finally:
        dist.destroy_process_group()


def test_a_stop_signal_to_one_rank_stops_every_rank_at_the_same_step():
    """A signal reaching one rank only (a scheduler preempting one node; a launcher stopping its ranks one after
    the other) stops every rank after the same step's all-reduce, which carries it, so that no rank is left
    waiting in a collective its peer has left (on NCCL a rank then waits where no Python signal handler runs)."""
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_one_rank_signalled, args=(free_port(), out), nprocs=2)
    assert dict(out) == {0: (3, signal.SIGTERM), 1: (3, signal.SIGTERM)}


def _hung_peer(rank: int, port: int, started, done) -> None:
    from parallel.runtime import CollectivePhase, CollectiveTimeout, init_runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    started.wait()  # both ranks join the group together, well within the timeout
    runtime = init_runtime(timeout_s=3)
    if rank == 1:
        # hangs: never joins the all-reduce, and stays until rank 0 has seen the timeout (a peer that
        # exited would fail the collective with "connection closed" instead, as a sleep could on a busy machine)
        done.wait(HUNG_S)
        return
    try:
        with pytest.raises(CollectiveTimeout) as error:
            with CollectivePhase(3, rank)("step 3: the loss all-reduce"):
                runtime.mean_over_ranks(1.0)
    finally:
        done.set()
    assert "rank 0: a collective in step 3: the loss all-reduce waited longer than " \
           "parallel.timeout_s = 3 s" in str(error.value)
    assert "Timed out" in str(error.value)  # gloo's own message follows


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the job runs NCCL, whose watchdog ends a "
                    "timed-out process itself (its message names the operation) instead of raising in Python")
def test_hung_rank_times_out_with_the_collective_named():
    """parallel.timeout_s reaches the process group: without it gloo would wait 30 minutes."""
    context = mp.get_context("spawn")
    mp.spawn(_hung_peer, args=(free_port(), context.Barrier(2), context.Event()), nprocs=2)


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_resumes_from_its_own_checkpoint(tmp_path):
    args = ["parallel.deepspeed_config=configs/deepspeed/zero2.json", "train.steps=6",
            "checkpoint.every=3"]
    first, second = tmp_path / "first", tmp_path / "second"
    run(["bash", "launch/deepspeed.sh", *job_args(first, *args)])
    assert (store.step_dir(first / "ck", 3) / "deepspeed" / "mp_rank_00_model_states.pt").is_file()
    copy_checkpoint(first, 3, second)
    result = run(["bash", "launch/deepspeed.sh", *job_args(second, *args)])
    assert "resumed from step 3" in result.stdout
    ref, resumed = losses(first), losses(second)
    assert resumed == ref  # steps 1 to 3 from the checkpoint's records, 4 to 6 trained again


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_deepspeed_resume_with_another_zero_stage_names_the_setting(reference, tmp_path):
    """A DeepSpeed checkpoint of ZeRO stage 2 resumed with a stage-3 config: DeepSpeed's checkpoints do not load across
    stages (its loader fails with an AssertionError on every rank), so the job refuses it before, with one line naming
    the setting and the stage to resume with. The checkpoint's marker, which the check reads, says stage 2."""
    copy_checkpoint(reference[0], 6, tmp_path)
    path = store.step_dir(tmp_path / "ck", 6)
    marker = store.read_marker(path)
    store.write_marker(path, {**marker, "engine": "deepspeed", "dp": 2, "tp": 1, "global_rows": 8, "zero_stage": 2})
    result = subprocess.run(["bash", "launch/deepspeed.sh", *job_args(
        tmp_path, "parallel.deepspeed_config=configs/deepspeed/zero3.json")], cwd=ROOT, env=env(), text=True,
        capture_output=True, timeout=HUNG_S)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert result.stderr.count(f"checkpoint error: parallel.deepspeed_config: {path} was saved with ZeRO stage 2, "
                               "configs/deepspeed/zero3.json has stage 3") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_pruning_keeps_the_run_s_own_checkpoints(tmp_path):
    """`keep_last` counts the checkpoints up to the one just saved: a run resumed from an earlier step in a dir that
    holds a later run's checkpoints keeps its own (counting the other run's as the newest would delete the one just
    saved and the one it resumed from) and leaves the others; a plain run keeps its newest two."""
    from types import SimpleNamespace

    from parallel.checkpoint import Checkpointer

    def saved(*steps):
        for step in steps:
            path = store.step_dir(tmp_path, step)
            path.mkdir()
            (path / "train_state.pt").write_bytes(b"x")
            store.write_marker(path, {"step": step})

    checkpointer = SimpleNamespace(root=tmp_path, cfg=SimpleNamespace(checkpoint=SimpleNamespace(keep_last=2)))
    saved(4, 8, 12, 6)  # the later run's 8 and 12; this run resumed from 4 and has just saved 6
    Checkpointer._prune(checkpointer, 6)
    assert [s for s, _ in store.candidates(tmp_path)] == [12, 8, 6, 4]
    saved(7)
    Checkpointer._prune(checkpointer, 7)
    assert [s for s, _ in store.candidates(tmp_path)] == [12, 8, 7, 6]
    for _, path in store.candidates(tmp_path):
        shutil.rmtree(path)
    saved(2, 4, 6)
    Checkpointer._prune(checkpointer, 6)
    assert [s for s, _ in store.candidates(tmp_path)] == [6, 4]


def test_records_come_from_the_checkpoint_or_a_warning_says_they_are_missing(tmp_path, caplog):
    """The records a resumed run reports on come from its checkpoint; a checkpoint without them (an older version's)
    gives none, and a warning says the run reports on the steps after it."""
    from types import SimpleNamespace

    from parallel.checkpoint import Checkpointer

    checkpointer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(steps=STEPS)))
    path = store.step_dir(tmp_path, 6)
    path.mkdir()
    assert Checkpointer._saved_records(checkpointer, path, 6) == []
    assert f"{path} holds no metrics records of its steps: metrics.jsonl, the summary and --check cover steps 7 " \
           f"to {STEPS} only" in caplog.text
    store.write_records(path, [{"step": step, "loss": 1.0 / step} for step in range(1, 7)])
    assert Checkpointer._saved_records(checkpointer, path, 6) == [{"step": s, "loss": 1.0 / s} for s in range(1, 7)]
