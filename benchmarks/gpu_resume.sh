#!/usr/bin/env bash
# Checkpoint / resume of the main job on 2 GPUs (NCCL, bf16), from the repository root:
#   bash benchmarks/gpu_resume.sh OUT_DIR
# configs/llama_small_fsdp_tp.toml (~380M parameters, dp=1 × tp=2) shortened to 24 steps, saving
# every 8:
#   1. reference: uninterrupted, its checkpoints' save time and size (checkpoints.jsonl)
#   2. killed: the same job SIGKILLed (torchrun and both ranks) once step 8 is saved, then the same
#      command again: it resumes from the latest complete checkpoint; every step's loss vs 1.
#   3. reshard: the reference's step-16 checkpoint resumed at dp=2 × tp=1 (DCP reshards).
# Writes OUT_DIR/gpu_resume.json and OUT_DIR/gpu_resume.md (+ each run's log and metrics) and prints
# the markdown. About 3-4 minutes; every case records its error instead of stopping the script.
# Dry run on CPU (gloo): GPU_RESUME_EXTRA="model.dim=64 model.n_layers=2 model.ffn_dim=96 \
#   model.max_seq_len=64 data.seq_len=64 data.batch_size=2 data.corpus_bytes=50000" bash ... OUT
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_resume.sh OUT_DIR}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
PY=${PYTHON:-python3}
exec "$PY" - "$OUT" <<'PYEOF'
import json, os, shutil, signal, subprocess, sys, time, traceback
from pathlib import Path

out = Path(sys.argv[1])
work = Path(os.environ.get("GPU_RESUME_WORK", "/tmp/shardnorm_gpu_resume"))
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)
STEPS, EVERY, KILL_AFTER = 24, 8, 8
BASE = ["configs/llama_small_fsdp_tp.toml", f"train.steps={STEPS}", "train.warmup_steps=4",
        "train.timing_skip=2", "checkpoint.every=%d" % EVERY, "checkpoint.keep_last=2",
        *os.environ.get("GPU_RESUME_EXTRA", "").split()]  # e.g. tiny dims for a dry run on CPU
BF16_RTOL = 2e-2  # bf16 noise: --check allows the same against an fp32 run
results = {"steps": STEPS, "every": EVERY, "config": BASE, "cases": {}}
started = time.monotonic()


def torchrun(nproc=2):
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "parallel.train"]


def job(name, *extra):
    d = work / name
    return torchrun() + BASE + [f"checkpoint.dir={json.dumps(str(d / 'ck'))}",
                                f"train.out_dir={json.dumps(str(d / 'out'))}", *extra], d


def run(cmd, log, timeout=170):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"exit {p.returncode}; tail of {log}:\n" + Path(log).read_text()[-3000:])


def children(pid):
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def kill_tree(pid):
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
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in tree[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)


def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, (d / "out" / "metrics.jsonl").read_text().splitlines())}


def compare(ref, got, steps):
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in steps}
    return {"max_rel_diff": max(rel.values()), "bitwise_equal_steps": sum(got[s] == ref[s] for s in steps),
            "compared_steps": len(steps), "passed": max(rel.values()) <= BF16_RTOL}


def resumed_line(log):
    lines = [l for l in Path(log).read_text().splitlines() if "resumed from step" in l]
    return lines[-1].split("INFO ", 1)[-1] if lines else None


def case(name):
    def wrap(fn):
        t = time.monotonic()
        try:
            results["cases"][name] = {"ok": True, **fn()}
        except Exception as e:
            results["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:],
                                      "traceback": traceback.format_exc()[-3000:]}
        results["cases"][name]["wall_s"] = round(time.monotonic() - t, 1)
        print(f"[{name}] {json.dumps({k: v for k, v in results['cases'][name].items() if k != 'traceback'})[:1500]}", flush=True)
    return wrap


