#!/usr/bin/env bash
# Session 11's H100 run. Usage: OUT=dir bash benchmarks/gpu_session11.sh STAGE
#   tests    quack stage_a (call 1 of 2, carry .whl/quack_a), then the GPU tests of the changed kernels and passes
#   longrow  quack install (call 2, carry .whl/quack_b + Liger), bench_kernels' long rows, every peer with quack
#   sweep    the long-row backward candidates (gpu_longrow.py: split, cooperative, cooperative with re-read)
#   hf       HF decoders eager and compiled (native / shardnorm / shardnorm without the passes / Liger), then
#            the compiled Llama step's kernel profile
#   confirm  after REREAD's removal: the long-row backward's GPU tests, then the HF decoders again
#   long     the HF decoders with 6 rounds (90 interleaved steps per variant): compiled shardnorm vs native
#   mainjob  the main job compiled on one GPU (tp=1): torch norms / shardnorm / shardnorm without the passes
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
liger() { python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
          export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT:/tmp/site"; }
case "${1:-tests}" in
  tests)
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT"
    box gpu_tests 480 python3 -m pytest -q -p no:cacheprovider tests/test_compile_fusion.py tests/test_kernels.py \
        tests/test_long_rows_coop.py tests/test_modules.py tests/test_errors.py tests/test_torch_compat.py -rs ;;
  longrow)
    source benchmarks/quack_env.sh install || exit 1
    box longrow_bf16 540 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --out "$OUT/longrow_bf16.json" ;;
  sweep)
    export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT"
    box longrow_sweep 560 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60 ;;
  hf)
    liger
    box hf_models 420 python3 benchmarks/bench_hf_models.py --out "$OUT" --budget-s 380
    box profile_llama 150 python3 benchmarks/profile_hf_step.py --out "$OUT" --arch llama ;;
  confirm)
    liger
    box gpu_tests_long 170 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_coop.py tests/test_kernels.py \
        -k "long or 20000 or coop" -rs
    box hf_models 420 python3 benchmarks/bench_hf_models.py --out "$OUT" --budget-s 380 ;;
  long)
    liger
    box hf_models 580 python3 benchmarks/bench_hf_models.py --out "$OUT" --budget-s 540 --rounds 6 ;;
  mainjob)
    export PYTHONPATH="$ROOT/src:$ROOT"
    run() { NPROC=1 timeout -k 5 170 launch/train.sh configs/llama_small_fsdp_tp.toml parallel.tp=1 train.steps=30 \
              train.timing_skip=10 "${@:2}" --compile > "$OUT/mainjob_$1.txt" 2>&1
            echo "$1 rc=$?"; grep -E "fused|summed|summary" "$OUT/mainjob_$1.txt" | tail -4; }
    run torch --norm torch
    run shardnorm --norm shardnorm
    SHARDNORM_COMPILE_FUSION=0 run shardnorm_unfused --norm shardnorm ;;
esac
echo "== [$((SECONDS - t0)) s] done"
