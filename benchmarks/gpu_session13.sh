#!/usr/bin/env bash
# Session 13's GPU runs. Usage: OUT=dir bash benchmarks/gpu_session13.sh STAGE
#   kernels  the long-row GPU tests of the staged
#            kernels (sliced backward with two and three row slots, one slice; the one-pass LayerNorm forward),
#            then gpu_longrow.py's staged candidates at LayerNorm 14336-65536 and RMSNorm 65536
#   fwd      quack stage_a when .whl/quack_a is carried; TESTS: a -k selection of the staged tests; the staged
#            forward's variants (longrow_fwd_variants.py: warps x LayerNorm moments in one or two passes)
#   final    quack stage_a (carry .whl/quack_a), the final code's long-row GPU tests and the table's configs
#   small    small N with the peers but quack (carry the Liger wheel) and host time per call, for an H200
#   peers    quack install (call 2, carry .whl/quack_b + Liger), bench_kernels' long rows with every peer
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
gpu_versions
case "${1:-kernels}" in
  kernels)
    [ -n "${SKIP_TESTS:-}" ] || box staged_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py \
        -k "sliced or forward" -rs
    box staged_sweep 300 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60 \
        --only "${SHAPES:-layer:14336:bfloat16,layer:16384:bfloat16,layer:32768:bfloat16,layer:65536:bfloat16,rms:65536:bfloat16}" \
        --candidates "${CANDIDATES:-staged_w32,staged_slices_16384,staged_slices_16384_lead,staged_slices_16384_w16,staged_slices_16384_w16_lead}" ;;
  fwd)
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    [ -n "${TESTS:-}" ] && box tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k "$TESTS" -rs
    box fwd_variants 200 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/fwd_variants.json" ;;
  final)  # quack stage_a when carried (call 1 of 2), the final code's long-row GPU tests, the table's configs swept
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    box final_tests 330 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py \
        tests/test_long_rows_coop.py -rs
    box final_sweep 200 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60 \
        --only layer:14336:bfloat16,layer:16384:bfloat16,layer:32768:bfloat16,layer:65536:bfloat16,rms:32768:bfloat16,rms:65536:bfloat16 \
        --candidates staged_w32,staged_slices_16384_w16,staged_slices_16384_w16_lead ;;
  small)  # small N (QK-norm rows and N = 1024) with the peers but quack, and host time per call (an H200)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    box small_n 330 python3 benchmarks/bench_kernels.py --shapes genai,qk --max-n 1024 --weights bfloat16 \
        --providers shardnorm,torch,torch.compile,liger --out "$OUT/small_n.json"
    box host_time 200 python3 benchmarks/host_time.py --shapes 8x4096 8x1024 --out "$OUT/host_time" ;;
  peers)
    source benchmarks/quack_env.sh install || exit 1
    box longrow_peers 560 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --out "$OUT/longrow_peers.json" ;;
esac
echo "== [$((SECONDS - t0)) s] done"
# at most 8 files come back from a call: one archive (PACK=1)
[ -n "${PACK:-}" ] && tar -C "$OUT" -czf /tmp/session13.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/session13.tgz "$OUT/"
