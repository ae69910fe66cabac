"""Turn bench_kernels JSON into the markdown table and the GB/s-vs-N plot.

    python -m benchmarks.report bench_kernels-bf16-weights.json [more.json] --md bench_kernels.md \
        --png bench_kernels.png

Cells are forward / backward GB/s; a provider whose output missed the float64 reference is marked
"(wrong)" and never counts as the best peer. Peers get a column only where the JSON has them. A row's
note (e.g. quack's LayerNorm casting bf16 weights to fp32) marks its cell with [k], spelled out under
the table (and in the plot's legend). Summary: per norm and weight dtype, the backward geometric-mean
speedup of shardnorm over the best peer (any provider but shardnorm) at each shape, and the shapes
where shardnorm reaches 90% of the copy bandwidth.
"""

import argparse
import json
import math
import textwrap
from collections import defaultdict

from benchmarks.common import pyplot, save_figure, table

PEERS = ("torch", "torch.compile", "torch.compile-max-autotune", "liger", "quack")


def load(paths):
    rows, meta = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = meta or data["meta"]
        rows += data["rows"]
    return meta, rows


def cell(row, notes) -> str:
    """A row's cell; its note, if any, becomes a [k] marker and is added to notes (text -> k)."""
    if row is None:
        return "-"
    mark = f" [{notes.setdefault(row['note'], len(notes) + 1)}]" if "note" in row else ""
    if "failed" in row:
        return "fails" + mark
    flag = "" if row["correct"] else " (wrong)"
    return f"{row['fwd_gbs']:.0f} / {row['bwd_gbs']:.0f}{flag}{mark}"


def present_peers(rows) -> list:
    providers = {r["provider"] for r in rows}
    return [p for p in PEERS if p in providers]


def best_peer(by_provider, key):
    ok = [r for name, r in by_provider.items() if name != "shardnorm" and r and r.get("correct") and key in r]
    return max(ok, key=lambda r: r[key]) if ok else None


def markdown(meta, rows) -> str:
    groups = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        groups[(r["norm"], r["weight_dtype"])][(r["M"], r["N"])][r["provider"]] = r
    peers = present_peers(rows)
    versions = "".join(f", {dist} {v}" for dist, v in meta.get("peers", {}).items())
    out = [f"# Kernel benchmark: {meta['gpu']}, {meta['date']}", "",
           f"torch {meta['torch']}, triton {meta['triton']}{versions}; device-to-device copy in the same run: "
           f"**{meta['copy_gbs']:.0f} GB/s**. Cells: forward / backward GB/s (bf16 x and dy), from do_bench "
           f"medians, the best of {meta.get('repeats', 1)} round(s) over all providers. "
           f"Command: `{meta['command']}`.", ""]
    for (norm, wdtype), shapes in sorted(groups.items()):
        name = "RMSNorm" if norm == "rms" else "LayerNorm (with bias)"
        speedups, at_copy, notes, cells = [], [], {}, []
        for (m, n), by_provider in sorted(shapes.items(), key=lambda kv: (kv[0][0] != 32768, kv[0][1])):
            ours = by_provider.get("shardnorm")
            peer = best_peer(by_provider, "bwd_gbs")
            ratio = ours["bwd_gbs"] / peer["bwd_gbs"] if ours and "bwd_gbs" in ours and peer else None
            if ratio:
                speedups.append(ratio)
            of_copy = (f"{ours['fwd_of_copy']:.0%} / {ours['bwd_of_copy']:.0%}" if ours and "fwd_of_copy" in ours
                       else "-")
            if ours and "fwd_of_copy" in ours and min(ours["fwd_of_copy"], ours["bwd_of_copy"]) >= 0.9:
                at_copy.append(n)
            cells.append([f"{m} x {n}", cell(ours, notes), of_copy, *(cell(by_provider.get(p), notes) for p in peers),
                          f"{ratio:.2f}x" if ratio else "-"])
        geo = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else float("nan")
        out += [f"## {name}, {wdtype} weights", ""]
        out += table(["M x N", "shardnorm", "fwd / bwd of copy", *peers, "bwd vs best peer"], cells) + [""]
        if notes:
            out += [f"[{k}] {text}  " for text, k in notes.items()] + [""]
        out += [f"Backward geometric-mean speedup over the best correct peer: **{geo:.2f}x**; "
                f"forward and backward both >= 90% of copy at N = {at_copy or 'none'}.", ""]
    return "\n".join(out)


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for i, norm in enumerate(("rms", "layer")):
        for j, key in enumerate(("fwd_gbs", "bwd_gbs")):
            ax = axes[i][j]
            for provider in ["shardnorm"] + present_peers(rows):
                curve = [r for r in rows if r["provider"] == provider and r["norm"] == norm
                         and r["M"] == 32768 and r["weight_dtype"] == "bfloat16" and key in r]
                notes = sorted({r["note"] for r in curve if "note" in r})
                if curve:
                    ax.plot(*zip(*sorted((r["N"], r[key]) for r in curve)), marker="o",
                            label="\n".join([provider] + [textwrap.fill(note, 44) for note in notes]))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{'RMSNorm' if norm == 'rms' else 'LayerNorm'} {'forward' if j == 0 else 'backward'}, "
                         "M=32768, bf16")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("N (hidden size)")
    for row in axes:
        row[0].legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("json", nargs="+")
    parser.add_argument("--md", required=True)
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    meta, rows = load(args.json)
    with open(args.md, "w") as f:
        f.write(markdown(meta, rows) + "\n")
    plot(rows, args.png)


if __name__ == "__main__":
    main()
