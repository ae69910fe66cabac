#!/usr/bin/env bash
# The main job through torchrun, from the repository root:
#   launch/train.sh CONFIG [section.key=value ...] [--norm shardnorm|torch] [--check] [--compile]
# One process per visible GPU (NCCL), or 2 CPU processes (gloo) without a GPU; NPROC=N overrides.
# The config is checked against the world size before any process starts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# A fresh machine: install first (launch/setup.sh is idempotent, but skipped when all is there).
python -c "import torch, triton, matplotlib" 2>/dev/null || bash "$ROOT/launch/setup.sh"

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
python -m parallel.config --world-size "$NPROC" "$@" > /dev/null
exec torchrun --standalone --nproc-per-node "$NPROC" -m parallel.train "$@"
