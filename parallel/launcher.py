"""The launchers of launch/train.sh (torchrun) and launch/deepspeed.sh (DeepSpeed's runner), quiet about a stop.

    python -m parallel.launcher torchrun|deepspeed LAUNCHER_ARGUMENTS...

On SIGINT (Ctrl-C) or SIGTERM the ranks stop, and rank 0 of the main job says where and what running the same
command again does (parallel/train.py). What a launcher would add to that line says nothing more: torchrun's own
traceback when the signal reached it, or its ChildFailedError report for ranks that exited with the signal's code;
the DeepSpeed runner's KeyboardInterrupt traceback. The exit code is 128 + the signal's number, as a shell reports
a process the signal ended.

A rank that fails has said why (the job's one-line error, or a traceback): torchrun's own traceback and its
ChildFailedError report add only which rank failed first, and how. Here that is one line, or nothing when the job's
error says it all (a rank that exits with REPORTED); the exit code is the failed rank's (128 + a signal that ended it).
"""

import logging
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a rank's exit code after a stop: 128 + the signal (parallel/train.py), or minus the signal if it was killed by it
STOPPED_CODES = {code for sig in STOP_SIGNALS for code in (128 + sig, -sig)}
# a rank's exit code after rank 0 has printed the job's error for a setting
# (`config error: …`, `checkpoint error: …`)
REPORTED = 2


class _FailureLine(logging.Filter):
    """Drops torchrun's `failed (exitcode: N) local_rank: …` log line: torchrun() reports the failure itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode:")


def torchrun() -> None:
    """torchrun passes a signal it receives on to the ranks (they run in sessions of their own)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_FailureLine())
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        codes = [failure.exitcode for failure in e.failures.values()]
        if all(code in STOPPED_CODES for code in codes):
            sys.exit(128 + abs(codes[0]) % 128)
        rank, first = e.get_first_failure()  # torchrun stopped the others after it
        if first.exitcode == REPORTED:
            sys.exit(REPORTED)
        how = (f"was ended by {first.signal_name()}" if first.exitcode < 0 else
               f"exited with code {first.exitcode} (its error is above)")
        print(f"{e.name} failed: rank {rank} {how}", file=sys.stderr)
        sys.exit(first.exitcode if first.exitcode > 0 else 128 + abs(first.exitcode))


def deepspeed() -> None:
    """DeepSpeed's runner on one node does not pass signals on: it dies of SIGTERM, leaving its launcher and the
    ranks running, and Ctrl-C (which reaches the ranks too) interrupts it with a traceback. Here it passes either
    on to its launcher (deepspeed.launcher.launch, which stops the ranks) and waits for it."""
    import psutil
    from deepspeed.launcher.runner import main

    received = []

    def pass_on(signum, frame):
        if not received:
            received.append(signum)
            for child in psutil.Process().children():
                child.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    try:
        main()
    finally:
        if received:
            sys.exit(128 + received[0])


def main() -> None:
    which, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    try:
        {"torchrun": torchrun, "deepspeed": deepspeed}[which]()
    except KeyboardInterrupt:  # Ctrl-C before the launcher took over the signals: no rank has started yet
        print("stopped by SIGINT before the ranks started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
