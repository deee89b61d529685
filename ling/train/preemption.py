"""Graceful preemption: SIGTERM / SIGINT / SIGHUP ask the run to finish its step, save and exit; so does the
death of torchrun, the launcher.

Every rank installs the handler. The handler only records the signal: the trainer adds one flag per stop
signal (`STOP_SIGNALS`) to the per-step all-reduce it already does, so all ranks stop after the same step and
agree on the signal's name (`agree`), whichever rank received it: torchrun forwards what it receives to its
workers; `kill -TERM <pid>` of one worker reaches that worker alone. Launchers often deliver the same signal
twice (once directly, once forwarded), so repeats within `repeat_window_s` are ignored; a later one aborts at
once (KeyboardInterrupt) for a user who really wants out. SIGHUP is left alone when it is ignored (nohup).

torchrun (2.13) starts every worker in a session of its own, so a signal to the launcher's process group does
not reach them, and a launcher killed with SIGKILL leaves them training alone. Under torchrun each worker
therefore watches its parent: when the launcher is gone, the run stops as on a SIGHUP (`watch_parent`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

from ling.train.launch import StopRun

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the order of the per-step all-reduce's stop flags


def under_torchrun() -> bool:
    """Whether this process is a worker of torchrun's elastic agent (which sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class Preempted(StopRun):
    """The run stopped on a signal after saving; exit code 128 + signal number, the shell's convention."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT/SIGHUP set `self.signum` instead of killing the process.

    `watch_parent` (default: under torchrun) polls the parent process every `poll_s` seconds; once it is gone
    (this process was re-parented) `signum` becomes SIGHUP and `reason` says why."""

    def __init__(self, repeat_window_s: float = 5.0, watch_parent: bool | None = None, poll_s: float = 1.0) -> None:
        self.repeat_window_s = repeat_window_s
        self.watch_parent = under_torchrun() if watch_parent is None else watch_parent
        self.poll_s = poll_s
        self.signum: int | None = None
        self.reason = ""  # what sent the stop, when it was not a signal (the launcher's exit)
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._parent: int | None = None  # the launcher's pid, when watched

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def description(self) -> str:
        """The stop's name, with its reason when it has one: "SIGTERM", "SIGHUP (the launcher, pid 12, exited)"."""
        return f"{self.name} ({self.reason})" if self.reason else self.name

    def agree(self, signum: int) -> None:
        """Adopt the stop the ranks agreed on (another rank's signal, learnt through the step's all-reduce); a
        SIGHUP gets its reason when this rank's launcher is gone too (another rank's watcher noticed first)."""
        if self.signum != signum:
            self.signum = signum
            self._first_at = self._first_at or time.monotonic()
        if signum == signal.SIGHUP and not self.reason and self._parent is not None and os.getppid() != self._parent:
            self.reason = f"the launcher, pid {self._parent}, exited"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
        elif time.monotonic() - self._first_at > self.repeat_window_s:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")

    def _watch(self, parent: int) -> None:
        while not self._stop_watch.wait(self.poll_s):
            if os.getppid() != parent:
                if self.signum is None:
                    self.reason = f"the launcher, pid {parent}, exited"
                    self.signum, self._first_at = signal.SIGHUP, time.monotonic()
                    log.warning("the launcher (pid %d) exited: stopping after this step", parent)
                return

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup: a hang-up is meant to pass
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.watch_parent:
            self._parent = os.getppid()
            self._watcher = threading.Thread(target=self._watch, args=(self._parent,), name="launcher-watch",
                                             daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_watch.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
