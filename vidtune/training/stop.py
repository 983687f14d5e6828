"""Stopping a run cleanly: SIGINT / SIGTERM end the loop after the current step, with a checkpoint; during validation
samples, the sampling stops within a denoising step first.

Under torchrun a signal reaches the ranks at different moments, so each step the ranks sum their votes
(`stop_votes`) and all stop after the same step when any one was asked to (`agreed_stop`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from vidtune import parallel
from vidtune.errors import VidtuneError


class TrainingInterrupted(VidtuneError):
    """SIGINT / SIGTERM stopped the run after a checkpoint was saved; `exit_code` is 130 or 143."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopSignals:
    """While active, SIGINT / SIGTERM set `received` instead of killing the process; a second one stops at once.

    Handlers are installed only from the main thread and restored on exit. Worker processes forked while
    it is active (DataLoader workers) inherit the handler and ignore the signals: the main process owns
    the stop, so a Ctrl+C in a terminal cannot kill a worker in the middle of the step being finished.
    """

    TRAINING = ("stopping after the current step and saving a checkpoint. Send {key} again to quit at once without "
                "saving.")

    def __init__(self, stopping: str = TRAINING) -> None:
        self.received: signal.Signals | None = None
        self.stopping = stopping  # what a first signal does, in words ({key}: how to send a second)
        self._previous: dict[signal.Signals, Any] = {}
        self._pid = os.getpid()

    def __enter__(self) -> StopSignals:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for number in SIGNAL_EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return SIGNAL_EXIT_CODES.get(self.received, 1) if self.received is not None else 0

    def _handle(self, number: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked worker: the main process decides
        if self.received is not None:
            self.__exit__()
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(SIGNAL_EXIT_CODES.get(signal.Signals(number), 1))
        self.received = signal.Signals(number)
        key = "Ctrl+C" if number == signal.SIGINT else "the signal"
        # os.write, not print: a handler can run while print holds stderr's lock.
        os.write(2, f"\n{self.received.name}: {self.stopping.format(key=key)}\n".encode())

    @contextlib.contextmanager
    def meanwhile(self, stopping: str) -> Iterator[None]:
        """While active, a first signal is announced as `stopping` (e.g. during validation samples)."""
        previous, self.stopping = self.stopping, stopping
        try:
            yield
        finally:
            self.stopping = previous


def stop_votes(stop: StopSignals) -> list[float]:
    """This process's vote on stopping, one entry per signal in SIGNAL_EXIT_CODES (summed over ranks)."""
    return [float(stop.received == number) for number in SIGNAL_EXIT_CODES]


def agreed_stop(stop: StopSignals, votes: list[float] | None = None) -> signal.Signals | None:
    """The signal the run stops on. One process: the one it received. Under torchrun, every rank's vote
    counts (`votes`: summed over ranks; gathered here when not given)."""
    if not parallel.is_distributed():
        return stop.received
    votes = parallel.all_reduce_sum(stop_votes(stop)) if votes is None else votes
    return next((number for number, count in zip(SIGNAL_EXIT_CODES, votes, strict=True) if count > 0), None)
