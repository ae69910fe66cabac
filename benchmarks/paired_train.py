"""Paired runs of the main job: variants A and B of one config, alternately on the same machine, K pairs.

    python -m benchmarks.paired_train CONFIG --a "--norm torch" --b "--norm shardnorm" --pairs 5 --out DIR
        [--nproc 2] [--common "train.steps=30 train.timing_skip=10"] [--profile-step 12]

Each run is `launch/train.sh CONFIG COMMON VARIANT train.out_dir=DIR/runs/pairK-X` (NPROC=--nproc; --runs RUNS puts
the runs' folders and logs in RUNS instead of DIR/runs), in the order A, B, B, A, A, B, ...: odd pairs run A first,
even pairs B first, so neither the machine's drift over the runs nor going first in a pair falls on one variant.
Per run the job's summary.json and metrics.jsonl (parallel/metrics.py) give the step time (mean over the timed
steps), the median timed step and how those steps spread (slowest over fastest), tokens/s, peak memory and the
losses. Per pair: the step-time ratio B/A, of the means and of the median steps (a few slow steps move the mean,
not the median). Over the pairs: the median of each ratio and its range (min, max), the peak memory of each
variant, loss parity (B's loss against A's of the same pair, step by step, relative) and, to read it against, each
variant's run-to-run spread (the same between two runs of one variant, the largest over its runs). Writes
DIR/paired_train.json, DIR/paired_train.md (with the command) and, where matplotlib is installed,
DIR/paired_train.png; prints the table. Each run's log is DIR/runs/pairK-X.log. A failed run stops the
benchmark (exit 1) with what was measured so far written. Whole-run speed claims about the main job are quoted
from this script's output with its command (step-by-step alternation in one process group:
benchmarks/sp_activation_memory.py).

`--profile-step N` profiles step N of every run (`train.profile_step`, left out of the timed steps): each run's
norm-grad all-reduces in that step and, on GPUs, their NCCL kernel time join the table, and pair 1's two rank-0
traces are compared kernel by kernel and host op by host op in DIR/trace_kernels.md (benchmarks/trace_kernels.py).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import trace_kernels
from benchmarks.common import command, median_range, pyplot, save_figure, table, turns, write_json

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("a", "b")
PROFILED = ("norm_grad_all_reduces", "norm_grad_kernel_ms", "norm_grad_exposed_ms")  # a profiled step's, if any


class RunFailed(RuntimeError):
    pass


def run_command(config: str, common: list[str], variant: list[str], out_dir: Path) -> list[str]:
    return ["bash", str(ROOT / "launch" / "train.sh"), config, *common, *variant, f'train.out_dir="{out_dir}"']


def read_run(out_dir: Path) -> dict:
    """The job's summary.json and per-step losses (metrics.jsonl) from its output dir."""
    summary_path = out_dir / "summary.json"
    if not summary_path.is_file():
        raise RunFailed(f"{summary_path} is missing: the run wrote no summary")
    summary = json.loads(summary_path.read_text())
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed_records = [r for r in records if not r.get("profiled")][-(summary.get("timed_steps") or 0):]
    timed = [r["step_time_s"] for r in timed_records]
    return {"step_time_s": summary["step_time_s"], "tokens_per_s": summary["tokens_per_s"], "step_times_s": timed,
            "host_ms": median_phases([r.get("host_ms") or {} for r in timed_records]),
            "median_step_s": statistics.median(timed) if timed else summary["step_time_s"],
            "peak_mem_gib": summary["peak_mem_gib"], "final_loss": summary["final_loss"],
            "timed_steps": summary.get("timed_steps"), "device": summary.get("device"),
            "memory_kind": summary.get("memory_kind"), "losses": [r["loss"] for r in records],
            **{k: summary[k] for k in PROFILED if k in summary}}


def median_phases(steps: list[dict]) -> dict:
    """Per phase, the median of its host ms over `steps` (each step's `host_ms`; a phase some steps lack counts
    0 there)."""
    phases = list(dict.fromkeys(name for step in steps for name in step))
    return {name: statistics.median(step.get(name, 0.0) for step in steps) for name in phases}


