#!/usr/bin/env bash
# The distributed benchmarks on one host with 2 or 4 GPUs (NCCL): the norm-grad collective benchmark and the
# main job's runs (the tests on GPUs: tests/run_gpu.py). Run from the repo root; wheels for packages the host lacks
# (deepspeed) go in .whl/ (or WHEELS=dir, default ../shared/wheels/gpu-py312 where it exists).
# Everything lands in $WORK and is packed into $OUT/distributed_gpu_MODE_WORKNAME.tgz.
#   OUT=dir bash benchmarks/run_distributed_gpu.sh bench|train
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
    || echo "warning: installing the wheels in $WHEELS failed: no deepspeed"
  export PYTHONPATH=/tmp/site
fi
# launch/train.sh runs under PYTHON (else it sets up the repository's .venv, which needs the network)
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHON=${PYTHON:-$(command -v python3)}

step() {  # step NAME LIMIT_S COMMAND...: log to $WORK/NAME.log, print the verdict and the log's tail
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$?"; tail -n "${TAIL:-3}" "$WORK/$name.log"
}

case "${1:-bench}" in
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
tar czf "$OUT/distributed_gpu_${1:-bench}_$(basename "$WORK").tgz" -C "$WORK" .
