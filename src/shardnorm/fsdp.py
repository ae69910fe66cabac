"""`shardnorm.fsdp` is `shardnorm.distributed.fsdp`: one module under its public name, not a copy.

Importing this file puts the real module in its place (`sys.modules`), so `import shardnorm.fsdp`,
`shardnorm.fsdp` (lazy, see `shardnorm/__init__.py`) and `shardnorm.distributed.fsdp` are one object.
"""

import sys

from shardnorm.distributed import fsdp as _fsdp

sys.modules[__name__] = _fsdp
