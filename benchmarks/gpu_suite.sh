#!/usr/bin/env bash
# Checks and benchmarks on one GPU machine, from the checkout, with shardnorm's default settings:
#
#   OUT=DIR bash benchmarks/gpu_suite.sh STAGE...
#
#   tests    the kernel, module, op, checkpointing and compile tests on the GPU, then the fuzz test (GPU_FUZZ_CASES)
#   longrow  benchmarks/gpu_longrow.py: the long-row kernel table's choice against its candidates
#   kernels  benchmarks/bench_kernels.py, shardnorm only; with BASELINE=DIR (another checkout's src/) that tree is
#            timed by the same harness in the same run first (before/after)
#   peers    benchmarks/bench_kernels.py with every peer, then report.py's table and plot
#   host     benchmarks/host_time.py
#   memory   benchmarks/memory_keep_output.py (keep_output=False on a Hugging Face Llama decoder)
#   models   benchmarks/bench_hf_models.py, eager
#   train    the main job on this machine's GPUs (configs/llama_small_fsdp_tp.toml), keep_output off and on
#
# The GPU machines reach no registry: wheels in .whl/ (deepspeed, liger-kernel) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
SHAPES=${SHAPES:-genai,llama,qk,longrow}
status=0
stage() { echo "== $1 $(date -u +%T)"; }

for s in "$@"; do
  stage "$s"
  case "$s" in
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_long_rows_staged.py \
        tests/test_batch_invariance.py tests/test_backends.py tests/test_launch.py tests/test_modules.py \
        tests/test_errors.py tests/test_double_backward.py tests/test_cuda_graphs.py tests/test_keep_output.py \
        tests/test_checkpointing.py >"$OUT/tests.log" 2>&1 || status=1
      tail -n 25 "$OUT/tests.log"
      GPU_FUZZ_CASES=${GPU_FUZZ_CASES:-200} python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_fuzz.py \
        >"$OUT/fuzz.log" 2>&1 || status=1
      grep -m1 GPU_FUZZ_SEED "$OUT/fuzz.log"; tail -n 5 "$OUT/fuzz.log" ;;
    longrow)
      python3 benchmarks/gpu_longrow.py --out "$OUT/longrow" >"$OUT/longrow.log" 2>&1 || status=1
      tail -n 30 "$OUT/longrow.log" ;;
    kernels)
      if [ -n "${BASELINE:-}" ]; then
        PYTHONPATH="$BASELINE:$PWD/tests:/tmp/site" python3 benchmarks/bench_kernels.py \
          --providers shardnorm --weights bfloat16,float32 --shapes "$SHAPES" --out "$OUT/kernels_before.json" \
          >"$OUT/kernels_before.log" 2>&1 || status=1
      fi
      python3 benchmarks/bench_kernels.py --providers shardnorm --weights bfloat16,float32 --shapes "$SHAPES" \
        --out "$OUT/kernels_after.json" >"$OUT/kernels_after.log" 2>&1 || status=1
      tail -n 3 "$OUT/kernels_after.log" ;;
    peers)
      python3 benchmarks/bench_kernels.py --providers shardnorm,torch,torch.compile,liger,quack --weights bfloat16 \
        --shapes genai,llama --out "$OUT/bench_kernels.json" >"$OUT/peers.log" 2>&1 || status=1
      python3 benchmarks/report.py "$OUT/bench_kernels.json" >>"$OUT/peers.log" 2>&1 || status=1
      tail -n 40 "$OUT/peers.log" ;;
    host)
      python3 benchmarks/host_time.py --out "$OUT" >"$OUT/host.log" 2>&1 || status=1
      tail -n 40 "$OUT/host.log" ;;
    memory)
      python3 benchmarks/memory_keep_output.py --out "$OUT/keep_output" >"$OUT/memory.log" 2>&1 || status=1
      tail -n 30 "$OUT/memory.log" ;;
    models)
      python3 benchmarks/bench_hf_models.py --modes eager --out "$OUT/hf_models" >"$OUT/models.log" 2>&1 || status=1
      tail -n 30 "$OUT/models.log" ;;
    train)
      tp=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
      for keep in true false; do
        PYTHON=python3 bash launch/train.sh configs/llama_small_fsdp_tp.toml "model.norm_keep_output=$keep" "parallel.tp=$tp" \
          "train.out_dir=$OUT/train_keep_output_$keep" >"$OUT/train_keep_output_$keep.log" 2>&1 || status=1
        grep -h "summary" "$OUT/train_keep_output_$keep.log" | tail -n 1
      done ;;
    *) echo "unknown stage $s"; status=2 ;;
  esac
done
stage done
exit $status
