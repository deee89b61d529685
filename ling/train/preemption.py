"""Graceful preemption: SIGTERM / SIGINT ask the run to finish its step, save and exit.

Every rank installs the handler; torchrun forwards the signal it receives to all its workers, a terminal's
Ctrl-C, SLURM's scancel and `kill -TERM -<pgid>` reach every process. The handler only records the signal:
the trainer adds the flag to the per-step all-reduce it already does, so all ranks stop after the same step
even when the signal reaches them at different moments. Launchers often deliver the same signal twice (once
directly, once forwarded), so repeats within `repeat_window_s` are ignored; a later one aborts at once
(KeyboardInterrupt) for a user who really wants out.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

from ling.train.launch import StopRun

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(StopRun):
    """The run stopped on a signal after saving; exit code 128 + signal number, the shell's convention."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT set `self.signum` instead of killing the process."""

    def __init__(self, repeat_window_s: float = 5.0) -> None:
        self.repeat_window_s = repeat_window_s
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
        elif time.monotonic() - self._first_at > self.repeat_window_s:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")

    def __enter__(self) -> StopSignals:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
