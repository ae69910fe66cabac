"""Where the run executes: process group, device, peak memory, and a synchronizing clock.

NCCL on cuda:LOCAL_RANK when CUDA is available, gloo on CPU otherwise. Started without a launcher
(no RANK in the environment) it runs as a world of one.
"""

import contextlib
import gc
import os
import resource
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        """Wall-clock seconds after all queued device work has finished."""
        self.synchronize()
        return time.perf_counter()

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gib(self) -> float:
        """CUDA allocator peak since the last reset; on CPU the process's maximum RSS so far."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    @property
    def memory_kind(self) -> str:
        return "cuda max allocated" if self.device.type == "cuda" else "process max RSS"

    def mean_over_ranks(self, value: float, signum: int | None = None) -> tuple[float, int | None]:
        """The mean of `value` over the ranks, and the stop signal that some rank has noted (`signum`: this rank's
        or None; SIGTERM where ranks noted both): in the same all-reduce, so that every rank learns of a stop at the
        same step (parallel/stop.py, `StopSignals.deferred`)."""
        if self.world_size == 1:
            return value, signum
        t = torch.tensor([value, signum == signal.SIGINT, signum == signal.SIGTERM], dtype=torch.float64,
                         device=self.device)
        dist.all_reduce(t)  # SUM: gloo has no AVG
        total, interrupted, terminated = t.tolist()
        noted = signal.SIGTERM if terminated else signal.SIGINT if interrupted else None
        return total / self.world_size, noted

    def from_main(self, value):
        """Rank 0's `value` (any picklable object) on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(deepspeed: bool = False, timeout_s: float = 600.0) -> Runtime:
    """Join the process group torchrun (or the deepspeed launcher) describes in the environment.
    A collective that waits longer than `timeout_s` (a hung peer) raises instead of waiting forever."""
    if "RANK" not in os.environ:  # started directly: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if deepspeed:
        import deepspeed as ds

        # its own backend choice: nccl, or gloo/ccl for DS_ACCELERATOR=cpu
        ds.init_distributed(timeout=timedelta(seconds=timeout_s))
        release_deepspeed_shm(rank, world_size)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                timeout=timedelta(seconds=timeout_s))
    return Runtime(rank, world_size, device)


def deepspeed_shm_name(rank: int) -> str:
    """The shared-memory file of DeepSpeed's CPU all-reduce workspace for `rank` (`deepspeed/ops/csrc/cpu/comm/shm.cpp`:
    66 MB per rank, created when every rank is on this machine, LOCAL_SIZE == WORLD_SIZE)."""
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"


def release_deepspeed_shm(rank: int, world_size: int) -> None:
    """Unlink this rank's DeepSpeed shared-memory workspace once every rank has mapped every workspace.

    DeepSpeed never unlinks it: every CPU run would leave 66 MB per rank in /dev/shm, RAM held until a reboot, and
    a later run on the same port could map a stale one. The mappings keep the memory until the processes exit.
    Every rank decides the same way (the same environment on one machine), so all or none reach the barrier."""
    from deepspeed import comm

    backend = getattr(comm.comm, "cdb", None)
    if getattr(backend, "shm_comm_op", None) is None or os.environ.get("LOCAL_SIZE") != str(world_size):
        return
    dist.barrier()  # each rank's initialize returned: it has mapped all the workspaces
    with contextlib.suppress(FileNotFoundError):
        os.unlink(deepspeed_shm_name(rank))


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than parallel.timeout_s: a peer rank hangs (or is far too slow)."""


class CollectivePhase:
    """`with phase("step 3: the loss all-reduce"):` turns a collective's timeout inside into a
    CollectiveTimeout naming this rank, the phase and the setting; gloo's own message only says
    "Timed out waiting … for recv", NCCL's watchdog names the operation (e.g. OpType=ALLREDUCE)."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank

    @contextlib.contextmanager
    def __call__(self, what: str):
        try:
            yield
        except RuntimeError as e:
            text = str(e).lower()
            if isinstance(e, CollectiveTimeout) or not ("timed out" in text or "timeout" in text):
                raise
            raise CollectiveTimeout(f"rank {self.rank}: a collective in {what} waited longer than "
                                    f"parallel.timeout_s = {self.timeout_s:g} s (a hung or dead "
                                    f"peer rank?): {e}") from e


def shutdown(wait_for_peers: bool = True) -> None:
    """Leave the process group. After a clean run, first wait for every rank: a rank that tore down its
    gloo group while a peer was still finishing the last collective aborted ("terminate called without
    an active exception", ~1 run in 6 on a loaded 2-core machine; none in 52 with the barrier). The
    collection frees what cyclic garbage still holds groups (a DeepSpeed engine, FSDP modules) now,
    not during interpreter teardown."""
    gc.collect()
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
