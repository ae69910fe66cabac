#!/usr/bin/env bash
# The main job through torchrun:
#   launch/train.sh CONFIG [section.key=value ...] [--norm shardnorm|torch] [--check] [--compile]
#
# CONFIG              a TOML file, e.g. configs/tiny_cpu.toml (keys: docs/training.md)
# section.key=value   optional overrides, values in TOML syntax: train.steps=20 train.lr=1e-3 data.path="book.txt"
# --norm X            same as train.norm=X: shardnorm (default) or torch
# --check             same as train.check=true: then compare the losses with a single-process run on torch's norms
# --compile           same as train.compile=true: torch.compile each block
#
# One process per visible GPU (NCCL), or 2 CPU processes (gloo) without a GPU; NPROC=N overrides.
# Runs under the repository's .venv (set up on first use) or PYTHON; see launch/python_env.sh.
# The config is checked against the world size before any process starts. Ctrl-C or SIGTERM stops the job with
# one line saying which checkpoint the same command resumes from.
# Exit code: 0; 2 for a setting refused with one line (config error: …, checkpoint error: …); 1 for a failed --check
# or a rank's error; 128 + N for a stop by signal N.
set -euo pipefail
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then  # the usage above, without setting anything up
    sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
    exit 0
  fi
done
# a stop before the launcher takes over the signals: the exit code a stopped job has (the Python steps print its line)
trap 'exit 130' INT
trap 'exit 143' TERM
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"

GPUS=$("$PY" -m parallel.launcher gpus)  # a Ctrl-C meanwhile: one line, exit code 130
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
"$PY" -m parallel.config --world-size "$NPROC" "$@" > /dev/null
exec "$PY" -m parallel.launcher torchrun --standalone --nproc-per-node "$NPROC" -m parallel.train "$@"
