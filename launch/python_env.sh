# Sourced by the launchers: sets PY, the interpreter the job runs under, and puts the checkout's src/ and root
# on PYTHONPATH (the main job's `parallel` package runs from the checkout; it is not installed).
# PYTHON=/path/to/python runs under an environment of your own, as it is; otherwise launch/setup.sh creates
# or updates the repository's .venv first.
LAUNCH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
else
  bash "$LAUNCH_ROOT/launch/setup.sh"
  PY="$LAUNCH_ROOT/.venv/bin/python"
fi
export PYTHONPATH="$LAUNCH_ROOT/src:$LAUNCH_ROOT${PYTHONPATH:+:$PYTHONPATH}"
