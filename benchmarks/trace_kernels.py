"""GPU time by kernel name in the main job's profiled step, for two runs side by side.

    python benchmarks/trace_kernels.py RUN_A/profile_rank0.json.gz RUN_B/profile_rank0.json.gz [--top 30] [--md OUT]

Each trace is what `train.profile_step=N` writes (parallel/collectives.py): one step under torch.profiler. Per
run: the GPU's span (first kernel start to last kernel end) and busy time (kernels of every stream merged),
NCCL kernels apart from compute; per kernel name (Triton and Inductor names kept whole, numbers that only
count instances dropped): calls and total ms in each run, the `--top` names by the larger of the two totals.
Kernel time says where the GPU spends the step; a longer span at equal busy time is time the GPU waited (on
the host or on a peer). Then the host side: CPU ops and profiler ranges by name (inclusive time, so nested ones
count in their parents too), the `--top` names whose totals differ most between the runs.
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the main job's parallel/
from parallel.collectives import busy_ms, span_ms  # noqa: E402

HOST = ("cpu_op", "user_annotation")


def load(path: str, cats=("kernel",)) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in cats]


def summary(kernels: list[dict]) -> dict:
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    compute = [k for k in kernels if "nccl" not in k["name"].lower()]
    intervals = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
    return {"kernels": len(kernels), "span_ms": span_ms(intervals), "busy_ms": busy_ms(intervals),
            "compute_busy_ms": busy_ms((k["ts"], k["ts"] + k["dur"]) for k in compute),
            "compute_kernel_ms": sum(k["dur"] for k in compute) / 1e3,
            "nccl_kernels": len(nccl), "nccl_kernel_ms": sum(k["dur"] for k in nccl) / 1e3}


def name_of(kernel: str) -> str:
    """A kernel's name without what only numbers its instances (Inductor's trailing _N, template hashes)."""
    return re.sub(r"_\d+$", "", kernel.split("(")[0])[:90]


def host_name(op: str) -> str:
    """A host op's name without what differs between runs of one program (graph hashes, recompile numbers)."""
    return re.sub(r"Torch-Compiled Region: \d+/\d+", "Torch-Compiled Region",
                  re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", op))


def by_name(events: list[dict], name=name_of) -> dict:
    out = defaultdict(lambda: [0, 0.0])
    for k in events:
        row = out[name(k["name"])]
        row[0] += 1
        row[1] += k["dur"] / 1e3
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--md", help="also write the tables here")
    args = parser.parse_args(argv)
    runs = {"A": load(args.a), "B": load(args.b)}
    host = {"A": by_name(load(args.a, HOST), host_name), "B": by_name(load(args.b, HOST), host_name)}
    lines = [f"A: `{args.a}`, B: `{args.b}`", "", "| | " + " | ".join(summary([]).keys()) + " |",
             "|---" * (len(summary([])) + 1) + "|"]
    for label, kernels in runs.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                                 for v in summary(kernels).values()) + " |")
    names = {label: by_name(kernels) for label, kernels in runs.items()}
    keys = sorted(set(names["A"]) | set(names["B"]),
                  key=lambda n: -max(names["A"].get(n, (0, 0.0))[1], names["B"].get(n, (0, 0.0))[1]))
    lines += ["", "| kernel | A calls | A ms | B calls | B ms | B - A ms |", "|---|---|---|---|---|---|"]
    for n in keys[:args.top]:
        (ca, ta), (cb, tb) = names["A"].get(n, (0, 0.0)), names["B"].get(n, (0, 0.0))
        lines.append(f"| `{n}` | {ca} | {ta:.2f} | {cb} | {tb:.2f} | {tb - ta:+.2f} |")
    lines += ["", "| host op or range | A calls | A ms | B calls | B ms | B - A ms |", "|---|---|---|---|---|---|"]
    for n in sorted(set(host["A"]) | set(host["B"]),
                    key=lambda n: -abs(host["B"].get(n, (0, 0.0))[1] - host["A"].get(n, (0, 0.0))[1]))[:args.top]:
        (ca, ta), (cb, tb) = host["A"].get(n, (0, 0.0)), host["B"].get(n, (0, 0.0))
        lines.append(f"| `{n[:90]}` | {ca} | {ta:.2f} | {cb} | {tb:.2f} | {tb - ta:+.2f} |")
    text = "\n".join(lines) + "\n"
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
