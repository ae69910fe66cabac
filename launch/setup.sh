#!/usr/bin/env bash
# Create or update the repository's virtual environment, .venv, and install shardnorm (editable) with its
# test, train and framework extras at the versions in constraints.txt. Silent and quick when .venv is up to
# date (the launchers and tests/run.sh call it every time); otherwise it says what it installs and, at the
# end, how long that took (a new .venv without a GPU: 1 to 4 minutes, 2.7 GB).
#   Without a GPU (CI): a venv of its own, no site-packages of the machine; torch and triton go in first,
#     so that no dependency range pulls a CUDA build of torch (several GB) from the registry. The pin,
#     torch==2.13.0, takes the CPU build (2.13.0+cpu) wherever pip is offered one: here the machine's wheel
#     directory; elsewhere PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
#   With a GPU (nvidia-smi): the venv sees the machine's packages (--system-site-packages) and keeps the
#     preinstalled torch, triton and transformers as they are (launch/gpu_constraints.py); the pins apply to
#     what the machine lacks. Wheels in .whl/ are offered too (for a machine without a registry).
# BASE_PYTHON: the interpreter the venv is made from (python3). SHARDNORM_EXTRAS: the extras to install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
BASE_PYTHON=${BASE_PYTHON:-python3}
EXTRAS=${SHARDNORM_EXTRAS:-test,train,deepspeed,hf,torchtitan,lightning}
if command -v nvidia-smi >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi

# what .venv was last set up for: the mode, the extras, the pins and this script; nothing to do while they stand
STAMP="$VENV/.shardnorm-setup"
WANT="$MODE $EXTRAS $(cat "$ROOT/constraints.txt" "$ROOT/pyproject.toml" "$ROOT/launch/setup.sh" | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
# a venv made for the other mode sees (or hides) the machine's packages: make it again
if [[ -f "$STAMP" && "$(cut -d' ' -f1 "$STAMP")" != "$MODE" ]]; then
  rm -rf "$VENV"
fi
rm -f "$STAMP"
say() { echo "launch/setup.sh: $*" >&2; }
if [[ -x "$VENV/bin/python" ]]; then
  say "updating .venv (constraints.txt, pyproject.toml or launch/setup.sh changed since it was set up)"
elif [[ "$MODE" == cpu ]]; then
  say "creating .venv, on the first run only: 1 to 4 minutes, 2.7 GB"
else
  say "creating .venv on the machine's torch and Triton, on the first run only: a minute or more"
fi

if [[ "$MODE" == cpu ]]; then
  [[ -x "$VENV/bin/python" ]] || "$BASE_PYTHON" -m venv "$VENV"
  CONSTRAINTS="$ROOT/constraints.txt"
  PIP=("$VENV/bin/python" -m pip install -qq -c "$CONSTRAINTS")
  say "installing torch and Triton (CPU builds)"
  "${PIP[@]}" torch triton
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    # where the system's venv module lacks ensurepip, the machine's own pip serves the venv
    "$BASE_PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null \
      || "$BASE_PYTHON" -m venv --system-site-packages --without-pip --clear "$VENV"
  fi
  CONSTRAINTS="$VENV/constraints.txt"
  "$BASE_PYTHON" "$ROOT/launch/gpu_constraints.py" "$ROOT/constraints.txt" > "$CONSTRAINTS"
  PIP=("$VENV/bin/python" -m pip install -qq -c "$CONSTRAINTS")
  if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    PIP+=(--find-links "$ROOT/.whl")
  fi
  # where the machine's setuptools can build an editable wheel (64+, with `wheel` before 70.1), the build
  # needs no registry
  if "$VENV/bin/python" - 2>/dev/null <<'PY'
import importlib.util, sys
import setuptools
version = tuple(int(part) for part in setuptools.__version__.split(".")[:2])
sys.exit(0 if version >= (70, 1) or (version >= (64, 0) and importlib.util.find_spec("wheel")) else 1)
PY
  then
    PIP+=(--no-build-isolation)
  fi
fi
say "installing shardnorm (editable) with the extras $EXTRAS"
"${PIP[@]}" -e "$ROOT[$EXTRAS]"
echo "$WANT" > "$STAMP"
say ".venv is ready (${SECONDS} s)"
