#!/usr/bin/env bash
# Session 16's GPU runs. Usage: OUT=dir [PACK=1] bash benchmarks/gpu_session16.sh STAGE
#   hints  (run 4) the staged forward's L2 cache hints, results/h100-2026-11-25-s16/run4/cache_hints.diff applied
#          (git apply; the commit after c13e6ff reverted it), at N = 65536 with and without held parameters
#   sliced (run 7) the sliced forward (staged_slices_fwd_kernel, every slice's parameters in shared memory),
#          results/h100-2026-11-25-s16/run7/sliced_fwd.diff applied (reverted after it), against the one-program
#          one: correctness at small M (fewer rows than row groups, a partial last round), then N = 65536
#   train2 (2 GPUs) the host path's GPU tests, the 2-rank DTensor norm tests with it on, then the main job, 30
#          steps of configs/llama_small_fsdp_tp.toml (TP/SP = 2, NCCL), with shardnorm norms and the host path on
#          (SHARDNORM_HOST_PATH=1: its summary.json counts the replayed calls), then with torch norms
#   host   quack stage_a where .whl/quack_a is carried; host time per call with the providers interleaved round by
#          round (carry the Liger wheel)
#   peers  quack install (call 2 of 2, right after `host` on the same machine; carry .whl/quack_b and the Liger
#          wheel), then bench_kernels' long rows with every peer
source "$(dirname "${BASH_SOURCE[0]}")/gpu_prelude.sh"
gpu_versions
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
case "${1:-host}" in
  hints)
    git apply "${PATCH:-benchmarks/results/h100-2026-11-25-s16/run4/cache_hints.diff}" || exit 1
    box fwd_hints 300 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/fwd_hints.json" --warps 32 \
        --param-chunks 0,3 --hints ${HINTS:-0,1,2,4,5,6} ;;
  sliced)
    git apply "${PATCH:-benchmarks/results/h100-2026-11-25-s16/run7/sliced_fwd.diff}" || exit 1
    box sliced_small 90 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/sliced_small.json" --m 1000 \
        --warps 16,32 --param-chunks sliced
    box sliced_tiny 60 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/sliced_tiny.json" --m 20 \
        --warps 32 --param-chunks sliced
    box sliced 300 python3 benchmarks/longrow_fwd_variants.py --out "$OUT/sliced.json" --warps 16,32 \
        --param-chunks 3,sliced ;;
  train2)
    box host_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_host_path.py -rs -x
    box distributed_host_on 150 env SHARDNORM_HOST_PATH=1 SHARDNORM_TEST_DEVICE=cuda python3 -m pytest -q \
        -p no:cacheprovider tests/test_distributed_norms.py -rs -x
    for norm in shardnorm torch; do
      box "train_$norm" 240 env SHARDNORM_HOST_PATH=1 bash launch/train.sh configs/llama_small_fsdp_tp.toml \
          --norm $norm train.steps=30 "train.out_dir=\"$OUT/train_$norm\""
      python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print({k: s.get(k) for k in \
('norm', 'world_size', 'tp', 'step_time_s', 'tokens_per_s', 'final_loss', 'host_path')})" "$OUT/train_$norm/summary.json"
    done ;;
  host)
    [ -d .whl/quack_a ] && source benchmarks/quack_env.sh stage_a
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    box host_time 300 python3 benchmarks/host_time.py --shapes 8x4096 8x1024 4096x128 --out "$OUT/host_time" ;;
  peers)
    source benchmarks/quack_env.sh install || exit 1
    box longrow_peers 560 python3 benchmarks/bench_kernels.py --shapes longrow --weights bfloat16 \
        --out "$OUT/longrow_peers.json" ;;
esac
gpu_done session16