def launch(config: str, common: list[str], variant: list[str], out_dir: Path, nproc: int | None) -> dict:
    """Run the main job once; its parsed result, with the wall time of the whole run."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = run_command(config, common, variant, out_dir)
    env = dict(os.environ, **({"NPROC": str(nproc)} if nproc else {}))
    start = time.perf_counter()
    with open(f"{out_dir}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RunFailed(f"{shlex.join(cmd)} exited with {rc}; see {out_dir}.log")
    return {**read_run(out_dir), "wall_s": time.perf_counter() - start}


def loss_parity(a: list[float], b: list[float]) -> dict:
    """B's losses against A's, step by step: max and final relative difference |b - a| / |a|."""
    steps = min(len(a), len(b))
    rel = [abs(y - x) / abs(x) if x else abs(y - x) for x, y in zip(a[:steps], b[:steps])]
    return {"steps": steps, "max_rel_diff": max(rel) if rel else float("nan"),
            "final_rel_diff": rel[-1] if rel else float("nan")}


def summarize(pairs: list[dict]) -> dict:
    """Per-pair ratios B/A of the step time, their median and range; memory and loss parity over the pairs."""
    ratios = [p["b"]["step_time_s"] / p["a"]["step_time_s"] for p in pairs]
    median_step_ratios = [p["b"]["median_step_s"] / p["a"]["median_step_s"] for p in pairs]
    parity = [loss_parity(p["a"]["losses"], p["b"]["losses"]) for p in pairs]
    spread = median_range(ratios)
    out = {"pairs": len(pairs), "ratios": ratios,
           "median_ratio": spread["median"], "min_ratio": spread["min"], "max_ratio": spread["max"],
           "median_step_ratios": median_step_ratios,
           "median_of_median_step_ratios": median_range(median_step_ratios)["median"],
           "loss_max_rel_diff": max((q["max_rel_diff"] for q in parity), default=float("nan")),
           "loss_final_rel_diff": max((q["final_rel_diff"] for q in parity), default=float("nan"))}
    for v in VARIANTS:
        runs = [p[v] for p in pairs]
        finals = [r["final_loss"] for r in runs]
        losses = [r["losses"] for r in runs]
        out[v] = {"median_step_time_s": statistics.median(r["step_time_s"] for r in runs) if runs else float("nan"),
                  "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs) if runs else float("nan"),
                  "peak_mem_gib": max((r["peak_mem_gib"] for r in runs), default=float("nan")),
                  "final_losses": finals,
                  "host_ms": median_phases([r.get("host_ms") or {} for r in runs]),
                  # a variant's own runs should agree with each other (the job is seeded): how far they spread, at
                  # the end and at any step (the scale against which B-against-A parity is read: kernels or
                  # collectives that are not deterministic, and training's amplification of their rounding, move
                  # both variants' losses)
                  "final_loss_spread": (max(finals) - min(finals)) / abs(finals[0])
                  if len(finals) > 1 and finals[0] else 0.0,
                  "run_to_run_max_rel_diff": max((loss_parity(x, y)["max_rel_diff"] for i, x in enumerate(losses)
                                                  for y in losses[i + 1:]), default=0.0),
                  # a count per run: every run of a variant should issue the same
                  "norm_grad_all_reduces": sorted({r["norm_grad_all_reduces"] for r in runs
                                                   if "norm_grad_all_reduces" in r})}
    return out


def _within(run: dict) -> str:
    """How a run's timed steps spread (slowest over fastest): one slow stretch, or a run slow throughout."""
    times = run.get("step_times_s")
    return f"{max(times) / min(times):.2f}" if times else "-"


