#!/usr/bin/env bash
# Session 9's 2-GPU run (2 x H200, NCCL): torchtitan's own trainer stock vs shardnorm (issue 20, after the
# reducer's meta-device fix), then the DeepSpeed tests after the AutoTP reducer move. Wheels for what the
# GPU image lacks (torchtitan and its imports, deepspeed, liger) in .whl/.
# Usage: bash benchmarks/gpu_session9.sh OUT   (OUT gets torchtitan_gpu.md/json and s9.tgz with every log)
set -u
OUT=${1:?usage: bash benchmarks/gpu_session9.sh OUT}
W=/tmp/s9; mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$W/pip.log" 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/gpus.txt"
RUN_TIMEOUT=110 timeout 420 bash benchmarks/gpu_torchtitan.sh "$W/torchtitan"
cp "$W/torchtitan/torchtitan_gpu.md" "$W/torchtitan/torchtitan_gpu.json" "$OUT/" 2>/dev/null
OUT="$W/deepspeed" WORK=/tmp/ds timeout 170 bash benchmarks/run_distributed_gpu.sh deepspeed | tee "$OUT/deepspeed.txt"
cp /tmp/ds/*.log "$W/deepspeed/" 2>/dev/null
tar czf "$OUT/s9.tgz" -C "$W" . 2>/dev/null
