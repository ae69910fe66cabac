"""Every `SHARDNORM_*` environment variable, read once and validated in one place (docs/settings.md).

`SHARDNORM_BACKEND` (`triton` or `torch`; unset: by the tensor's device) and `SHARDNORM_PORTABLE_KERNELS`
(`1`: long rows take the portable kernels on every GPU). A bad value raises a `ValueError` naming the
variable at the first call that reads it; code that changes the environment afterwards (tests) calls `reload()`.
"""

import dataclasses
import os
from typing import Optional

_BOOL = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: Optional[str] = None  # None: by the tensor's device
    portable_kernels: bool = False


def _choice(name: str, allowed: tuple, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    value = value.strip().lower()
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {os.environ[name]!r}")
    return value


def _flag(name: str, default: bool) -> bool:
    value = _choice(name, tuple(_BOOL), None)
    return default if value is None else _BOOL[value]


def _read() -> Settings:
    return Settings(backend=_choice("SHARDNORM_BACKEND", ("triton", "torch"), None),
                    portable_kernels=_flag("SHARDNORM_PORTABLE_KERNELS", False))


_current: Optional[Settings] = None


def get() -> Settings:
    """The settings in force (the environment as first read)."""
    global _current
    if _current is None:
        _current = _read()
    return _current


def reload() -> Settings:
    """Read the environment again (after changing a `SHARDNORM_*` variable in this process)."""
    global _current
    _current = None
    return get()


def runs_triton(t) -> bool:
    """Whether work on tensor `t` runs the Triton kernels (`SHARDNORM_BACKEND`, else by device: CUDA tensors) rather
    than torch ops: the norm (`ops`) and the keep_output checks' checksum (`output_checks`) follow this one rule.
    Meta tensors (shape propagation, deferred init) have no data for the kernels: torch ops give their outputs."""
    return (get().backend or ("triton" if t.is_cuda else "torch")) == "triton" and not t.is_meta
