#!/usr/bin/env bash
# Session 12's GPU runs. Usage: OUT=dir bash benchmarks/gpu_session12.sh STAGE
#   staged   the staged (Gluon, shared-memory) long-row backward: its GPU tests, then gpu_longrow.py's
#            split / cooperative / staged candidates at the rows it fits (LayerNorm 14336 and 16384)
#   tests    quack stage_a (call 1 of 2, carry .whl/quack_a), then the long-row GPU tests (staged, cooperative,
#            the kernel tests' long rows)
#   longrow  quack install (call 2, carry .whl/quack_b + Liger), bench_kernels' long rows, every peer with quack
#   fwd      the staged forward: its GPU tests, then bench_kernels' long rows (peers but quack, which takes two
#            calls to install; its numbers from `longrow`) and shardnorm alone with SHARDNORM_LONG_FWD=chunked
#   host     host time per call (benchmarks/host_time.py), and the kernel tests of the changed launch path
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
gpu_versions
case "${1:-staged}" in
  staged)
    [ -n "${SKIP_TESTS:-}" ] || box staged_tests 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_long_rows_staged.py -rs
    box staged_sweep 300 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 60 \
        --only layer:14336:bfloat16,layer:16384:bfloat16,rms:32768:bfloat16 \
        --candidates "${CANDIDATES:-split,coop_8192x1_w16,coop_8192x1_w32,staged_w16,staged_w32}" ;;
  tests)
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    box gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py \
        tests/test_long_rows_coop.py tests/test_kernels.py -k "long or 20000 or coop or staged" -rs ;;
  longrow)
    source benchmarks/quack_env.sh install || exit 1
    box longrow_bf16 540 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --out "$OUT/longrow_bf16.json" ;;
  fwd)
    box fwd_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k forward -rs
    box longrow_fwd 300 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --providers shardnorm,torch,torch.compile --out "$OUT/longrow_fwd.json"
    SHARDNORM_LONG_FWD=chunked box longrow_chunked 150 python3 benchmarks/bench_kernels.py --shapes longrow \
        --weights bfloat16 --providers shardnorm --out "$OUT/longrow_chunked.json" ;;
  fwd_ln)  # the LayerNorm forward with Welford moments: its tests and the benchmark rows
    box fwd_ln_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_long_rows_staged.py -k "forward and not rms"
    box longrow_fwd_ln 150 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 --norms layer \
        --providers shardnorm,torch.compile --out "$OUT/longrow_fwd_ln.json" ;;
  slices)  # the sliced staged backward (rows over 2-8 programs): its tests, then the long rows it is for
    box slices_tests 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_long_rows_staged.py -k "sliced" -rs
    box slices_sweep 150 python3 benchmarks/gpu_longrow.py --out "$OUT" --timeout 30 \
        --only layer:32768:bfloat16,layer:65536:bfloat16,rms:65536:bfloat16 \
        --candidates coop_8192x1_w16,coop_8192x1_w32,staged_slices_16384,staged_slices_8192 ;;
  host)
    box gpu_tests_host 260 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_launch.py \
        tests/test_cuda_graphs.py -rs
    # before (session 11's package, bench_old/src: `git archive 35e85cd src`) and after, alternating
    for i in 1 2; do
      PYTHONPATH="$ROOT/bench_old/src:$ROOT/tests:$ROOT" box "host_before_$i" 120 python3 benchmarks/host_time.py \
          --shapes 8x4096 8x1024 --out "$OUT/before_$i"
      box "host_after_$i" 150 python3 benchmarks/host_time.py --shapes 8x4096 8x1024 --pointers-ab --out "$OUT/after_$i"
    done ;;
esac
echo "== [$((SECONDS - t0)) s] done"
