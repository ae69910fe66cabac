"""DeepSpeed integration: a "shardnorm" config section, norm conversion, ZeRO/Ulysses/AutoTP support.

Importing this works without DeepSpeed installed; `initialize` says so when it is called.
See README.md in this folder for the config keys.
"""

from .config import ShardnormConfigError, ShardnormSection, parse_section, read_section
from .integration import apply, initialize

__all__ = ["ShardnormConfigError", "ShardnormSection", "apply", "initialize", "parse_section", "read_section"]