def markdown(meta: dict, pairs: list[dict], summary: dict) -> str:
    a, b = meta["a"], meta["b"]
    lines = [f"# Paired main-job runs: {meta['config']}", "",
             f"A = `{a}`, B = `{b}`, common `{meta['common']}`, {meta['nproc'] or 'default'} processes, "
             f"run order A, B in odd pairs, B, A in even ones. Device: {meta.get('device')}.", "",
             f"Command: `{meta['command']}`", ""]
    rows = []
    for i, (p, ratio, median) in enumerate(zip(pairs, summary["ratios"], summary["median_step_ratios"]), 1):
        q = loss_parity(p["a"]["losses"], p["b"]["losses"])
        rows.append([i, f"{p['a']['step_time_s'] * 1e3:.1f}", f"{p['b']['step_time_s'] * 1e3:.1f}", f"{ratio:.3f}",
                     f"{median:.3f}", f"{_within(p['a'])}, {_within(p['b'])}", f"{p['a']['peak_mem_gib']:.2f}",
                     f"{p['b']['peak_mem_gib']:.2f}", f"{p['a']['final_loss']:.4f}", f"{p['b']['final_loss']:.4f}",
                     f"{q['max_rel_diff']:.2e}"])
    lines += table(["pair", "A step ms", "B step ms", "B/A", "B/A of median steps", "A, B slowest/fastest step",
                    "A peak GiB", "B peak GiB", "A final loss", "B final loss", "loss max rel diff"], rows)
    lines += ["", f"Step time B/A: median **{summary['median_ratio']:.3f}**, range "
                  f"[{summary['min_ratio']:.3f}, {summary['max_ratio']:.3f}] over {summary['pairs']} pairs; of the "
                  f"median steps: median {summary['median_of_median_step_ratios']:.3f}, range "
                  f"[{min(summary['median_step_ratios'], default=float('nan')):.3f}, "
                  f"{max(summary['median_step_ratios'], default=float('nan')):.3f}]. "
                  f"Median step: A {summary['a']['median_step_time_s'] * 1e3:.1f} ms, "
                  f"B {summary['b']['median_step_time_s'] * 1e3:.1f} ms. Peak memory: A "
                  f"{summary['a']['peak_mem_gib']:.2f} GiB, B {summary['b']['peak_mem_gib']:.2f} GiB.",
              f"Loss parity (B against A, same pair, every step): max relative difference "
              f"{summary['loss_max_rel_diff']:.2e}, at the last step {summary['loss_final_rel_diff']:.2e}. "
              f"Spread of each variant's final loss over its runs: A {summary['a']['final_loss_spread']:.1e}, "
              f"B {summary['b']['final_loss_spread']:.1e}; largest step-by-step relative difference between two "
              f"runs of one variant: A {summary['a']['run_to_run_max_rel_diff']:.2e}, "
              f"B {summary['b']['run_to_run_max_rel_diff']:.2e}."]
    counts = {v: summary[v].get("norm_grad_all_reduces") for v in VARIANTS}
    if any(counts.values()):
        lines.append(f"Norm-grad all-reduces in the profiled step: A {counts['a']}, B {counts['b']} "
                     "(every run's count; one value where the runs agree).")
    lines += _phase_table(summary)
    return "\n".join(lines) + "\n"


def _phase_table(summary: dict) -> list[str]:
    """Host ms per step phase (the job's `host_ms`: each run's median step, then the median over runs)."""
    a, b = summary["a"]["host_ms"], summary["b"]["host_ms"]
    phases = list(dict.fromkeys([*a, *b]))
    if not phases:
        return []
    return ["", "Host time per step phase, ms (each run's median over its timed steps, then the median over runs; "
                "read without synchronizing, so `gpu_wait` is the host waiting on the GPU at the step's end):", ""] + \
        table(["phase", "A", "B", "B - A"], [[name, f"{a.get(name, 0.0):.1f}", f"{b.get(name, 0.0):.1f}",
                                             f"{b.get(name, 0.0) - a.get(name, 0.0):+.1f}"] for name in phases])


def plot(path: Path, meta: dict, pairs: list[dict], summary: dict) -> bool:
    """Step time per pair for A and B, and the ratio; False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    k = range(1, len(pairs) + 1)
    for v, style in zip(VARIANTS, ("o-", "s--")):
        left.plot(k, [p[v]["step_time_s"] * 1e3 for p in pairs], style, label=f"{v.upper()}: {meta[v]}")
    left.set(xlabel="pair", ylabel="step time (ms)", title=meta["config"])
    left.legend(fontsize=8)
    right.plot(k, summary["ratios"], "o-")
    right.axhline(summary["median_ratio"], ls=":", label=f"median {summary['median_ratio']:.3f}")
    right.axhline(1.0, color="grey", lw=0.5)
    right.set(xlabel="pair", ylabel="B / A step time", title="ratio per pair")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return True


def write(out: Path, meta: dict, pairs: list[dict], error: str | None = None) -> dict:
    summary = summarize(pairs)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "paired_train.json",
               {"meta": meta, "summary": summary, "pairs": pairs, **({"error": error} if error else {})})
    text = markdown(meta, pairs, summary) + (f"\nStopped early: {error}\n" if error else "")
    (out / "paired_train.md").write_text(text)
    if pairs:
        plot(out / "paired_train.png", meta, pairs, summary)
    print(text, flush=True)
    return summary


def write_trace(out: Path, runs: Path) -> None:
    """OUT/trace_kernels.md: pair 1's two profiled steps (rank 0) side by side."""
    traces = [runs / f"pair1-{v.upper()}" / "profile_rank0.json.gz" for v in VARIANTS]
    (out / "trace_kernels.md").write_text(trace_kernels.compare(*map(str, traces)))


