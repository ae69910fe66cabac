#!/usr/bin/env bash
# Session 14's GPU runs. Usage: OUT=dir [PACK=1] bash benchmarks/gpu_session14.sh STAGE
#   variant  PATCH=file: a staged-forward variant from results/h100-2026-11-25-s14/fwd_variants/*.diff applied
#            (git apply, to commit e765d08) and timed with VARIANT_ARGS (run 1: --warps 32 --lags 0,1,2,3,4 with
#            the benchmark looping LAG over them; run 2: --warps 16,32 --split 0,1, in that diff), then the forward
#            GPU tests on it; then as bwd
#   bwd      the backward half of test_long_rows_staged.py (before the one-slot kernel's removal: run 2)
#   final    quack stage_a (carry .whl/quack_a); the long-row GPU tests of the final code (the staged file, the
#            kernel tests' long rows, CUDA graphs); the forward with and without LayerNorm's bias
#   fwdfinal the final staged forward (LayerNorm statistics per warp, the first chunks' parameters in shared
#            memory): its variants and forward GPU tests; quack stage_a (carry .whl/quack_a)
#   peers    quack install (call 2 of 2, carry .whl/quack_b + Liger), bench_kernels' long rows with every peer
#   small    small N with the peers but quack (carry the Liger wheel) and host time per call, for an H200
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
gpu_versions
case "${1:-final}" in
  variant)
    git apply "${PATCH:?set PATCH}" || exit 1
    box fwd_variants 200 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/fwd_variants.json" ${VARIANT_ARGS:-}
    box fwd_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k forward -rs ;;&
  variant|bwd)
    box bwd_tests 400 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k "not forward" -rs
    box rms32768 120 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60 --only rms:32768:bfloat16 \
        --candidates staged_w32,staged_slices_16384_w16,staged_slices_16384_w16_lead ;;
  final)
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    box final_tests 400 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k "not forward" -rs
    box kernel_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_graphs.py \
        -k "long or 20000 or 40000 or graph" -rs
    box fwd_bias 120 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/fwd_bias.json" --warps 32 ;;
  fwdfinal)  # the staged forward with LayerNorm's parameters held on chip: variants, forward tests; quack stage_a
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    box fwd_variants 200 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/fwd_final.json" --warps 32 \
        --param-chunks 0,3
    box fwd_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k forward -rs ;;
  peers)
    source benchmarks/quack_env.sh install || exit 1
    box longrow_peers 560 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --out "$OUT/longrow_peers.json" ;;
  small)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    box small_n 330 python3 benchmarks/bench_kernels.py --shapes genai,qk --max-n 1024 --weights bfloat16 \
        --providers shardnorm,torch,torch.compile,liger --out "$OUT/small_n.json"
    box host_time 200 python3 benchmarks/host_time.py --shapes 8x4096 8x1024 --out "$OUT/host_time" ;;
esac
echo "== [$((SECONDS - t0)) s] done"
# at most 8 files come back from a call: one archive (PACK=1)
[ -n "${PACK:-}" ] && tar -C "$OUT" -czf /tmp/session14.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/session14.tgz "$OUT/"
