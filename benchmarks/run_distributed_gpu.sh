#!/usr/bin/env bash
# The distributed checks and benchmarks on one host with 2 or 4 GPUs (NCCL): the distributed, FSDP and
# DeepSpeed tests, the norm-grad collective benchmark and the main job. Run from the repo root; wheels for packages
# the host lacks (deepspeed) go in .whl/ (or WHEELS=dir, default ../shared/wheels/gpu-py312 where it exists).
# Everything lands in $WORK and is packed into $OUT/distributed_gpu_MODE_WORKNAME.tgz.
#   OUT=dir bash benchmarks/run_distributed_gpu.sh all|tests|deepspeed|bench|train
# all: every multi-rank test (pytest -m "distributed or deepspeed" over tests/: DTensor, reducer, FSDP, mesh names,
#   keep_output, Lightning, DeepSpeed, the main job's launches) in three groups with a time limit each (ALL_LIMIT_S,
#   default 540 s in all, for a 10-minute call); each group's -rA log and junit xml go to $OUT as it finishes, and
#   $OUT/distributed_gpu_summary.txt gets its pytest summary line. No -x: every failure is reported.
# train: RUNS="--norm torch|..." picks runs, PROFILE_STEP=N profiles step N (0: none); all visible GPUs.
set -uo pipefail
WORK=${WORK:-/tmp/shardnorm-gpu}; OUT=${OUT:-$WORK}; mkdir -p "$WORK" "$OUT"
WHEELS=${WHEELS:-}
if [[ -z "$WHEELS" ]]; then
  if compgen -G ".whl/*.whl" > /dev/null; then WHEELS=.whl; elif [[ -d ../shared/wheels/gpu-py312 ]]; then
    WHEELS=../shared/wheels/gpu-py312; fi
fi
if [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || echo "warning: installing the wheels in $WHEELS failed; the DeepSpeed tests will skip"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 SHARDNORM_TEST_DEVICE=cuda

step() {  # step NAME LIMIT_S COMMAND...: log to $WORK/NAME.log, print the verdict and the log's tail
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$?"; tail -n "${TAIL:-3}" "$WORK/$name.log"
}

# group NAME LIMIT_S PYTEST_ARGS...: one pytest run, its -rA log and junit xml straight to $OUT
group() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($limit s): pytest $*"
  timeout -k 10 "$limit" python3 -m pytest -q -rA -p no:cacheprovider --junitxml="$OUT/junit_$name.xml" "$@" \
    > "$OUT/tests_$name.log" 2>&1
  local rc=$?
  [[ $rc == 124 || $rc == 137 ]] && echo "(stopped at the $limit s limit)" >> "$OUT/tests_$name.log"
  echo "$name rc=$rc: $(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran|passed|failed' "$OUT/tests_$name.log" \
    | tail -n 1)" | tee -a "$OUT/distributed_gpu_summary.txt"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests_$name.log" | head -n 20
}

case "${1:-tests}" in
  all)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/distributed_gpu_summary.txt" 2>&1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'gpus', torch.cuda.device_count())" >> "$OUT/distributed_gpu_summary.txt" 2>&1
    python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >> "$OUT/distributed_gpu_summary.txt" 2>&1
    budget=${ALL_LIMIT_S:-540}
    dist_files=(tests/test_distributed_norms.py tests/test_distributed_parallelize.py tests/test_distributed_reducer.py
                tests/test_torch_compat.py tests/test_mesh_names.py tests/test_hf_models.py)
    ds_files=(tests/test_deepspeed_zero.py tests/test_deepspeed_zero_init.py tests/test_deepspeed_ulysses.py
              tests/test_deepspeed_autotp.py tests/test_deepspeed_config.py)
    group distributed $(( budget * 30 / 100 )) -m "distributed or deepspeed" "${dist_files[@]}"
    group deepspeed $(( budget * 30 / 100 )) -m "distributed or deepspeed" "${ds_files[@]}"
    # the rest: FSDP, keep_output, Lightning, HF, the main job's launches (whatever else is marked multi-rank)
    ignores=(); for f in "${dist_files[@]}" "${ds_files[@]}"; do ignores+=(--ignore "$f"); done
    group others $(( budget * 40 / 100 )) -m "distributed or deepspeed" tests/ "${ignores[@]}"
    cat "$OUT/distributed_gpu_summary.txt" ;;
  tests)
    step distributed 260 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_norms.py \
      tests/test_distributed_parallelize.py tests/test_distributed_reducer.py tests/test_torch_compat.py \
      tests/test_layout.py
    step fsdp 150 python3 -m pytest -q -p no:cacheprovider tests/test_fsdp.py ;;
  deepspeed)
    step deepspeed 200 python3 -m pytest -q -p no:cacheprovider tests/test_deepspeed_zero.py \
      tests/test_deepspeed_ulysses.py tests/test_deepspeed_autotp.py tests/test_deepspeed_config.py ;;
  bench)
    TAIL=14 step sp_norm_grads 150 torchrun --standalone --nproc-per-node 2 benchmarks/bench_sp_norm_grads.py \
      --out "$WORK/sp_norm_grads.json" --steps 2 --warmup 1 ;;
  train)
    IFS='|' read -ra runs <<< "${RUNS:---norm shardnorm|--norm torch|--norm shardnorm --compile|--norm torch --compile}"
    for run in "${runs[@]}"; do
      name=train_$(echo "$run" | tr -d ' -')
      # shellcheck disable=SC2086
      TAIL=1 step "$name" 120 launch/train.sh configs/llama_small_fsdp_tp.toml $run train.steps=30 \
        train.profile_step="${PROFILE_STEP:-12}" "train.out_dir=\"$WORK/$name\""
    done
    python3 -m parallel.compare "$WORK"/train_*/ --plot "$WORK/llama_small_loss.png" > "$WORK/train_table.md" 2>&1
    cat "$WORK/train_table.md" ;;
esac
# profiler traces (one per rank) travel in their own uncompressed tar: they are gzipped already
if compgen -G "$WORK/*/profile_rank*.json.gz" > /dev/null; then
  (cd "$WORK" && tar cf "$OUT/traces_$(basename "$WORK").tar" ./*/profile_rank*.json.gz && rm ./*/profile_rank*.json.gz)
fi
# all: its logs are in $OUT already (at most 8 files come back from a device call)
[[ "${1:-tests}" == all ]] || tar czf "$OUT/distributed_gpu_${1:-tests}_$(basename "$WORK").tgz" -C "$WORK" .
