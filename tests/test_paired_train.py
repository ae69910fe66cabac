"""benchmarks/paired_train.py without launching the job: a fake runner writes what the main job writes
(summary.json, metrics.jsonl), and the script's parsing, order, statistics and files are checked against them."""

import gzip
import json
import random
import statistics
from pathlib import Path

import pytest

from benchmarks import paired_train


def _fake_job(out_dir: Path, step_time_s: float, peak: float, losses: list[float], slow: float = 1.0,
              host_ms: list[dict] | None = None) -> None:
    """What parallel/train.py leaves in its out_dir (metrics.py's files), timed steps 2..n: each takes
    `step_time_s` but the last, which takes `slow` times that, so the mean is not the median. `host_ms`: each
    step's host time per phase."""
    out_dir.mkdir(parents=True)
    times = [step_time_s] * (len(losses) - 1) + [step_time_s * slow]
    phases = host_ms or [{}] * len(losses)
    records = [{"step": i + 1, "loss": loss, "lr": 1e-3, "tokens": 1024, "tokens_per_s": 1024 / t,
                "step_time_s": t, "host_ms": ms, "peak_mem_gib": peak}
               for i, (loss, t, ms) in enumerate(zip(losses, times, phases))]
    mean = sum(times[1:]) / (len(times) - 1)
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out_dir / "summary.json").write_text(json.dumps({
        "norm": "x", "steps": len(losses), "timed_steps": len(losses) - 1, "tokens_per_s": 1024 / mean,
        "step_time_s": mean, "peak_mem_gib": peak, "final_loss": losses[-1], "device": "cpu",
        "memory_kind": "host rss"}))


