#!/usr/bin/env bash
# Session 10's H100 run (issue 18: compile fusion). Step 1: the GPU tests of the kernels, modules, ops and the
# new Inductor pass; step 2: the HF decoder benchmark (eager and compile, native / shardnorm / unfused / liger).
# Usage: OUT=dir bash benchmarks/gpu_session10.sh tests|hf|fusion|final    (liger from .whl/ into /tmp/site)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT:/tmp/site"
case "${1:-tests}" in
  tests)
    box gpu_tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_compile_fusion.py tests/test_kernels.py \
        tests/test_modules.py tests/test_errors.py tests/test_launch.py tests/test_torch_compat.py -rs -x ;;
  hf)
    box hf_models 560 python3 benchmarks/bench_hf_models.py --out "$OUT" --budget-s 520 ;;
  fusion)  # after the grad-sum pass: its GPU tests, then the compiled step's kernel profile
    box gpu_tests_fusion 200 python3 -m pytest -q -p no:cacheprovider tests/test_compile_fusion.py tests/test_modules.py -rs
    box profile_llama 170 python3 benchmarks/profile_hf_step.py --out "$OUT" --arch llama
    box profile_qwen3 170 python3 benchmarks/profile_hf_step.py --out "$OUT" --arch qwen3 ;;
  final)  # the shipped passes (residual adds only): HF decoders, then the compiled Llama step's profile
    box hf_models 420 python3 benchmarks/bench_hf_models.py --out "$OUT" --budget-s 380
    box profile_llama 150 python3 benchmarks/profile_hf_step.py --out "$OUT" --arch llama ;;
esac
echo "== [$((SECONDS - t0)) s] done"
