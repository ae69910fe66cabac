# quack-kernels 0.6.5 (CuTe-DSL kernels, CUDA 13 build) for benchmarks/bench_kernels.py on the GPU
# machine, from the wheels in .whl/ (gitignored). Benchmark-only: src/shardnorm never imports quack; it
# lives in /tmp/site, reached through PYTHONPATH. Source it (bash) from the repository root.
#
# One GPU call carries at most 64 MiB, so cu13.tar.xz (the unzipped nvidia_cutlass_dsl_libs_cu13 wheel,
# tar | xz) travels in two halves, over two calls on the same warm machine:
#   call 1, carry [".whl/quack_a"]:
#       source benchmarks/quack_env.sh stage_a
#   call 2, carry [".whl/quack_b", ".whl/liger_kernel-0.8.5-py3-none-any.whl"]:
#       source benchmarks/quack_env.sh install && python3 benchmarks/bench_kernels.py ...
# Later calls on that machine: `install` again (carrying nothing) only sets PYTHONPATH.
#
# The wheels are unzipped, not pip-installed: libs_base and libs_core both fill nvidia_cutlass_dsl/
# (pip --target keeps only the first), and the .pth that puts nvidia_cutlass_dsl/dsl_packages (the
# `cutlass` package) on sys.path runs only in a real site dir, so PYTHONPATH names that folder too.
# Python's zipfile/tarfile do the unpacking: unzip and xz need not be on the machine. QUACK_SITE and
# QUACK_PARTS override /tmp/site and /tmp/quack_parts (for a dry run elsewhere).

_quack_env() {
    local root parts=${QUACK_PARTS:-/tmp/quack_parts} site=${QUACK_SITE:-/tmp/site} py=${PYTHON:-python3}
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    case ${1:-} in
    stage_a)
        mkdir -p "$parts" && cp "$root"/.whl/quack_a/* "$parts/" && ls -l "$parts" && return
        echo "quack_env: stage_a needs .whl/quack_a: carry it in this call" >&2
        return 1 ;;
    install) ;;
    *)
        echo "usage: source benchmarks/quack_env.sh stage_a|install" >&2
        return 2 ;;
    esac
    if [ ! -e "$site/.quack_env_done" ]; then
        local aa=$parts/cu13.tar.xz.part_aa ab=$root/.whl/quack_b/cu13.tar.xz.part_ab w wheels=()
        [ -f "$aa" ] || aa=$root/.whl/quack_a/cu13.tar.xz.part_aa  # both halves carried to one call
        if [ ! -f "$aa" ]; then
            echo "quack_env: $parts/cu13.tar.xz.part_aa is missing: run 'stage_a' (carry .whl/quack_a)" \
                 "on this same warm machine first; a fresh machine lost it" >&2
            return 1
        fi
        if [ ! -f "$ab" ]; then
            echo "quack_env: $ab is missing: carry .whl/quack_b in this call" >&2
            return 1
        fi
        mkdir -p "$parts" "$site" && cat "$aa" "$ab" >"$parts/cu13.tar.xz" || return 1
        if [ "$(sha256sum <"$parts/cu13.tar.xz" | cut -d' ' -f1)" != \
             "$(cut -d' ' -f1 "$root/.whl/quack_b/cu13.tar.xz.sha256")" ]; then
            echo "quack_env: cu13.tar.xz checksum mismatch: the halves are not from the same download" >&2
            return 1
        fi
        for w in "$root"/.whl/quack_b/*.whl "$root"/.whl/liger_kernel-*.whl; do
            [ -f "$w" ] && wheels+=("$w")
        done
        "$py" - "$site" "$parts/cu13.tar.xz" "${wheels[@]}" <<'EOF' || return 1
import sys, tarfile, zipfile
site, tar, *wheels = sys.argv[1:]
with tarfile.open(tar) as t:
    t.extractall(site, filter="tar")
for wheel in wheels:  # into one tree: libs_base and libs_core fill one nvidia_cutlass_dsl/ (no file in both)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    print("unpacked", wheel.rsplit("/", 1)[-1])
EOF
        touch "$site/.quack_env_done"
    fi
    export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:$root/src:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "
import importlib.metadata as md, torch, quack, cutlass
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'
print('quack', quack.__version__, '| nvidia-cutlass-dsl', md.version('nvidia-cutlass-dsl'), '| torch',
      torch.__version__, 'CUDA', torch.version.cuda, '|', gpu)
" || { echo "quack_env: import quack/cutlass failed (above); PYTHONPATH is set anyway" >&2; return 1; }
}

(return 0 2>/dev/null) || echo "quack_env: source this file; run as a script it cannot set PYTHONPATH" >&2
_quack_env "$@"
