"""Before/after table of two bench_kernels.py (or kernel_gpu_time.py) runs of shardnorm (same harness, same GPU,
same run).

    python benchmarks/compare_kernels.py BEFORE.json AFTER.json [AFTER_MORE.json ...] --md compare.md

Rows of later AFTER files replace earlier ones of the same shape (norm, M, N, weight dtype). Cells: GB/s before ->
after and the ratio; shapes where either side missed the float64 reference are marked "(wrong)".
"""

import argparse
import json


def _rows(paths):
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if r.get("provider", "shardnorm") == "shardnorm":  # kernel_gpu_time.py rows are shardnorm's
                    rows[(r["norm"], r["M"], r["N"], r["weight_dtype"])] = r
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="+")
    parser.add_argument("--md", required=True)
    args = parser.parse_args()
    before, after = _rows([args.before]), _rows(args.after)
    lines = ["| norm | M x N | weights | fwd GB/s before -> after | ratio | bwd GB/s before -> after | ratio |",
             "|---|---|---|---|---|---|---|"]
    for key in sorted(after, key=lambda k: (k[0], k[3], k[2])):
        if key not in before:
            continue
        b, a = before[key], after[key]
        wrong = "" if b.get("correct", True) and a.get("correct", True) else " (wrong)"
        lines.append(f"| {key[0]} | {key[1]} x {key[2]} | {key[3]} | {b['fwd_gbs']:.0f} -> {a['fwd_gbs']:.0f} | "
                     f"{a['fwd_gbs'] / b['fwd_gbs']:.3f} | {b['bwd_gbs']:.0f} -> {a['bwd_gbs']:.0f} | "
                     f"{a['bwd_gbs'] / b['bwd_gbs']:.3f}{wrong} |")
    with open(args.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
