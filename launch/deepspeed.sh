#!/usr/bin/env bash
# The main job through the deepspeed launcher (ZeRO data parallel, norms converted by the
# "shardnorm" section of the DeepSpeed JSON), from the repository root:
#   launch/deepspeed.sh CONFIG [parallel.deepspeed_config=configs/deepspeed/zero3.json] [overrides]
# One process per visible GPU, or 2 CPU processes with DS_ACCELERATOR=cpu; NPROC=N overrides.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if (( GPUS == 0 )); then
  export DS_ACCELERATOR=cpu
fi
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
CONFIG=$1
shift
ARGS=("$CONFIG" parallel.engine=deepspeed parallel.tp=1 "$@")
python -m parallel.config --world-size "$NPROC" "${ARGS[@]}" > /dev/null
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
exec deepspeed --num_gpus "$NPROC" --master_port "$PORT" --no_local_rank --module parallel.train \
  "${ARGS[@]}"
