# Sourced by the benchmarks/gpu_session*.sh scripts (the commands of a GPU session's device calls): checks and
# creates $OUT, works from the repository root ($ROOT) with src/, tests/ and the root on PYTHONPATH, and defines
#   box NAME SECONDS CMD...  CMD's output into $OUT/NAME.txt with its exit status, under a timeout, its last
#                            lines echoed after a clock since the script started
#   gpu_versions             the GPU, driver, torch and Triton
#   gpu_done NAME            the time taken; with PACK=1, $OUT packed into $OUT/NAME.tgz
set -u
OUT=${OUT:?set OUT}; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[1]}")/.." && pwd)"; cd "$ROOT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
export PYTHONPATH="$ROOT/src:$ROOT/tests:$ROOT"  # scripts that install peers into /tmp/site add it
t0=$SECONDS
box() { local name=$1 secs=$2; shift 2; echo "== [$((SECONDS - t0)) s] $name"
        timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"; tail -8 "$OUT/$name.txt"; }
gpu_versions() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}
gpu_done() {  # the script's time, then (PACK=1) $OUT packed into one archive: at most 8 files come back from a call
  echo "== [$((SECONDS - t0)) s] done"
  [ -n "${PACK:-}" ] || return 0
  tar -C "$OUT" -czf "/tmp/$1.tgz" . && rm -rf "${OUT:?}"/* && mv "/tmp/$1.tgz" "$OUT/"
}
