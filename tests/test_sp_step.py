"""`benchmarks/sp_step.py` runs (2 gloo ranks, a tiny block stack): each variant's rounds and memory are recorded, the
shardnorm variants' first-step losses are bitwise equal (`keep_output=False` recomputes, bitwise), torch's agree to
bf16 rounding, `--trace` profiles a step per variant, and `--summary` renders the table of the runs in a folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_block_stack_variants_and_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "benchmarks.sp_step", "--device", "cpu", "--out", str(tmp_path), "--dim", "64", "--ffn", "96",
                          "--seq", "32", "--layers", "2", "--rounds", "2", "--steps", "1", "--warmup", "0", "--trace"],
                         cwd=ROOT, env=env, text=True, capture_output=True,
                         timeout=1800)  # a hang, not speed: a busy machine may be slow
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "sp_step_eager_tp2.json").read_text())
    assert set(result["step_ms"]) == {"torch", "shardnorm", "shardnorm_discard"}
    assert all(len(rounds) == 2 for rounds in result["step_ms"].values())
    losses = result["first_step_loss"]
    assert losses["shardnorm"] == losses["shardnorm_discard"], losses
    assert abs(losses["shardnorm"] - losses["torch"]) <= 1e-2 * abs(losses["torch"]), losses
    assert set(result["pairs"]) == {"shardnorm / torch", "shardnorm_discard / torch", "shardnorm_discard / shardnorm"}
    summary = subprocess.run([sys.executable, "-m", "benchmarks.sp_step", "--summary", str(tmp_path)], cwd=ROOT,
                             env=env, text=True, capture_output=True, timeout=1800)
    assert summary.returncode == 0, summary.stderr[-3000:]
    table = (tmp_path / "sp_step.md").read_text()
    assert "| eager_tp2 | shardnorm / torch |" in table
    # one profiled step per variant (no GPU kernels on a CPU), rank 0's trace kept
    assert set(result["trace"]) == {"torch", "shardnorm", "shardnorm_discard"}
    assert len(list(tmp_path.glob("sp_step_trace_eager_tp2_*_rank0.json.gz"))) == 3
    assert not list(tmp_path.glob("*rank1*"))


def test_exposed_time_is_the_part_no_interval_covers():
    """`sp_step._covered`, behind the traces' exposed collective time: the length of an interval covered by the union
    of sorted, possibly overlapping intervals."""
    from benchmarks.sp_step import _covered

    others = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 7.0), (9.0, 10.0)]
    assert _covered((2.5, 8.0), others) == 0.5 + 2.0  # 2.5-3 and 5-7
    assert _covered((3.0, 5.0), others) == 0.0
    assert _covered((0.5, 10.0), others) == 2.5 + 2.0 + 1.0
    assert _covered((4.0, 4.5), []) == 0.0
