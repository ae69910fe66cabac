#!/usr/bin/env bash
# Session 9's last H100 call: the GPU tests on the final kernel code (cooperative table entries as users get
# them, CUDA graphs, every kernel test). Usage: OUT=dir bash benchmarks/gpu_session9_h100_tests.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
box coop_and_graphs 200 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_coop.py tests/test_cuda_graphs.py \
    tests/test_modules.py tests/test_errors.py tests/test_launch.py tests/test_torch_compat.py -rs
box kernels 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rs
echo "== [$((SECONDS - t0)) s] done"
