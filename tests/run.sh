#!/usr/bin/env bash
# The test command: set up the repository's .venv (launch/setup.sh: created if absent, reused if present),
# then run the whole suite with its interpreter (Triton kernels interpreted on CPU where there is no GPU;
# multi-process tests on gloo). Extra arguments go to pytest. PYTHON=/path/to/python runs the suite under
# an environment of your own instead, installing nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  bash launch/setup.sh
  PYTHON="$PWD/.venv/bin/python"
fi
# the launchers the tests start (launch/train.sh, launch/deepspeed.sh) run under the same interpreter
export PYTHON
if (( $# == 0 )); then
  echo "tests/run.sh: the whole suite, about 24 min of pytest on 2 CPU cores (a new .venv adds 1 to 4 min)" >&2
fi
# Two pytest-xdist workers, a test file each at a time (module-scoped fixtures built once): most tests are one
# single-threaded process (interpreted Triton kernels, Dynamo traces), so two of them use both of CI's cores; 20-22 min
# of pytest where one process takes 29. `-n 0` among the arguments runs one process; an environment of your own
# (PYTHON=...) without pytest-xdist runs one process too. Progress is pytest's dots and %.
# pytest's own exit status, 5 (no tests collected) included, is the command's
WORKERS=()
if "$PYTHON" -c "import xdist" 2> /dev/null; then
  WORKERS=(-n 2 --dist loadfile)
fi
exec "$PYTHON" -m pytest ${WORKERS[@]+"${WORKERS[@]}"} "$@"
