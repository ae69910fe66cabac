"""The launchers of launch/train.sh (torchrun) and launch/deepspeed.sh (DeepSpeed's runner), quiet about a stop.

    python -m parallel.launcher torchrun|deepspeed LAUNCHER_ARGUMENTS...
    python -m parallel.launcher gpus      the number of GPUs the scripts start one process each on

(`deepspeed_node` is what the `deepspeed` one starts on this machine in place of DeepSpeed's node launcher.)

On SIGINT (Ctrl-C) or SIGTERM the ranks stop, and rank 0 of the main job says where and what running the same
command again does (parallel/train.py). What a launcher would add to that line says nothing more: torchrun's own
traceback when the signal reached it, or its ChildFailedError report for ranks that exited with the signal's code;
the DeepSpeed runner's KeyboardInterrupt traceback. The exit code is 128 + the signal's number, as a shell reports
a process the signal ended.

A rank that fails has said why (the job's one-line error, or a traceback): torchrun's own traceback and its
ChildFailedError report add only which rank failed first, and how, and so do the lines of DeepSpeed's node launcher
(deepspeed.launcher.launch: it kills the ranks, then logs the failed command and its exit code, the same for every
rank). Here that is one line, or nothing when the job's error says it all (a rank that exits with REPORTED); the exit
code is the failed rank's (128 + a signal that ended it).
"""

import logging
import os
import signal
import subprocess
import sys
from unittest import mock

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


class _DeepSpeedNodeLines(logging.Filter):
    """Drops the lines of DeepSpeed's node launcher about a failure or a stop (it kills the ranks, names the failed
    command, or the signal): deepspeed_node() reports a failed rank itself, and rank 0 of the job a stop."""

    DROPPED = ("Killing subprocess", "Main process received")

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith(self.DROPPED) or " exits with return code = " in message)


def _exit_for_failed_rank(job: str, rank: int, code: int) -> None:
    """Exit as the rank that failed first: with its code (128 + the signal's number for a signal), saying nothing
    when the job has said it all (REPORTED), else one line naming the rank and how."""
    if code == REPORTED:
        sys.exit(REPORTED)
    how = (f"was ended by {signal.Signals(-code).name}" if code < 0 else
           f"exited with code {code} (its error is above)")
    print(f"{job} failed: rank {rank} {how}", file=sys.stderr)
    sys.exit(code if code > 0 else 128 - code)


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
        _exit_for_failed_rank(e.name, rank, first.exitcode)


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
        with mock.patch.object(subprocess, "Popen", _with_node_launcher(subprocess.Popen)):
            main()
    finally:
        if received:
            sys.exit(128 + received[0])


NODE_LAUNCHER = ["-u", "-m", "deepspeed.launcher.launch"]


def _with_node_launcher(popen):
    """`popen` that starts deepspeed_node() where DeepSpeed's runner starts its node launcher on this machine; any
    other command (the runners of several nodes: pdsh, mpirun, …) as it is."""

    def start(cmd, *args, **kwargs):
        if isinstance(cmd, list) and cmd[1:4] == NODE_LAUNCHER:
            cmd = [cmd[0], "-u", "-m", "parallel.launcher", "deepspeed_node", *cmd[4:]]
        return popen(cmd, *args, **kwargs)

    return start


def deepspeed_node() -> None:
    """DeepSpeed's node launcher (deepspeed.launcher.launch), reporting the rank that failed first as torchrun() does.
    It polls its ranks, and at the first that exited with an error it kills the others and exits with that code;
    which rank it was, it does not say."""
    from deepspeed.launcher import launch
    from deepspeed.utils import logger as deepspeed_logger

    failed = []

    class RankProcess(subprocess.Popen):
        """A rank's process that notes its rank (the RANK of the environment the launcher gives it) and whether it is
        the first seen failed. Other processes (a helper the launcher runs, such as numactl) have no rank."""

        def __init__(self, cmd, *args, env=None, **kwargs):
            # read now: the launcher reuses one env dict for every rank
            self.rank = int(env["RANK"]) if env and "RANK" in env else None
            super().__init__(cmd, *args, env=env, **kwargs)

        def poll(self):
            code = super().poll()
            if code and self.rank is not None and not failed:
                failed.append(self)
            return code

    deepspeed_logger.addFilter(_DeepSpeedNodeLines())
    job = os.path.basename(launch.parse_args().training_script)
    try:
        with mock.patch.object(subprocess, "Popen", RankProcess):
            launch.main()
    except SystemExit as e:
        if e.code and failed:
            rank, code = failed[0].rank, failed[0].returncode
            if code in STOPPED_CODES:  # a stop (Ctrl-C reaches the ranks too): rank 0 has said so
                sys.exit(128 + abs(code) % 128)
            _exit_for_failed_rank(job, rank, code)
        raise


def gpus() -> None:
    """The visible GPUs' count, for the scripts: torch's import takes seconds, which a Ctrl-C may fall in."""
    import torch

    print(torch.cuda.device_count())


def main() -> None:
    which, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    try:
        {"torchrun": torchrun, "deepspeed": deepspeed, "deepspeed_node": deepspeed_node, "gpus": gpus}[which]()
    except KeyboardInterrupt:  # Ctrl-C before the launcher took over the signals: no rank has started yet
        print("stopped by SIGINT before the ranks started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
