"""Run a test body in N processes with torch.multiprocessing: gloo on CPU, or NCCL on GPUs.

Tests call `spawn(body, world_size, *args)`; `body(rank, world_size, *args)` runs in each process
after `init_process_group`. A failure in any rank fails the test with that rank's traceback.
`SHARDNORM_TEST_DEVICE=cuda` runs the same tests with NCCL, one GPU per rank (the rank's current
device); `DEVICE` is what tests pass to `init_device_mesh`, which puts DTensors there.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICE = os.environ.get("SHARDNORM_TEST_DEVICE") or "cpu"


def rank_device(rank: int) -> torch.device:
    """The device a spawned rank runs on: its own GPU under SHARDNORM_TEST_DEVICE=cuda, else the CPU."""
    return torch.device("cuda", rank) if DEVICE == "cuda" else torch.device("cpu")


def _entry(rank, world_size, port, body, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    if DEVICE == "cuda":
        device = rank_device(rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()  # no rank tears down its group while a peer is still in a collective
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without interpreter teardown: under load, destroying gloo's or
    # autograd's threads there aborted a passed rank now and then ("terminate called without an
    # active exception", seen in CI). A failing rank never gets here: its exception fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(body, world_size: int, *args) -> None:
    """Run `body(rank, world_size, *args)` on `world_size` ranks; raise if any rank fails."""
    if DEVICE == "cuda" and world_size > torch.cuda.device_count():
        pytest.skip(f"{world_size} ranks need {world_size} GPUs, {torch.cuda.device_count()} visible")
    # the rendezvous store is the caller's, on a port the OS picked and kept bound: a port found free and bound
    # later by a rank could be taken in between by a test running beside this one
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    mp.spawn(_entry, args=(world_size, store.port, body, args), nprocs=world_size, join=True)
    del store
