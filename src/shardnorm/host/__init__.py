"""The C++ host path: eager norm calls on CUDA replayed from C++ (`replay.cpp`), recorded by `record.py`.

At small shapes a norm's GPU work takes a few microseconds and the Python around it (the autograd Function,
plan lookups, Triton's launcher) several times that, on every forward and, on the autograd thread, every
backward. Here the first call of each signature (device, M, N, dtypes, alignments, strides, eps, flags) runs
the Python path once and records its allocations and launches; later calls allocate and launch from C++
under a C++ autograd node, with no Python between the module's forward and the kernels. Results are bitwise
the Python path's (the same compiled kernels with the same arguments).

Taken by eager calls (not under torch.compile, not in functorch transforms) on plain CUDA tensors with the
Triton backend, once the extension is built. `SHARDNORM_HOST_PATH`:
- `auto` (default): the first CUDA call starts building it in a background thread; calls take the Python
  path until it is ready.
- `1`: the first CUDA call builds it, in that call (errors raise).
- `0`: never.
The build (torch.utils.cpp_extension: a C++ compiler and ninja, ~35 s once per machine, cached in
TORCH_EXTENSIONS_DIR) needs no CUDA toolkit. Where it cannot be built, a warning says why and the Python path
stays. Replayed launches bypass Triton's launch hooks (profilers that install them see only recorded calls).
A recording holds the plan a call got; after changing what plans read (SHARDNORM_LONG_FWD / _BWD, the knobs in
kernels/config.py), `clear()` makes the next calls record again.
"""

import logging
import os
import threading
from typing import Optional

# Once on, the extension's entry points (None while off):
# norm(x, weight, bias, residual, eps, rms, zero_centered) -> (y, z or None), for ops.norm's checked [M, N] rows;
# module_norm(x, residual, normalized_shape, weight, bias, eps, rms, zero_centered) -> (y, z or None), or None
# where the call needs the Python path (functional._norm's checks and errors, DTensors, other layouts).
norm = module_norm = None

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state = "idle"  # idle -> building -> on | failed; or off
_module = None
_failed_tries: dict = {}  # key -> recordings that were not replayable; 2 make the key Python's for good
refused: dict = {}  # key -> why its recording was not replayable (the last reason)
_REMEMBERED = 1024  # refusal reasons kept at most (keys seen once, e.g. a new M per call, must not pile up)
MODES = {"auto": "auto", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off", "false": "off"}


def start() -> None:
    """What `ops.norm` calls at a CUDA call while the path is not on: begin as SHARDNORM_HOST_PATH says, once."""
    global _state
    if _state != "idle":
        return
    with _lock:
        if _state != "idle":
            return
        mode = os.environ.get("SHARDNORM_HOST_PATH", "auto").lower()
        if mode not in MODES:
            raise ValueError(f"SHARDNORM_HOST_PATH must be one of {', '.join(MODES)}, got {mode!r}")
        if MODES[mode] == "off":
            _state = "off"
            return
        _state = "building"
    if MODES[mode] == "on":
        try:
            _enable(load())
        except Exception:
            _state = "failed"
            raise
    else:
        threading.Thread(target=_build_in_background, name="shardnorm-host-build", daemon=True).start()


def _build_in_background() -> None:
    global _state
    try:
        module = load()
    except Exception as error:  # the Python path stays; say why once
        _log.warning("shardnorm: the C++ host path is off (%s); eager calls take the Python path", error)
        _state = "failed"
        return
    with _lock:
        if _state == "building":  # not if enable(False) came in the meantime
            _enable(module)


def _enable(module) -> None:
    global norm, module_norm, _state
    norm, module_norm = module.norm, module.module_norm
    _state = "on"


def unsupported() -> Optional[str]:
    """Why the host path cannot run here, or None."""
    import torch
    import triton

    from ..kernels import launch

    if torch.version.hip is not None:
        return "ROCm: the replay launches through the CUDA driver"
    if launch.replay_scratch_pointers() is None:
        return f"Triton {triton.__version__}: the replay packs kernel arguments as Triton 3.6's launcher does"
    return None


def load():
    """The extension, built the first time on this machine and wired to the Python paths; raises why not."""
    global _module
    with _lock:
        if _module is None:
            reason = unsupported()
            if reason is not None:
                raise RuntimeError(reason)
            module = build()
            from ..ops import _ready  # a grad that is a collective's pending result, waited on

            module.set_callbacks(_record_forward, _record_backward, _ready)
            _module = module
    return _module


def build():
    """The extension module, compiled on first use on this machine (torch.utils.cpp_extension caches it)."""
    from torch.utils import cpp_extension

    _log.info("shardnorm: building the C++ host path (once per machine)")
    source = os.path.join(os.path.dirname(__file__), "replay.cpp")
    return cpp_extension.load(name="shardnorm_host", sources=[source], extra_cflags=["-O2"], extra_ldflags=["-ldl"])


def enable(on: bool = True) -> None:
    """Turn the host path on now (building it if needed; errors raise) or off."""
    global norm, module_norm, _state
    if on:
        _enable(load())
    else:
        norm = module_norm = None
        _state = "off"


def clear() -> None:
    """Forget every recorded signature (e.g. after changing a kernel config the plans read)."""
    if _module is not None:
        _module.clear()
    _failed_tries.clear()
    refused.clear()


def _record_forward(key, x, weight, bias, residual, eps, rms, zero_centered):
    from ..kernels import norm_fwd

    def run():
        return norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)

    return run() if key is None else _recorded(key, (x, weight, bias, residual), run)


def _record_backward(key, dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered):
    from ..ops import _norm_bwd_any

    def run():  # grads that stay tensor subclasses are never keyed
        return _norm_bwd_any(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)

    return run() if key is None else _recorded(key, (dy, dz, src, weight, mean, rstd), run)


def _recorded(key: list, inputs: tuple, run):
    from . import record

    outputs, spec = record.record(inputs, run)
    if not isinstance(spec, str):
        _module.add_spec(key, True, *spec)
        return outputs
    if len(refused) >= _REMEMBERED:
        refused.clear()
        _failed_tries.clear()
    refused[tuple(key)] = spec
    # torch ops: a first call's compile may run ops of its own, so twice; any other reason is final
    tries = _failed_tries[tuple(key)] = _failed_tries.get(tuple(key), 0) + 1
    if tries >= 2 or not spec.startswith(record.TORCH_OPS):
        _module.add_spec(key, False, [], [], [])
    return outputs


def stats() -> dict:
    """Calls replayed and calls the Python path ran (forward, backward) since the extension loaded."""
    return _module.stats() if _module is not None else {}


def status() -> dict:
    """Where the host path stands (idle: no CUDA call yet; building, on, failed or off) with `stats()` and the
    number of refused signatures: what a training job logs to show its norm calls replayed."""
    return {"state": _state, **stats(), "refused_signatures": len(refused)}
