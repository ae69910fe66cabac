"""One run at a time in a train.out_dir or checkpoint.dir.

Two runs at once in one out_dir interleave their lines in metrics.jsonl and overwrite each other's summary; in one
checkpoint.dir each deletes the checkpoint the other is writing (`.tmp-step-*`, which a save takes for a killed
job's). Rank 0 holds an exclusive lock on a file in each directory for as long as its process lives: the kernel
releases it when the process ends, however it ends (a SIGKILL included), so no stale lock is left to clear.
"""

import fcntl
import os
import socket
from pathlib import Path

from parallel.config import Config, ConfigError

LOCK = ".run.lock"


def _lock(key: str, directory: Path):
    """The open lock file of `directory`, locked (None where its filesystem has no locks); ConfigError naming `key`
    if another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "its process is unknown"
        lock.close()
        raise ConfigError(f"{key}: {directory} is in use by another run ({holder}): wait for it to end, or set "
                          f"{key} to another directory") from None
    except OSError:  # a filesystem without locks (some network mounts): the run goes on unguarded, as without one
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    return lock


# directory -> its open lock file, for this process's life: closing the file (or its collection) releases the lock
_HELD: dict[Path, object] = {}


def hold_run_dirs(cfg: Config, is_main: bool, from_main) -> None:
    """Rank 0 locks train.out_dir and checkpoint.dir (once, if they are the same directory) until its process ends.
    Every rank raises the ConfigError of a directory in use (`from_main`: rank 0's value on every rank), so that all
    end at once: a rank left waiting for rank 0 in a collective would only end when the launcher kills it."""
    error = None
    if is_main:
        dirs = {"train.out_dir": cfg.out_dir}
        if cfg.checkpoint.dir:
            dirs["checkpoint.dir"] = Path(cfg.checkpoint.dir)
        try:
            for key, directory in dirs.items():
                if directory.resolve() not in _HELD:
                    _HELD[directory.resolve()] = _lock(key, directory)
        except ConfigError as e:
            error = str(e)
    error = from_main(error)
    if error:
        raise ConfigError(error)
