#!/usr/bin/env bash
# Session 9's H100 run after merging the cooperative backward and the host-time work (issue 22), one call:
# the kernel/module/launch/CUDA-graph tests, the long-row sweep's second candidate set, host time per call.
# Usage: OUT=dir bash benchmarks/gpu_session9_h100.sh   (liger from .whl/ into /tmp/site for host_time's peer row)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT:/tmp/site"
box tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_modules.py tests/test_errors.py \
    tests/test_launch.py tests/test_cuda_graphs.py tests/test_torch_compat.py -rs
box longrow 200 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60
box host_time 150 python3 benchmarks/host_time.py --out "$OUT"
echo "== [$((SECONDS - t0)) s] done"
