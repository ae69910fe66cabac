"""Paired step-time differences of bench_hf_models.py's variants against one of them (the model's own norms).

bench_hf_models.py interleaves the variants' timed steps one by one, so step i of a variant and step i of the
base ran side by side and their difference cancels the GPU's drift over a round. Per (arch, mode, variant):
the median of the paired differences, its 95% bootstrap interval (scipy.stats.bootstrap, fixed seed) and the
median difference as a share of the base's median step. The interval covers step-to-step noise within one
run only: each run compiles its variants afresh, so compiled variants can differ by more between runs than
the interval says; read several runs (docs/performance.md).

    python benchmarks/paired_steps.py RUN1/hf_models.json [RUN2/hf_models.json ...] [--base native] [--md OUT.md]
"""

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from scipy.stats import bootstrap


def paired(rows: list, base: str, seed: int = 0) -> list:
    """One dict per (arch, mode, variant) with steps in `rows` and a `base` variant to pair with."""
    by_case = {(r["arch"], r["mode"], r["variant"]): r for r in rows if r.get("step_ms")}
    out = []
    for (arch, mode, variant), row in by_case.items():
        ref = by_case.get((arch, mode, base))
        if variant == base or ref is None:
            continue
        n = min(len(row["step_ms"]), len(ref["step_ms"]))
        diff = np.asarray(row["step_ms"][:n]) - np.asarray(ref["step_ms"][:n])
        ci = bootstrap((diff,), np.median, confidence_level=0.95, n_resamples=5000, method="percentile",
                       random_state=np.random.default_rng(seed)).confidence_interval
        base_ms = statistics.median(ref["step_ms"][:n])
        out.append(dict(arch=arch, mode=mode, variant=variant, steps=n, median_diff_ms=float(np.median(diff)),
                        ci_low_ms=float(ci.low), ci_high_ms=float(ci.high), base_median_ms=base_ms,
                        median_diff_pct=100 * float(np.median(diff)) / base_ms))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="bench_hf_models.py JSON files")
    parser.add_argument("--base", default="native", help="the variant the others pair with (default native)")
    parser.add_argument("--md", help="also write the table here")
    args = parser.parse_args()
    lines = [f"Paired step differences vs `{args.base}` (variant minus {args.base}, ms; negative: faster), median "
             "and 95% bootstrap interval of the per-step differences within each run.", "",
             "| run | arch | mode | variant | steps | median diff ms | 95% interval | % of base step |",
             "|---|---|---|---|---|---|---|---|"]
    for path in args.runs:
        with open(path) as f:
            rows = json.load(f)["rows"]
        run = Path(path).parent.name
        for r in paired(rows, args.base):
            lines.append(f"| {run} | {r['arch']} | {r['mode']} | {r['variant']} | {r['steps']} | "
                         f"{r['median_diff_ms']:+.2f} | [{r['ci_low_ms']:+.2f}, {r['ci_high_ms']:+.2f}] | "
                         f"{r['median_diff_pct']:+.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
