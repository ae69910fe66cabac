#!/usr/bin/env bash
# The test command: install, then run the whole suite (Triton kernels interpreted on CPU where
# there is no GPU; multi-process tests on gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
