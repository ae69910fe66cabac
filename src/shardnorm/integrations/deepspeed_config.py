"""The "shardnorm" section of a DeepSpeed config. DeepSpeed ignores unknown top-level sections, so nobody
else checks this one: every key is checked here, and every error names its key (``shardnorm.<key>``)."""

import difflib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from shardnorm.distributed import DEFAULT_BUCKET_CAP_MB

SECTION = "shardnorm"
GRAD_REDUCE_CHOICES = ("step", "deepspeed")


class ShardnormConfigError(ValueError):
    """A bad value in the "shardnorm" section; the message starts with the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class ShardnormSection:
    """Validated "shardnorm" section; what each key means: docs/integrations/deepspeed.md.

    replace: None converts every class `shardnorm.convert` knows. grad_reduce: who all-reduces the grads of
    the norm weights AutoTP marks ("step": shardnorm, in fp32 buckets once per step; "deepspeed": its hooks).
    """

    enabled: bool = True
    replace: Optional[Tuple[str, ...]] = None
    zero_centered_gamma: bool = False
    grad_reduce: str = "step"
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    keep_output: bool = True


def _key(name: str) -> str:
    return f"{SECTION}.{name}"


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ShardnormConfigError(_key(name), f"expected true or false, got {value!r}")
    return value


def _replace(value: Any) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise ShardnormConfigError(_key("replace"), f"expected a non-empty list of class names, got {value!r}")
    for i, name in enumerate(value):
        if not isinstance(name, str) or not name.removeprefix("*").isidentifier():
            raise ShardnormConfigError(f"{_key('replace')}[{i}]",
                                       f'expected a class name or "*" + a name suffix, got {name!r}')
    if len(set(value)) != len(value):
        raise ShardnormConfigError(_key("replace"), f"lists a class name twice: {list(value)!r}")
    from ..conversion import near_class, unknown_classes

    for name in unknown_classes(value):
        near = near_class(name)
        raise ShardnormConfigError(f"{_key('replace')}[{list(value).index(name)}]",
                                   f"{name!r} names no norm class shardnorm.convert knows"
                                   + (f" (did you mean {near!r}?)" if near else "")
                                   + "; known: LayerNorm, RMSNorm and the classes of shardnorm.norm_families")
    return tuple(value)


def _grad_reduce(value: Any) -> str:
    if value not in GRAD_REDUCE_CHOICES:
        raise ShardnormConfigError(_key("grad_reduce"), f"expected one of {list(GRAD_REDUCE_CHOICES)}, got {value!r}")
    return value


def _bucket_cap_mb(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ShardnormConfigError(_key("bucket_cap_mb"), f"expected a finite number > 0, got {value!r}")
    return float(value)


_PARSERS = {
    "enabled": lambda v: _bool("enabled", v),
    "replace": _replace,
    "zero_centered_gamma": lambda v: _bool("zero_centered_gamma", v),
    "grad_reduce": _grad_reduce,
    "bucket_cap_mb": _bucket_cap_mb,
    "keep_output": lambda v: _bool("keep_output", v),
}


def parse_section(section: Any) -> ShardnormSection:
    """Validate a "shardnorm" section (a mapping) into a ShardnormSection."""
    if not isinstance(section, Mapping):
        raise ShardnormConfigError(SECTION, f"expected an object of settings, got {section!r}")
    for name in section:
        if name not in _PARSERS:
            raise ShardnormConfigError(_key(str(name)), f"unknown key; known keys: {sorted(_PARSERS)}")
    return ShardnormSection(**{name: _PARSERS[name](value) for name, value in section.items()})


def load_config(config: Any) -> dict:
    """A DeepSpeed config as a dict: given as a dict, or as a path to a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            return json.load(f)
    raise ShardnormConfigError("config", f"expected a dict or the path of a JSON file, got {config!r}")


def near_miss_sections(config: Mapping) -> list:
    """Top-level keys that look like a misspelled "shardnorm" section ("shard_norm", "ShardNorm", "shardnrom")."""
    def canonical(key):
        return str(key).lower().replace("_", "").replace("-", "")

    return [key for key in config if key != SECTION and (
        canonical(key).startswith(SECTION) or difflib.SequenceMatcher(None, canonical(key), SECTION).ratio() >= 0.8)]


def warn_near_miss_sections(config: Mapping) -> None:
    if SECTION not in config and (near := near_miss_sections(config)):
        warnings.warn(f'the DeepSpeed config has no "{SECTION}" section but has {near[0]!r}: shardnorm reads only '
                      f'"{SECTION}" (DeepSpeed ignores unknown sections), so {near[0]!r} is not applied', stacklevel=3)


def read_section(config: Any) -> Optional[ShardnormSection]:
    """The validated section of a DeepSpeed config; None when it is absent or disabled. Warns when the
    section is absent but a key looks like a misspelling of it."""
    config = load_config(config)
    section = config.get(SECTION)
    if section is None:
        warn_near_miss_sections(config)
        return None
    parsed = parse_section(section)
    return parsed if parsed.enabled else None
