"""The messages other threads send into AsyncEngine's step loop, and the queue they travel in.

generate(), abort(), forget_warm_up() and a parallel group's watcher run outside the engine
thread; they never touch the core, they send one of these commands, which the step loop takes
before its next step and dispatches by type. CommandQueue.send refuses anything that is not
a command with a TypeError in the sender's thread, so a wrong message fails where it was
written instead of reaching the loop.
"""

from __future__ import annotations

import queue
import threading
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from tokios.errors import TokiosError
from tokios.request import Request
from tokios.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """A validated request and its sequences (EngineCore.make_requests), to queue in the core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    sequences: tuple[Request, ...]


@dataclass(frozen=True)
class AbortRequest:
    """Finish every sequence of a request with reason 'abort' (a no-op when it is not there)."""

    request_id: str


@dataclass(frozen=True)
class ResetCounters:
    """Zero the core's cumulative counters (after a warm-up run)."""


@dataclass(frozen=True)
class FailEngine:
    """Something outside a step broke the engine (a parallel group's rank died between steps)."""

    error: TokiosError


EngineCommand = AddRequest | AbortRequest | ResetCounters | FailEngine
COMMAND_TYPES: tuple[type, ...] = typing.get_args(EngineCommand)


class CommandQueue:
    """Thread-safe: any thread sends, the engine thread drains. `wake` is set on every send so a
    loop waiting for work goes round at once."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.wake = threading.Event()

    def send(self, command: EngineCommand) -> None:
        if not isinstance(command, COMMAND_TYPES):
            raise TypeError(f"AsyncEngine takes {', '.join(t.__name__ for t in COMMAND_TYPES)}; "
                            f"got {type(command).__name__}: {command!r}")
        self._queue.put(command)
        self.wake.set()

    def drain(self) -> Iterator[EngineCommand]:
        """The commands sent so far, oldest first, without waiting for more."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
