#!/usr/bin/env bash
# Long-row cooperative backward on one GPU (issue 22), from the repository root:
#   bash benchmarks/gpu_longrow.sh            (writes to $OUT, else ./gpu_longrow_out)
# 1. GPU tests of the cooperative backward vs float64 (tests/test_long_rows_coop.py), and the kernel
#    tests' long rows with every long row forced onto it (SHARDNORM_LONG_BWD=coop); the test that a
#    too-large grid is refused runs alone (were the refusal missing, it could hang).
# 2. benchmarks/gpu_longrow.py: split vs cooperative candidates, checked against float64 and timed
#    (CUDA-graph GPU time and do_bench best of 3), each candidate time-boxed.
# Each step is time-boxed (565 s in all) and logged; a failing step does not stop the next. About 6-8 minutes.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/gpu_longrow_out}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
cd "$ROOT"
PY=${PYTHON:-python3}
step() {  # name seconds command...: run, log, report the exit code
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${secs} s)"
    timeout -k 5 "$secs" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    echo "$name $rc $((SECONDS - t0))" >>"$OUT/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
step tests_coop 120 $PY -m pytest -q -p no:cacheprovider tests/test_long_rows_coop.py -k "not refused" -rs
step tests_refused 45 $PY -m pytest -q -p no:cacheprovider tests/test_long_rows_coop.py -k refused
# (test_backward_is_bitwise_deterministic sizes its grid for the interpreter's 8 SMs: one coop row group)
step tests_kernels_forced_coop 100 env SHARDNORM_LONG_BWD=coop $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "(long or 20000 or 262144 or 2_pow_31 or 40000) and not deterministic" -rs
step bench 300 $PY benchmarks/gpu_longrow.py --out "$OUT" --timeout 60
cat "$OUT/steps.txt"
