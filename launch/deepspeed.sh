#!/usr/bin/env bash
# The main job through the deepspeed launcher (ZeRO data parallel, norms converted by the
# "shardnorm" section of the DeepSpeed JSON):
#   launch/deepspeed.sh CONFIG [parallel.deepspeed_config=configs/deepspeed/zero3.json] [overrides]
# One process per visible GPU, or 2 CPU processes with DS_ACCELERATOR=cpu; NPROC=N overrides.
# Runs under the repository's .venv (set up on first use) or PYTHON; see launch/python_env.sh.
# Overrides and --norm, --check are those of launch/train.sh (launch/train.sh --help).
set -euo pipefail
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then  # the usage above, without setting anything up
    sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
    exit 0
  fi
done
if (( $# == 0 )); then
  echo "usage: launch/deepspeed.sh CONFIG [section.key=value ...] (launch/deepspeed.sh --help)" >&2
  exit 2
fi
# a stop before the launcher takes over the signals: the exit code a stopped job has (the Python steps print its line)
trap 'exit 130' INT
trap 'exit 143' TERM
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"

GPUS=$("$PY" -m parallel.launcher gpus)  # a Ctrl-C meanwhile: one line, exit code 130
if (( GPUS == 0 )); then
  export DS_ACCELERATOR=cpu
fi
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
CONFIG=$1
shift
ARGS=("$CONFIG" parallel.engine=deepspeed parallel.tp=1 "$@")
"$PY" -m parallel.config --world-size "$NPROC" "${ARGS[@]}" > /dev/null
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
# the `deepspeed` command's module (through parallel.launcher, which passes Ctrl-C and SIGTERM on to the ranks), run
# by $PY: its ranks start under the same interpreter
exec "$PY" -m parallel.launcher deepspeed --num_gpus "$NPROC" --master_port "$PORT" --no_local_rank \
  --module parallel.train "${ARGS[@]}"
