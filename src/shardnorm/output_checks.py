"""The checks of `keep_output=False` against writes autograd cannot see: exact checksums of a norm output's bits,
and comparisons a GPU backward makes at its end and reads without waiting for the GPU.

A consumer of a norm output saves a handle instead of the output; what it read in its forward is kept as a
checksum (`fingerprint`), compared with the recompute's in the backward (`check_equal`). A difference is a write
behind autograd (through `.data` or a detached alias) to the output before the consumer read it, or to the input the
output is recomputed from: the backward raises `KeepOutputError` instead of giving grads of values the forward never
used. On the host a check is immediate; on a GPU one backward's comparisons are made together at its end and their
flags reach the host in one asynchronous copy, read when it has landed.
"""

import atexit
import sys
import threading
import weakref
from functools import cache, partial

import torch
from torch import Tensor

from . import _torch_compat, reference, settings


class KeepOutputError(RuntimeError):
    """A norm with keep_output=False could not recompute its output faithfully."""


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> its bits as an int


def fingerprint(t: Tensor) -> Tensor:
    """A checksum of the bits of this rank's part of `t` (a device vector, no sync): the recompute is bitwise the
    output, so a different checksum means the output the consumer saw was written after the norm made it.

    Sums of the hashed bit patterns, one per block of rows (`kernels/fingerprint.py`), not float sums of the
    values: exact (any one changed element changes its block's sum, where an fp32 sum rounds a small change away),
    equal for equal bits (NaN and Inf included: a NaN output compares equal to itself), and changed by writes that
    a plain integer sum keeps (elements moved through `.data`, every element scaled by 2). On a GPU one kernel reads
    the tensor once in place, as fast as a plain int32 sum of the words or faster (26.8 vs 30.3 us over a 64 MiB
    bf16 output on an H200, 43.4 vs 106.7 over a transposed view; 2-15 us more host time a call:
    `fingerprint_bench.json`); on the CPU (and the torch backend) torch ops compute the same sums."""
    local = (_torch_compat.dtensor_local(t) if _torch_compat.is_dtensor(t) else t).detach()
    words = _words_4d(_words(local))
    rows_per_block, block_n = _blocks(words.shape[-1])
    if not settings.runs_triton(local) or words.element_size() not in (2, 4):
        return reference.fingerprint(words, rows_per_block)
    return _kernels().fingerprint(words, rows_per_block, block_n)


# Words a block's program reads at a time (rows per block x block_n), and the widest block_n: 8 x 512 read a 64 MiB
# bf16 output at 2.50 TB/s on an H200, 4 x 1024 at 2.25, 16 x 256 at 2.18, and a transposed view of it at 1.53 /
# 1.03 / 1.58 TB/s (`fingerprint_bench_sweep.json`, benchmarks/results/h200-torch2.11-triton3.6/keep_output_checks/)
_TILE, _BLOCK_N = 4096, 512


def _blocks(n: int) -> tuple[int, int]:
    """(rows per block, block_n) for rows of `n` words: block_n the row's next power of two, capped."""
    block_n = min(1 << max(n - 1, 0).bit_length(), _BLOCK_N)
    return _TILE // block_n, block_n


@cache
def _kernels():
    from .kernels import fingerprint

    return fingerprint


