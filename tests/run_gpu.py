"""The whole test suite on one GPU host, in concurrent pytest shards, with a time limit.

    python tests/run_gpu.py --out DIR [--limit-s 500] [--multi-rank-shards 4] [--single-shards 6]

Multi-rank tests (`-m "distributed or deepspeed"`) run with SHARDNORM_TEST_DEVICE=cuda (NCCL, one GPU per rank)
in shards that share every GPU; the rest run in shards spread over the GPUs (CUDA_VISIBLE_DEVICES, one GPU each),
with shardnorm's default settings. Why shards: a spawned multi-rank test costs 10-30 s of process and NCCL start
on a GPU host, mostly waiting, so one pytest process at a time does not finish the set in a 10-minute call.

Test ids are dealt round-robin to the shards. Each shard's `-v` log goes to DIR/logs/; DIR/gpu_tests.md gets
each shard's outcome as it finishes (passed / failed / skipped / not run, counted from the log, so a shard
stopped at the limit still reports what ran) and every failing test's id, a file that failed to collect as
`path (collection)`; DIR/failures.txt the failing shards' tracebacks and the collection's errors. Exit status 1 if
any test failed or did not run, or a file did not collect.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MULTI_RANK = "distributed or deepspeed"
# `-v` lines: "tests/test_x.py::test_y[param, maybe with spaces] PASSED [ 10%]"
OUTCOME = re.compile(r"^(tests/\S+?::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)
# `--collect-only -q` summary lines of the files that failed to import: their tests are in no id list
COLLECTION_ERROR = re.compile(r"^ERROR (\S+)", re.M)


def outcomes(log: str) -> dict:
    """{test id: PASSED / FAILED / ...} from a `pytest -v` log; a test that failed in its call and its teardown
    keeps the last."""
    return dict(OUTCOME.findall(log))


def collect(marker: str, paths: list) -> tuple:
    """(test ids, files that failed to collect, the collection's output). A file that fails to import (an optional
    package that imports but does not run on this stack) has no ids to deal out: it is reported as failing, not
    left out of the counts."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "-m", marker, *paths], cwd=ROOT, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    errors = COLLECTION_ERROR.findall(out.stdout)
    if not ids and not errors:
        raise SystemExit(f"collected no tests for -m {marker!r}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids, errors, out.stdout + out.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit-s", type=float, default=500, help="every shard is stopped after this long")
    p.add_argument("--multi-rank-shards", type=int, default=4)
    p.add_argument("--single-shards", type=int, default=6)
    p.add_argument("--select", choices=("all", "multi-rank", "single"), default="all")
    p.add_argument("paths", nargs="*", default=["tests/"])
    args = p.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("no GPU visible: run the suite on CPU with bash tests/run.sh")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = args.out / "gpu_tests.md"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    shards = []  # (name, ids, env)
    collection_errors = []
    if args.select in ("all", "multi-rank"):
        ids, errors, output = collect(MULTI_RANK, args.paths)
        collection_errors += _report_collection_errors(args.out, errors, output)
        n = min(args.multi_rank_shards, len(ids))
        shards += [(f"multi_rank_{i}", ids[i::n], {**env, "SHARDNORM_TEST_DEVICE": "cuda"}) for i in range(n)]
    if args.select in ("all", "single"):
        ids, errors, output = collect(f"not ({MULTI_RANK})", args.paths)
        collection_errors += _report_collection_errors(args.out, errors, output)
        n = min(args.single_shards, len(ids))
        shards += [(f"single_{i}", ids[i::n], {**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)}) for i in range(n)]
    with report.open("w") as f:
        f.write(f"# Test suite on {gpus} x {torch.cuda.get_device_name(0)}: torch {torch.__version__}\n\n"
                f"`python tests/run_gpu.py {' '.join(sys.argv[1:])}`\n\n"
                "| shard | tests | passed | failed | skipped | not run | seconds |\n|---|---|---|---|---|---|---|\n")
    start = time.monotonic()
    running = {}
    for name, ids, shard_env in shards:
        log = (logs / f"{name}.log").open("w")
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *ids]
        running[name] = (subprocess.Popen(cmd, cwd=ROOT, env=shard_env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True), ids, log)
    totals = dict(tests=0, passed=0, failed=0, skipped=0, not_run=0)
    failing = [f"{path} (collection)" for path in dict.fromkeys(collection_errors)]
    while running:
        time.sleep(2)
        over = time.monotonic() - start > args.limit_s
        for name in list(running):
            proc, ids, log = running[name]
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
            del running[name]
            text = (logs / f"{name}.log").read_text(errors="replace")
            seen = outcomes(text)
            counts = dict(tests=len(ids), passed=sum(v in ("PASSED", "XFAIL") for v in seen.values()),
                          failed=sum(v in ("FAILED", "ERROR", "XPASS") for v in seen.values()),
                          skipped=sum(v == "SKIPPED" for v in seen.values()))
            counts["not_run"] = len(ids) - len(seen)
            for k in totals:
                totals[k] += counts[k]
            bad = [i for i, v in seen.items() if v in ("FAILED", "ERROR", "XPASS")]
            failing += bad
            seconds = time.monotonic() - start
            with report.open("a") as f:
                f.write(f"| {name} | {counts['tests']} | {counts['passed']} | {counts['failed']} | "
                        f"{counts['skipped']} | {counts['not_run']} | {seconds:.0f} |\n")
            if bad or counts["not_run"]:
                with (args.out / "failures.txt").open("a") as f:
                    f.write(f"==== {name} (rc {proc.returncode}) ====\n{text[-30000:]}\n")
            print(f"{name}: {counts} ({seconds:.0f} s)", flush=True)
    with report.open("a") as f:
        f.write(f"| **all** | {totals['tests']} | {totals['passed']} | {totals['failed']} | {totals['skipped']} | "
                f"{totals['not_run']} | {time.monotonic() - start:.0f} |\n\n")
        f.write("Failed: " + (", ".join(f"`{i}`" for i in failing) if failing else "none") + "\n")
    print(report.read_text())
    return 1 if failing or totals["not_run"] else 0


def _report_collection_errors(out: Path, errors: list, output: str) -> list:
    if errors:
        with (out / "failures.txt").open("a") as f:
            f.write(f"==== collection errors: {', '.join(errors)} ====\n{output[-30000:]}\n")
    return errors


if __name__ == "__main__":
    sys.exit(main())
