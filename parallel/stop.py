"""SIGINT and SIGTERM as an exception in the main job, so that a stop ends it with one line, not tracebacks.

Nothing here imports torch: train.py installs the handlers before its imports, which take seconds.
"""

import contextlib
import os
import signal
import time


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived (Ctrl-C, a scheduler, torchrun passing either on to the ranks). A BaseException,
    as KeyboardInterrupt is, so that no `except Exception` on the way takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """Notes the first SIGINT or SIGTERM from construction on; once `arm()`ed, raises `Stopped` for it (at once,
    for one that came before). Later signals are only noted, except in `deferred()`. `signum` stays set: a stop
    may show up as another error first (a collective fails because a peer rank has already left, `wait()`), or
    arrive while one is being handled, and either is then known for the stop's."""

    def __init__(self):
        self.signum: int | None = None
        self.armed = False
        self._deferring = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._received)

    def arm(self) -> None:
        self.armed = True
        if self.signum is not None:
            raise Stopped(self.signum)

    @contextlib.contextmanager
    def deferred(self):
        """Within: a first signal is only noted, for the ranks to stop together where each reads every rank's note
        (train.py: the step's loss all-reduce); a second one raises at once. Raised at once, a stop leaves each
        rank wherever it was, between two collectives of a step: on NCCL a rank then waits in a collective its
        peer has left, inside a CUDA wait where no Python signal handler runs, until the launcher kills it."""
        armed, self.armed, self._deferring = self.armed, False, True
        try:
            yield
        finally:
            self.armed, self._deferring = armed, False

    def wait(self, seconds: float) -> int | None:
        """`signum`, after waiting up to `seconds` for a signal: launchers stop the ranks one after the other
        (DeepSpeed's waits for each to exit), so a rank may see its peer gone before its own signal comes."""
        deadline = time.monotonic() + seconds
        while self.signum is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.signum

    def _received(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self.armed:
                raise Stopped(signum)
            if self._deferring and os.environ.get("RANK", "0") == "0":
                # os.write: a handler may run inside logging's own write, whose lock is not reentrant
                os.write(2, f"{signal.Signals(signum).name}: stopping at the end of this step (again to stop "
                            f"at once)\n".encode())
        elif self._deferring:
            raise Stopped(self.signum)