def test_pairs_run_alternately_and_ratios_median_range_memory_parity_come_from_each_runs_files(tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    k = 5
    times = {v: [rng.uniform(0.05, 0.2) for _ in range(k)] for v in "ab"}
    slow = {v: [rng.uniform(1.5, 4.0) for _ in range(k)] for v in "ab"}
    peaks = {"a": rng.uniform(1, 2), "b": rng.uniform(1, 2)}
    base = [rng.uniform(2, 5) for _ in range(6)]
    drift = [rng.uniform(-1e-3, 1e-3) for _ in range(6)]
    # B's runs also differ from each other, step by step (A's are identical): the run-to-run scale
    jitter = [[rng.uniform(-1e-4, 1e-4) for _ in base] for _ in range(k)]
    losses_of = {"a": [base] * k,
                 "b": [[x * (1 + d) * (1 + j) for x, d, j in zip(base, drift, jit)] for jit in jitter]}
    # per variant and run, each step's host ms per phase; B's runs also time a phase A's lack
    host = {v: [[{"forward": rng.uniform(1, 9), "backward": rng.uniform(1, 9),
                  **({"finalize_grads": rng.uniform(1, 9)} if v == "b" else {})} for _ in base] for _ in range(k)]
            for v in "ab"}
    order = []

    def run(variant_args, out_dir):
        v = {("--norm", "torch"): "a", ("--norm", "shardnorm"): "b"}[tuple(variant_args)]
        i = sum(1 for o in order if o[0] == v)
        order.append((v, out_dir.name))
        _fake_job(out_dir, times[v][i], peaks[v], losses_of[v][i], slow[v][i], host[v][i])
        return paired_train.read_run(out_dir)

    pairs, error = paired_train.run_pairs("cfg.toml", ["--norm", "torch"], ["--norm", "shardnorm"], k, tmp_path,
                                          run=run)
    assert error is None, f"seed {seed}"
    assert order == [(v, f"pair{i}-{v.upper()}") for i in range(1, k + 1) for v in ("ab" if i % 2 else "ba")], \
        f"run order: {order}"
    meta = {"config": "cfg.toml", "a": "--norm torch", "b": "--norm shardnorm", "common": "", "nproc": 2,
            "command": "python -m benchmarks.paired_train cfg.toml ..."}
    summary = paired_train.write(tmp_path, meta, pairs)
    n = len(base) - 1  # timed steps: the last one slow
    means = {v: [t * (n - 1 + s) / n for t, s in zip(times[v], slow[v])] for v in "ab"}
    ratios = [b / a for a, b in zip(means["a"], means["b"])]
    median_step_ratios = [b / a for a, b in zip(times["a"], times["b"])]
    assert summary["ratios"] == pytest.approx(ratios, rel=1e-12), f"seed {seed}"
    assert summary["median_ratio"] == pytest.approx(statistics.median(ratios), rel=1e-12), f"seed {seed}"
    assert (summary["min_ratio"], summary["max_ratio"]) == pytest.approx((min(ratios), max(ratios)), rel=1e-12)
    assert summary["median_step_ratios"] == pytest.approx(median_step_ratios, rel=1e-12), f"seed {seed}"
    assert summary["median_of_median_step_ratios"] == pytest.approx(statistics.median(median_step_ratios),
                                                                    rel=1e-12), f"seed {seed}"
    assert summary["a"]["peak_mem_gib"] == pytest.approx(peaks["a"]) and \
        summary["b"]["peak_mem_gib"] == pytest.approx(peaks["b"]), f"seed {seed}"
    parity = [[abs(y / x - 1) for x, y in zip(base, run)] for run in losses_of["b"]]
    assert summary["loss_max_rel_diff"] == pytest.approx(max(map(max, parity)), rel=1e-9), f"seed {seed}"
    assert summary["loss_final_rel_diff"] == pytest.approx(max(q[-1] for q in parity), rel=1e-9), f"seed {seed}"
    assert summary["a"]["final_loss_spread"] == 0.0 and summary["a"]["run_to_run_max_rel_diff"] == 0.0
    b_runs = losses_of["b"]
    b_spread = max(abs(y - x) / abs(x) for i in range(k) for j in range(i + 1, k)
                   for x, y in zip(b_runs[i], b_runs[j]))
    assert summary["b"]["run_to_run_max_rel_diff"] == pytest.approx(b_spread, rel=1e-9) and b_spread > 0, \
        f"seed {seed}"
    for v in "ab":  # per run the median over its timed steps (the first is not timed), then over the runs
        want = {phase: statistics.median(statistics.median(step[phase] for step in run[1:]) for run in host[v])
                for phase in host[v][0][0]}
        assert summary[v]["host_ms"] == pytest.approx(want, rel=1e-12), f"seed {seed}"
    saved = json.loads((tmp_path / "paired_train.json").read_text())
    assert saved["summary"]["median_ratio"] == pytest.approx(summary["median_ratio"]) and len(saved["pairs"]) == k
    table = (tmp_path / "paired_train.md").read_text()
    assert meta["command"] in table and f"{statistics.median(ratios):.3f}" in table
    assert f"runs of one variant: A 0.00e+00, B {b_spread:.2e}." in table, f"seed {seed}"
    assert sum(line.startswith("| ") and line[2].isdigit() for line in table.splitlines()) == k
    finalize = summary["b"]["host_ms"]["finalize_grads"]
    assert f"| finalize_grads | 0.0 | {finalize:.1f} | {finalize:+.1f} |" in table, f"seed {seed}"


def test_a_failed_run_stops_the_benchmark_and_keeps_the_finished_pairs(tmp_path):
    calls = []

    def run(variant_args, out_dir):
        calls.append(out_dir.name)
        if out_dir.name == "pair2-B":
            out_dir.mkdir(parents=True)  # the job died before its summary
            return paired_train.read_run(out_dir)
        _fake_job(out_dir, 0.1, 1.0, [3.0, 2.0])
        return paired_train.read_run(out_dir)

    pairs, error = paired_train.run_pairs("cfg.toml", ["--norm", "torch"], ["--norm", "shardnorm"], 3, tmp_path,
                                          run=run)
    assert calls == ["pair1-A", "pair1-B", "pair2-B"]
    assert len(pairs) == 1 and "summary.json is missing" in error


def test_the_command_line_refuses_what_it_sets_itself(capsys):
    with pytest.raises(SystemExit):
        paired_train.main(["cfg.toml", "--a", "--norm torch", "--b", "train.out_dir=x", "--pairs", "2"])
    assert "train.out_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired_train.main(["cfg.toml", "--a", "--norm torch", "--b", "train.profile_step=3"])
    assert "train.profile_step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired_train.main(["cfg.toml", "--a", "", "--b", "", "--pairs", "0"])
    assert "--pairs" in capsys.readouterr().err


def test_run_command_is_the_launcher_with_common_and_variant_arguments(tmp_path):
    cmd = paired_train.run_command("configs/tiny_cpu.toml", ["train.steps=4"], ["--norm", "torch"], tmp_path / "r")
    assert cmd[1].endswith("launch/train.sh") and cmd[2:5] == ["configs/tiny_cpu.toml", "train.steps=4", "--norm"]
    assert cmd[-1] == f'train.out_dir="{tmp_path / "r"}"'


def test_a_profiled_step_adds_each_runs_norm_grad_all_reduces_and_pair_1s_traces(tmp_path):
    def run(variant_args, out_dir):
        _fake_job(out_dir, 0.1, 1.0, [3.0, 2.0])
        summary = json.loads((out_dir / "summary.json").read_text())
        summary["norm_grad_all_reduces"] = 5 if variant_args == ["--norm", "torch"] else 1
        (out_dir / "summary.json").write_text(json.dumps(summary))
        trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "norm_fwd_kernel", "ts": 0, "dur": 7}]}
        with gzip.open(out_dir / "profile_rank0.json.gz", "wt") as f:
            json.dump(trace, f)
        return paired_train.read_run(out_dir)

    pairs, error = paired_train.run_pairs("cfg.toml", ["--norm", "torch"], ["--norm", "shardnorm"], 2, tmp_path,
                                          run=run)
    meta = {"config": "cfg.toml", "a": "--norm torch", "b": "--norm shardnorm", "common": "", "nproc": 2,
            "command": "python -m benchmarks.paired_train cfg.toml --profile-step 2"}
    summary = paired_train.write(tmp_path, meta, pairs)
    assert error is None
    assert (summary["a"]["norm_grad_all_reduces"], summary["b"]["norm_grad_all_reduces"]) == ([5], [1])
    assert "Norm-grad all-reduces in the profiled step: A [5], B [1]" in (tmp_path / "paired_train.md").read_text()
    paired_train.write_trace(tmp_path, tmp_path / "runs")
    assert "| `norm_fwd_kernel` | 1 | 0.01 | 1 | 0.01 | +0.00 |" in (tmp_path / "trace_kernels.md").read_text()
