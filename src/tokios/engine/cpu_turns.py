"""Engines of one process take turns at the CPU.

Every loaded model is its own engine with its own step thread, and each step of each engine
wants every core (torch's thread pool). Two engines stepping at once split the cores and their
thread pools spin against each other, so both steps take longer than taking turns. Here each
step runs inside a turn: one engine at a time, first come first served, so an engine that just
stepped waits behind one that was already waiting.

Two kinds of engine: foreground ones (generative: a user is waiting for each next token) and
background ones (the encoder: a batch of embeddings has no one watching it token by token).
A background engine asks, before each forward, how long it may take (`background_slice_s`):
while a foreground engine is stepping regularly, a fraction of that engine's typical step, so a
decoding stream's gap between tokens grows by at most that fraction; with no foreground engine
busy, as long as it likes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

# A background slice takes at most this fraction of the foreground step's typical duration.
BACKGROUND_SLICE_FRACTION = 0.4
# A foreground engine counts as busy while it steps or waits for a turn, and for this long after.
FOREGROUND_BUSY_S = 0.25
# Smoothing of the foreground step duration (exponential moving average weight of a new step).
STEP_EMA_WEIGHT = 0.2


class CpuTurns:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._queue: deque[object] = deque()
        self._holder: object | None = None
        self._foreground_step_s: float | None = None
        self._foreground_last_end = float("-inf")
        self._num_foreground_waiting = 0
        self._is_foreground_holding = False

    @contextmanager
    def turn(self, foreground: bool):
        ticket = object()
        with self._condition:
            self._queue.append(ticket)
            self._num_foreground_waiting += foreground
            while self._holder is not None or self._queue[0] is not ticket:
                self._condition.wait()
            self._num_foreground_waiting -= foreground
            self._queue.popleft()
            self._holder = ticket
            self._is_foreground_holding = foreground
        started = time.monotonic()
        try:
            yield
        finally:
            ended = time.monotonic()
            with self._condition:
                self._holder = None
                self._is_foreground_holding = False
                if foreground:
                    step_s = ended - started
                    previous = self._foreground_step_s
                    self._foreground_step_s = step_s if previous is None else (
                        previous + STEP_EMA_WEIGHT * (step_s - previous))
                    self._foreground_last_end = ended
                self._condition.notify_all()

    def background_slice_s(self) -> float | None:
        """How long a background forward may take now; None: no limit (no foreground engine busy)."""
        with self._condition:
            is_busy = (self._num_foreground_waiting > 0 or self._is_foreground_holding
                       or time.monotonic() - self._foreground_last_end <= FOREGROUND_BUSY_S)
            if self._foreground_step_s is None or not is_busy:
                return None
            return BACKGROUND_SLICE_FRACTION * self._foreground_step_s


# The process's one arbiter: every engine in the process steps through it.
CPU_TURNS = CpuTurns()
