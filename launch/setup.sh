#!/usr/bin/env bash
# Install shardnorm (editable) with its test, train, deepspeed and framework (hf, torchtitan, lightning) extras.
# Without a GPU, torch is pinned to the CPU build first, so that no dependency range pulls a CUDA
# build of torch (several GB) from the registry. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0" "triton==3.9.0"
fi
"$PY" -m pip install -q -e ".[test,train,deepspeed,hf,torchtitan,lightning]"
