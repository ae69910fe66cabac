"""Checkpoint directories on disk: names, the completeness marker, finding the latest complete one.

No torch here (the config check uses it before any process starts). Layout of `checkpoint.dir`:

    step-00000040/            a complete checkpoint: renamed from its temporary name once written
        complete.json         written last: step, layout, and every file's size
        metrics.jsonl         rank 0's records of the steps up to this one (the run's own, whatever train.out_dir holds)
        ...                   the engine's files (DCP shards, or DeepSpeed's), train_state.pt, rng/
    .tmp-step-00000050/       being written (or torn: the job stopped while writing it)

A directory counts only if `complete.json` exists and every file it lists has the listed size;
anything else is torn and skipped with a warning naming it.
"""

import json
import os
import re
from pathlib import Path

MARKER = "complete.json"
RECORDS = "metrics.jsonl"
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its path."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def temp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}"


def list_files(path: Path) -> dict[str, int]:
    """Relative path -> size of every file under `path`, the marker excepted."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != MARKER}


def write_marker(path: Path, info: dict) -> None:
    """The last write of a checkpoint: after it (and the rename) the checkpoint counts."""
    marker = path / MARKER
    with open(marker, "w") as f:
        json.dump({**info, "files": list_files(path)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_marker(path: str | Path) -> dict:
    """The marker of a complete checkpoint; CheckpointError saying what is wrong otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    try:
        info = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MARKER}: it was not written completely") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/{MARKER} is unreadable: {e}") from None
    for name, size in info.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path} is torn: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path} is torn: {name} has {f.stat().st_size} bytes, "
                                  f"{size} were written")
    if not isinstance(info.get("step"), int):
        raise CheckpointError(f"{path}/{MARKER} names no step")
    return info


def write_records(path: Path, records: list[dict]) -> None:
    """The metrics records of the steps a checkpoint holds, so a resumed run reports on its own steps."""
    with open(path / RECORDS, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict] | None:
    """The records `write_records` left in the checkpoint `path`; None for a checkpoint without them."""
    try:
        text = (path / RECORDS).read_text()
    except FileNotFoundError:
        return None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def candidates(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the step-<N> dirs in `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def latest(root: str | Path, warn=print) -> tuple[Path, dict] | None:
    """The newest complete checkpoint in `root` and its marker; torn ones are skipped, with `warn`."""
    root = Path(root)
    if root.is_dir():
        for partial in sorted(root.glob(".tmp-step-*")):
            warn(f"skipping partial checkpoint {partial} (the job stopped while writing it)")
    for _, path in candidates(root):
        try:
            return path, read_marker(path)
        except CheckpointError as e:
            warn(f"skipping torn checkpoint: {e}")
    return None


def resolve(path: str | Path, warn=print) -> tuple[Path, dict]:
    """An explicitly named checkpoint: a step-<N> dir, or a dir of them (its latest complete one).
    Anything unreadable is a CheckpointError: the user asked for this one."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / MARKER).exists() or STEP_DIR.match(path.name) or not candidates(path):
        return path, read_marker(path)
    found = latest(path, warn)
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint")
    return found
