"""`shardnorm.fsdp`: the FSDP helpers (see shardnorm/distributed/fsdp.py)."""

from shardnorm.distributed.fsdp import *  # noqa: F401,F403
from shardnorm.distributed.fsdp import __all__  # noqa: F401
