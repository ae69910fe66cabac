"""The sequence-parallel norm-grad benchmark runs (2 gloo ranks, a tiny stack) and counts what it claims:
one all-reduce per bucket per step for shardnorm, one per norm per micro-batch for per_layer, one per
norm parameter for torch's SequenceParallel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS, MICRO_BATCHES = 2, 2


@pytest.mark.distributed
def test_norm_grad_collective_counts(tmp_path):
    out = tmp_path / "sp.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "benchmarks/bench_sp_norm_grads.py", "--out", str(out), "--layers", str(LAYERS),
                             "--micro-batches", str(MICRO_BATCHES)],
                            cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    norms = 2 * LAYERS + 1
    counts = {variant: r["norm_grad_collectives_per_step"] for variant, r in results.items()}
    assert counts == {"shardnorm": results["shardnorm"]["buckets"], "shardnorm_per_layer": norms * MICRO_BATCHES,
                      "torch": norms}
    assert results["shardnorm"]["buckets"] == 1
