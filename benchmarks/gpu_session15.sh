#!/usr/bin/env bash
# Session 15's GPU runs. Usage: OUT=dir [PACK=1] bash benchmarks/gpu_session15.sh STAGE
#   host   the C++ host path (src/shardnorm/host/): build it, its GPU tests with CUDA graphs and the launcher's,
#          then host time per call with and without it, torch and Liger in the same run (carry the Liger wheel)
#   small  host, then small N (128-1024, QK-norm rows) with the peers but quack, the host path on
#   suite  the kernel, module and error tests with the host path on (SHARDNORM_HOST_PATH=1: every eager call they
#          make replays, checked against float64), then the module, error and compile tests as CI runs them (off)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
gpu_versions
case "${1:-host}" in
  host|small)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    box build 300 python3 -c "import time; from shardnorm import host; t = time.time(); host.load(); \
print(f'built in {time.time() - t:.0f} s')"
    box host_tests 400 python3 -m pytest -q -p no:cacheprovider tests/test_host_path.py tests/test_cuda_graphs.py \
        tests/test_launch.py -rs -x
    box host_time 300 python3 benchmarks/host_time.py --shapes 8x4096 8x1024 4096x128 --out "$OUT/host_time" ;;&
  small)
    box small_n 330 python3 benchmarks/bench_kernels.py --shapes genai,qk --max-n 1024 --weights bfloat16 \
        --providers shardnorm,torch,torch.compile,liger --out "$OUT/small_n.json" ;;
  suite)
    box suite_host_on 400 env SHARDNORM_HOST_PATH=1 python3 -m pytest -q -p no:cacheprovider \
        ${SUITE_TESTS:-tests/test_kernels.py tests/test_modules.py tests/test_errors.py} -x -rs
    [ -n "${HOST_ON_ONLY:-}" ] || box suite_host_off 300 python3 -m pytest -q -p no:cacheprovider tests/test_modules.py tests/test_errors.py \
        tests/test_compile_fusion.py -x -rs ;;
esac
echo "== [$((SECONDS - t0)) s] done"
# at most 8 files come back from a call: one archive (PACK=1)
[ -n "${PACK:-}" ] && tar -C "$OUT" -czf /tmp/session15.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/session15.tgz "$OUT/"