def run_pairs(config: str, a: list[str], b: list[str], pairs: int, out: Path, run=None, meta: dict | None = None,
              common: list[str] = (), nproc: int | None = None,
              runs: Path | None = None) -> tuple[list[dict], str | None]:
    """K pairs of runs, A then B in odd pairs and B then A in even ones, each in `runs` (default out/runs);
    `run(variant_args, out_dir) -> dict` (default: `launch`). Returns the finished pairs and the error that
    stopped the benchmark, if any."""
    run = run or (lambda variant, out_dir: launch(config, list(common), variant, out_dir, nproc))
    runs = runs or out / "runs"
    done = []
    for k in range(1, pairs + 1):
        try:
            arguments = dict(zip(VARIANTS, (a, b)))
            pair = {v: run(arguments[v], runs / f"pair{k}-{v.upper()}") for v in turns(VARIANTS, k - 1)}
        except RunFailed as e:
            return done, str(e)
        done.append(pair)
        if meta is not None:
            meta.setdefault("device", pair["a"].get("device"))
        ratio = pair["b"]["step_time_s"] / pair["a"]["step_time_s"]
        print(f"pair {k}/{pairs}: A {pair['a']['step_time_s'] * 1e3:.1f} ms, B {pair['b']['step_time_s'] * 1e3:.1f} ms,"
              f" B/A {ratio:.3f}", flush=True)
        if meta is not None:
            write(out, meta, done)  # results as they come
    return done, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("config", help="a main-job config, e.g. configs/llama_small_fsdp_tp.toml")
    parser.add_argument("--a", required=True, help='variant A\'s main-job arguments, e.g. "--norm torch"')
    parser.add_argument("--b", required=True, help='variant B\'s main-job arguments, e.g. "--norm shardnorm"')
    parser.add_argument("--pairs", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--nproc", type=int, help="processes per run (NPROC of launch/train.sh; default: its own)")
    parser.add_argument("--common", default="", help="main-job arguments for both variants, e.g. train.steps=30")
    parser.add_argument("--runs", help="where each run's output folder and log go (default: OUT/runs)")
    parser.add_argument("--profile-step", type=int, help="profile this step of every run (train.profile_step): "
                        "norm-grad all-reduces per run, and OUT/trace_kernels.md from pair 1's traces")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/paired"), help="output folder")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    for name in ("a", "b", "common"):
        for key in ("train.out_dir", "train.profile_step"):
            if key in getattr(args, name):
                parser.error(f"--{name}: {key} is set per run by this script")
    a, b, common = shlex.split(args.a), shlex.split(args.b), shlex.split(args.common)
    if args.profile_step:
        common.append(f"train.profile_step={args.profile_step}")
    out = Path(args.out).resolve()
    runs = Path(args.runs).resolve() if args.runs else out / "runs"
    meta = {"config": args.config, "a": args.a, "b": args.b, "common": args.common, "nproc": args.nproc,
            "pairs_asked": args.pairs, "profile_step": args.profile_step, "command": command(__spec__.name, argv)}
    pairs, error = run_pairs(args.config, a, b, args.pairs, out, meta=meta, common=common, nproc=args.nproc,
                             runs=runs)
    summary = write(out, meta, pairs, error)
    if args.profile_step and pairs:
        write_trace(out, runs)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"B/A median {summary['median_ratio']:.3f} [{summary['min_ratio']:.3f}, {summary['max_ratio']:.3f}], "
          f"loss max rel diff {summary['loss_max_rel_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
