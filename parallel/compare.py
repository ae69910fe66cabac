"""Compare finished runs: a Markdown table of their summaries and one plot of their loss curves.

    python -m parallel.compare runs/llama_small_fsdp_tp-fsdp_tp-* [--plot runs/compare_loss.png]

Each argument is a run's output dir (summary.json + metrics.jsonl); the table goes to stdout.
"""

import argparse
import json
import sys
from pathlib import Path

from parallel.metrics import plot_losses

COLUMNS = {
    "run": lambda s: s["run"],
    "norm": lambda s: s["norm"],
    "compile": lambda s: str(s["compile"]).lower(),
    "mesh": lambda s: f"dp={s['dp']} × tp={s['tp']}",
    "dtype": lambda s: s["dtype"],
    "tokens/s": lambda s: f"{s['tokens_per_s']:,.0f}",
    "step (ms)": lambda s: f"{s['step_time_s'] * 1e3:.1f}",
    "peak mem (GiB)": lambda s: f"{s['peak_mem_gib']:.2f}",
    "final loss": lambda s: f"{s['final_loss']:.4f}",
    "norm-grad all-reduces / step": lambda s: str(s.get("norm_grad_all_reduces", "-")),
    "their kernel ms (exposed)": lambda s: (f"{s['norm_grad_kernel_ms']:.2f} ({s['norm_grad_exposed_ms']:.2f})"
                                           if "norm_grad_kernel_ms" in s else "-"),
}


def table(summaries: list[dict]) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    rows += ["| " + " | ".join(cell(s) for cell in COLUMNS.values()) + " |" for s in summaries]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output dirs of finished runs")
    parser.add_argument("--plot", type=Path, help="write the loss curves of all runs here")
    args = parser.parse_args()
    finished = [run for run in args.runs if (run / "summary.json").is_file()]
    for run in args.runs:
        if run not in finished:  # stopped before its end (a signal, an error): no summary to compare
            print(f"{run}: no summary.json (the run did not finish), left out", file=sys.stderr)
    if not finished:
        parser.error("none of the runs finished (no summary.json)")
    summaries = [{"run": run.name, **json.loads((run / "summary.json").read_text())} for run in finished]
    print(table(summaries))
    if args.plot:
        plot_losses(args.plot, {run.name: [json.loads(line)["loss"] for line in
                                           (run / "metrics.jsonl").read_text().splitlines()]
                                for run in finished})


if __name__ == "__main__":
    main()