try:
    import torch
    results["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                      "python": sys.version.split()[0]}
except Exception as e:
    results["env"] = {"error": repr(e)}


@case("reference")
def _():
    cmd, d = job("reference")
    run(cmd, out / "reference.log")
    saves = [json.loads(l) for l in (d / "out" / "checkpoints.jsonl").read_text().splitlines()]
    summary = json.loads((d / "out" / "summary.json").read_text())
    return {"saves": [{"step": s["step"], "gb": round(s["bytes"] / 1e9, 3), "seconds": round(s["seconds"], 2),
                       "gb_per_s": round(s["bytes"] / 1e9 / s["seconds"], 2)} for s in saves],
            "step_time_s": summary["step_time_s"], "final_loss": summary["final_loss"],
            "files_per_checkpoint": len(json.loads((sorted((d / "ck").glob("step-*"))[-1] / "complete.json").read_text())["files"])}


@case("killed_and_resumed")
def _():
    ref = losses(work / "reference")
    cmd, d = job("killed")
    log = out / "killed.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    marker = d / "ck" / f"step-{KILL_AFTER:08d}" / "complete.json"
    deadline = time.monotonic() + 150
    while not marker.exists():
        if p.poll() is not None:
            raise RuntimeError(f"first attempt ended (exit {p.returncode}) before step {KILL_AFTER} was saved:\n"
                               + log.read_text()[-3000:])
        if time.monotonic() > deadline:
            kill_tree(p.pid)
            raise RuntimeError("no checkpoint within 150 s")
        time.sleep(0.05)
    kill_tree(p.pid)
    p.wait(30)
    logged_before_kill = len(losses(d))
    run(cmd, out / "resumed.log")
    got = losses(d)
    line = resumed_line(out / "resumed.log")
    step = int(line.split("resumed from step ")[1].split()[0]) if line else None
    return {"killed_after_step_logged": logged_before_kill, "resumed": line,
            "all": compare(ref, got, sorted(ref)),
            "after_resume": compare(ref, got, [s for s in sorted(ref) if step is None or s > step])}


@case("reshard_dp2_tp1")
def _():
    ref = losses(work / "reference")
    src = sorted((work / "reference" / "ck").glob("step-*"))[0]  # keep_last=2: steps 16 and 24
    d = work / "reshard"
    (d / "ck").mkdir(parents=True)
    shutil.copytree(src, d / "ck" / src.name)
    rows = json.loads((src / "complete.json").read_text())["global_rows"]
    cmd, _ = job("reshard", "parallel.tp=1", f"data.batch_size={rows // 2}")  # same global batch
    run(cmd, out / "reshard.log")
    got = losses(d)
    return {"resumed": resumed_line(out / "reshard.log"), **compare(ref, got, sorted(got))}


results["total_wall_s"] = round(time.monotonic() - started, 1)
(out / "gpu_resume.json").write_text(json.dumps(results, indent=2))
for name in ("reference", "killed"):
    f = work / name / "out" / "metrics.jsonl"
    if f.exists():
        shutil.copy(f, out / f"{name}_metrics.jsonl")

md = ["# Checkpoint / resume on GPUs (llama_small_fsdp_tp, bf16, NCCL)", "",
      f"env: {results.get('env')}", f"{STEPS} steps, checkpoint every {EVERY}; total {results['total_wall_s']} s", "",
      "| case | ok | result |", "| --- | --- | --- |"]
for name, r in results["cases"].items():
    if not r["ok"]:
        lines = r["error"].splitlines()
        text = next((l for l in reversed(lines) if "rror" in l), lines[0])[:300].replace("|", "/")
    elif name == "reference":
        text = "saves: " + ", ".join(f"step {s['step']}: {s['gb']} GB in {s['seconds']} s ({s['gb_per_s']} GB/s)" for s in r["saves"]) + f"; step {r['step_time_s'] * 1e3:.0f} ms"
    elif name == "killed_and_resumed":
        text = (f"{r['resumed']}; max rel loss diff vs uninterrupted: all steps {r['all']['max_rel_diff']:.2e}, "
                f"after resume {r['after_resume']['max_rel_diff']:.2e} ({r['after_resume']['bitwise_equal_steps']}/"
                f"{r['after_resume']['compared_steps']} bitwise equal); passed (≤ {BF16_RTOL}): {r['after_resume']['passed']}")
    else:
        text = (f"{r['resumed']}; max rel loss diff {r['max_rel_diff']:.2e} over {r['compared_steps']} steps; "
                f"passed (≤ {BF16_RTOL}): {r['passed']}")
    md.append(f"| {name} | {r['ok']} | {text} |")
(out / "gpu_resume.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
shutil.rmtree(work, ignore_errors=True)  # checkpoints are several GB each
PYEOF
