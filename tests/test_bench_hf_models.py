"""`benchmarks/bench_hf_models.py --smoke` (tiny shapes on the CPU): every variant prepared, timed and, with
`--profile`, profiled; the discarding variant's first-step loss equals the kept one's (bitwise: it recomputes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_with_profile(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_hf_models", "--smoke", "--out", str(tmp_path),
                          "--archs", "llama", "--modes", "eager", "--variants", "native,shardnorm,shardnorm_discard",
                          "--no-fp32-reference", "--profile"], cwd=ROOT, env=env, text=True, capture_output=True,
                         timeout=900)  # a hang, not speed
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "hf_models.json").read_text())["rows"]}
    assert set(rows) == {"native", "shardnorm", "shardnorm_discard"}
    assert not any("error" in r for r in rows.values()), rows
    assert rows["shardnorm"]["loss"] == rows["shardnorm_discard"]["loss"]
    assert all(r["profile"]["host_queued_ms"] > 0 for r in rows.values())
    assert all(len(r["host_ms"]) == len(r["step_ms"]) and r["host_median_ms"] > 0 for r in rows.values())
    assert "One profiled step per variant" in (tmp_path / "hf_models.md").read_text()