def _words(t: Tensor) -> Tensor:
    """`t`'s elements as integers: 2-byte and 1-byte ones as 32-bit words of consecutive elements of a row where the
    layout allows (half as many words to load and hash), 8-byte ones as two 32-bit words, else each as an integer of
    its size, read in place (a copy would add the view's size to the peak).
    Words never span rows, so a tensor and a copy of it whose rows are contiguous read the same words; the
    comparisons are of a view with the same view of the recompute, and of gathered outputs with contiguous rows."""
    size = t.element_size()
    if size < 4 and t.dim() and t.shape[-1] * size % 4 == 0 and _rows_of_words(t, 4 // size):
        return t.view(torch.int32)
    if size == 8:  # fp64: two 32-bit words where the row allows, else a copy (no norm output is fp64)
        return t.view(torch.int32) if t.dim() and t.stride()[-1] == 1 else t.contiguous().view(torch.int32)
    return t.view(_BITS[size])


def _rows_of_words(t: Tensor, per_word: int) -> bool:
    """Whether `t.view(torch.int32)` takes `per_word` consecutive elements of a row as a word: rows contiguous, every
    other stride and the offset multiples of it (asked, not tried: a refused view raises, ~40 us of host time)."""
    strides = t.stride()
    return strides[-1] == 1 and t.storage_offset() % per_word == 0 and all(s % per_word == 0 for s in strides[:-1])


def _words_4d(words: Tensor) -> Tensor:
    """`words` as [d0, d1, d2, n] (rows over the first three dims) in place: size-1 dims in front, or the leading
    dims of a 5-D or larger view merged where its strides allow (else a copy)."""
    if words.dim() <= 4:
        return words.view((1,) * (4 - words.dim()) + tuple(words.shape))
    try:
        return words.view(-1, *words.shape[-3:])
    except RuntimeError:
        return words.reshape(-1, *words.shape[-3:])


def _bits(t: Tensor) -> Tensor:
    """`t` as the integers of its bits, for comparisons that hold NaN equal to the same NaN."""
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


class _Pending(list):
    """One backward's comparisons, [(a, b, error)], held by the callback queued at its end: a backward that raises
    midway never runs its callbacks, and its comparisons go with its graph task."""

    __slots__ = ("__weakref__",)


_pending_checks: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # graph task id -> _Pending
_unread: list = []  # [(event, host flags, errors)]: ended backwards' flags, on their way to the host
_pending_lock = threading.Lock()  # a backward's nodes run on device threads; its end callback on another


def check_equal(a: Tensor, b: Tensor, error) -> None:
    """Raise `error()` if `a` and `b` (same shape and dtype) differ anywhere: at once on the host; on a CUDA device
    without waiting. A backward's comparisons are made at its end, those of one shape together (one kernel for all
    its fingerprints of one size), and their flags copied to the host in one asynchronous copy, read as soon as it
    has landed: at the end of that backward if the GPU is done with it, else at the next
    forward of a keep_output=False norm or, at the latest, at the end of the next backward, which waits for it.
    Reading them at the end of their own backward would drain the GPU's queue once per micro-batch: the next
    forward's launches could no longer run ahead of the GPU. Flags still unread when the process exits are read
    then and a set one reported on stderr (the last backward of a run)."""
    task = _torch_compat.current_graph_task_id()
    if a.device.type == "cpu" or task == -1:
        if torch.ne(_bits(a), _bits(b)).any().item():
            raise error()
        return
    with _pending_lock:
        pending = _pending_checks.get(task)
        if pending is None:
            pending = _pending_checks[task] = _Pending()
            _torch_compat.queue_backward_callback(partial(_check_pending, pending))
        pending.append((a, b, error))


def _compare(pending: list) -> tuple[Tensor, list]:
    """(one flag per comparison of `pending`, set where it differs; their errors in the flags' order): the
    comparisons of one shape and dtype stacked, one kernel each."""
    groups: dict = {}
    for a, b, error in pending:
        groups.setdefault((a.shape, a.dtype), []).append((a, b, error))
    flags, errors = [], []
    for same in groups.values():
        differ = torch.ne(_bits(torch.stack([a for a, _, _ in same])), _bits(torch.stack([b for _, b, _ in same])))
        flags.append(differ.flatten(1).any(1) if differ.dim() > 1 else differ)
        errors += [error for _, _, error in same]
    return (flags[0] if len(flags) == 1 else torch.cat(flags)), errors


def _check_pending(pending: list) -> None:
    """At the end of a backward: make its comparisons (`pending`), start their flags' copy to the host, and raise for
    what earlier copies brought."""
    with _pending_lock:
        comparisons = pending[:]
        pending.clear()  # their tensors go now, not with the graph task
    earlier = _take_unread()
    for event, _, _ in earlier:
        event.synchronize()
    if comparisons:
        flags, errors = _compare(comparisons)
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))
            earlier.append((event, host, errors))
            _read_at_exit()
        else:  # another device: one blocking read
            _raise_set(flags.tolist(), errors)
    _raise_arrived(earlier)


@cache
def _read_at_exit() -> None:
    """Read the flags still on their way when the process exits (the last backward's, with no backward or
    keep_output=False forward after it), reporting a set one on stderr; registered with the first such copy."""
    atexit.register(_report_unread)


def _report_unread() -> None:
    for event, host, errors in _take_unread():
        event.synchronize()
        try:
            _raise_set(host.tolist(), errors)
        except KeepOutputError as error:
            sys.stderr.write(f"shardnorm: the last backward's keep_output=False check, read at exit: "
                             f"{type(error).__name__}: {error}\n")
            return


def _take_unread() -> list:
    with _pending_lock:
        records = _unread[:]
        _unread.clear()
    return records


def check_arrived() -> None:
    """Raise for the flags of ended backwards whose copy to the host has landed, without waiting for the others
    (a keep_output=False norm's forward calls it)."""
    if _unread:
        _raise_arrived(_take_unread())


def _raise_arrived(records: list) -> None:
    """Raise for the first set flag among `records` whose copies have landed (in stream order: the first still on its
    way ends the scan); the records not read go back to `_unread`."""
    for i, (event, host, errors) in enumerate(records):
        arrived = event.query()
        if arrived and not any(host.tolist()):
            continue
        with _pending_lock:
            _unread[:0] = records[i + 1:] if arrived else records[i:]
        if arrived:
            _raise_set(host.tolist(), errors, _READ_LATE)
        return


# What a GPU backward's error adds: where it surfaces is not where the backward ran, and a step may have come between.
_READ_LATE = (" [Found by the checks of a backward on the GPU, which reach the host without a wait: read at the end of "
              "that backward or of a later one, or at a later forward of a keep_output=False norm. That backward's "
              "grads are wrong, and any optimizer step taken since has used them.]")


def _raise_set(flags: list, errors: list, note: str = "") -> None:
    for set_, error in zip(flags, errors):
        if set_:
            raise error() if not note else _noted(error(), note)


def _noted(error: Exception, note: str) -> Exception:
    return type(error)(f"{error}{note}")


def changed_output_error() -> KeepOutputError:
    return KeepOutputError("shardnorm: a norm with keep_output=False: its output, or the input it is recomputed from, "
                           "was written after the norm's forward without a version-counter bump (through `.data` or a "
                           "detached alias, e.g. in a forward hook), so its consumers' forward saw other values than "
                           "the recompute for their backward gives. Keep this norm's output (keep_output=True), or "
                           "change the tensor with an ordinary in-place op or out of place.")
