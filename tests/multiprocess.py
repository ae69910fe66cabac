"""Run a test body in N gloo processes (CPU) with torch.multiprocessing.

Tests call `spawn(body, world_size, *args)`; `body(rank, world_size, *args)` runs in each process
after `init_process_group("gloo")`. A failure in any rank fails the test with that rank's traceback.
"""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, body, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(body, world_size: int, *args) -> None:
    """Run `body(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails."""
    mp.spawn(_entry, args=(world_size, _free_port(), body, args), nprocs=world_size, join=True)
