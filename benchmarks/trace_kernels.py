"""GPU time by kernel name in the main job's profiled step, for two runs side by side.

    python -m benchmarks.trace_kernels RUN_A/profile_rank0.json.gz RUN_B/profile_rank0.json.gz [--top 30] [--md OUT]

Each trace is what `train.profile_step=N` writes (parallel/collectives.py): one step under torch.profiler. Per
run: the GPU's span (first kernel start to last kernel end) and busy time (kernels of every stream merged),
NCCL kernels apart from compute; per kernel name (Triton and Inductor names kept whole, numbers that only
count instances dropped): calls and total ms in each run, the `--top` names by the larger of the two totals.
Kernel time says where the GPU spends the step; a longer span at equal busy time is time the GPU waited (on
the host or on a peer). Then the host side: CPU ops and profiler ranges by name (inclusive time, so nested ones
count in their parents too), the `--top` names whose totals differ most between the runs. `paired_train
--profile-step N` writes this table for its first pair.
"""

import argparse
import gzip
import json
import re
from collections import defaultdict

from benchmarks.common import table
from parallel.collectives import busy_ms, span_ms

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


def _side_by_side(names: dict, keys: list) -> list[list]:
    """Per name: calls and ms in A and in B, and B's ms minus A's."""
    rows = []
    for n in keys:
        (ca, ta), (cb, tb) = names["A"].get(n, (0, 0.0)), names["B"].get(n, (0, 0.0))
        rows.append([f"`{n[:90]}`", ca, f"{ta:.2f}", cb, f"{tb:.2f}", f"{tb - ta:+.2f}"])
    return rows


def compare(a: str, b: str, top: int = 30) -> str:
    """The markdown tables of two traces: GPU summary, kernels by name, host ops by name."""
    runs = {"A": load(a), "B": load(b)}
    host = {"A": by_name(load(a, HOST), host_name), "B": by_name(load(b, HOST), host_name)}
    lines = [f"A: `{a}`, B: `{b}`", ""]
    lines += table(["", *summary([])], [[label, *(f"{v:.1f}" if isinstance(v, float) else v
                                                  for v in summary(kernels).values())]
                                        for label, kernels in runs.items()])
    names = {label: by_name(kernels) for label, kernels in runs.items()}
    keys = sorted(set(names["A"]) | set(names["B"]),
                  key=lambda n: -max(names["A"].get(n, (0, 0.0))[1], names["B"].get(n, (0, 0.0))[1]))
    lines += [""] + table(["kernel", "A calls", "A ms", "B calls", "B ms", "B - A ms"],
                          _side_by_side(names, keys[:top]))
    keys = sorted(set(host["A"]) | set(host["B"]),
                  key=lambda n: -abs(host["B"].get(n, (0, 0.0))[1] - host["A"].get(n, (0, 0.0))[1]))
    lines += [""] + table(["host op or range", "A calls", "A ms", "B calls", "B ms", "B - A ms"],
                          _side_by_side(host, keys[:top]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--md", help="also write the tables here")
    args = parser.parse_args(argv)
    text = compare(args.a, args.b, args.top)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
