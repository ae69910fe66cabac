#!/usr/bin/env bash
# The main job through torchrun:
#   launch/train.sh CONFIG [section.key=value ...] [--norm shardnorm|torch] [--check] [--compile]
# One process per visible GPU (NCCL), or 2 CPU processes (gloo) without a GPU; NPROC=N overrides.
# Runs under the repository's .venv (set up on first use) or PYTHON; see launch/python_env.sh.
# The config is checked against the world size before any process starts.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
"$PY" -m parallel.config --world-size "$NPROC" "$@" > /dev/null
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m parallel.train "$@"
