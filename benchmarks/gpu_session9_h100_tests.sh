#!/usr/bin/env bash
# Session 9's last H100 call: the GPU tests on the final kernel code (cooperative table entries as users get
# them, CUDA graphs, every kernel test). Usage: OUT=dir bash benchmarks/gpu_session9_h100_tests.sh
set -u
OUT=${OUT:?set OUT}; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT"
t0=$SECONDS
box() { local name=$1 secs=$2; shift 2; echo "== [$((SECONDS - t0)) s] $name"
        timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -4 "$OUT/$name.txt"; }
box coop_and_graphs 200 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_coop.py tests/test_cuda_graphs.py \
    tests/test_modules.py tests/test_errors.py tests/test_launch.py tests/test_torch_compat.py -rs
box kernels 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rs
echo "== [$((SECONDS - t0)) s] done"
