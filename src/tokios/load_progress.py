"""What a model load is doing, told to the person waiting for it.

Owns the phases of a load and the two ways they are shown. The layers that do the work announce
a phase with `phase(description, total_bytes)` (building or waiting for the CPU kernels in
model/kernels, reading the weights in model/loader.py, the tokenizer and the KV cache in
engine/core.py) and, for a phase that reads bytes, advance its count; they never print. Whoever
starts a load chooses how it is shown, for the thread that runs it, with `reporting(progress)`:

- `TerminalProgress` (`tokios generate`, `tokios chat`): one stderr line, rewritten in place with
  \\r on a terminal; a plain line per phase (and a count every few seconds) otherwise.
- `LoggingProgress` (`tokios serve`, server/registry.py): a log line per phase.

A load that is over within `delay_s` shows nothing: most loads take a second or two, and a line
that flashes by is noise. The delay is LOAD_PROGRESS_DELAY_S, or $TOKIOS_LOAD_PROGRESS_DELAY_S
(0 shows every phase of every load). Once the delay has passed, a phase is shown by the thread
that enters it (so none is missed, however short); a watcher thread shows the phase that is
running when the delay runs out and refreshes the count and the elapsed time.

Why a context variable rather than a parameter: the kernels are built on first use deep inside
every architecture's model class, and a reporter threaded through each of them would be a
parameter that only this concern reads. With no reporter set (the LLM class, tests, tools)
`phase()` costs a context-variable read. A thread started during a load does not inherit the
variable unless it is started in a copy of the context (engine/async_engine.py does that).
This module imports only tokios.errors, so every layer may use it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tokios.errors import InvalidRequestError

# Seconds a load runs before its progress is shown.
LOAD_PROGRESS_DELAY_S = 2.0
DELAY_ENVIRONMENT_VARIABLE = "TOKIOS_LOAD_PROGRESS_DELAY_S"
# How often a shown line is refreshed: a terminal line redraws cheaply; a plain line or a log line
# is a new line each time, so only every few seconds.
TERMINAL_REFRESH_S = 0.25
PLAIN_REFRESH_S = 5.0
MIB = 2**20


def progress_delay_s() -> float:
    """LOAD_PROGRESS_DELAY_S, or the environment's override (a number of seconds, >= 0)."""
    value = os.environ.get(DELAY_ENVIRONMENT_VARIABLE)
    if value is None or value == "":
        return LOAD_PROGRESS_DELAY_S
    try:
        delay_s = float(value)
    except ValueError:
        delay_s = -1.0
    if not delay_s >= 0:  # also refuses nan
        raise InvalidRequestError(f"{DELAY_ENVIRONMENT_VARIABLE} must be a number of seconds >= 0, got {value!r}",
                                  param=DELAY_ENVIRONMENT_VARIABLE)
    return delay_s


class Phase:
    """One step of a load; `advance` counts the bytes done of `total_bytes` (when it has them)."""

    def __init__(self, description: str, total_bytes: int | None = None):
        self.description = description
        self.total_bytes = total_bytes
        self.done_bytes = 0

    def advance(self, num_bytes: int) -> None:
        # A plain int update: the watcher thread reads it whenever it refreshes.
        self.done_bytes += num_bytes

    def text(self) -> str:
        if self.total_bytes is None:
            return self.description
        return f"{self.description}: {self.done_bytes / MIB:.0f} / {self.total_bytes / MIB:.0f} MiB"


_reporter: contextvars.ContextVar["LoadProgress | None"] = contextvars.ContextVar("tokios_load_progress",
                                                                                    default=None)


@contextmanager
def phase(description: str, total_bytes: int | None = None) -> Iterator[Phase]:
    """Announce a phase of the load that runs in this context (nothing happens without one);
    the phase it interrupts (building the kernels while building the model) resumes after it."""
    step = Phase(description, total_bytes)
    reporter = _reporter.get()
    if reporter is None:
        yield step
        return
    reporter.enter(step)
    try:
        yield step
    finally:
        reporter.leave(step)


@contextmanager
def reporting(progress: "LoadProgress | None") -> Iterator["LoadProgress | None"]:
    """Show the phases of what runs inside (in this thread) through `progress`; None shows nothing."""
    if progress is None:
        yield None
        return
    token = _reporter.set(progress)
    progress.start()
    try:
        yield progress
    finally:
        _reporter.reset(token)
        progress.stop()


class LoadProgress:
    """The timing shared by every way of showing a load: nothing before `delay_s`, then the
    current phase, each new phase as it starts, and a refresh every `refresh_s`. A subclass says
    how a line is shown (`show`) and how the display ends (`end`)."""

    def __init__(self, delay_s: float | None = None, refresh_s: float = PLAIN_REFRESH_S):
        self.delay_s = progress_delay_s() if delay_s is None else delay_s
        self.refresh_s = refresh_s
        self._phases: list[Phase] = []
        self._condition = threading.Condition()
        self._is_stopped = False
        self._is_showing = False
        self._last_shown: object = None
        self._started_at = 0.0
        self._watcher: threading.Thread | None = None

    # ---- what a subclass provides ------------------------------------------------------------
    def show(self, text: str, elapsed_s: float) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """After the load, once something was shown."""

    # ---- the load's side ------------------------------------------------------------------------
    def start(self) -> None:
        self._started_at = time.monotonic()
        self._is_stopped = False
        if self.delay_s <= 0:
            self._is_showing = True  # at once, in this thread: nothing depends on the watcher's timing
        self._watcher = threading.Thread(target=self._watch, name="tokios-load-progress", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        with self._condition:
            self._is_stopped = True
            self._is_showing = False  # a thread that outlives the load may still enter phases
            self._condition.notify_all()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        if self._last_shown is not None:
            self.end()

    def enter(self, step: Phase) -> None:
        with self._condition:
            self._phases.append(step)
            if self._is_showing:
                self._show_current()

    def leave(self, step: Phase) -> None:
        with self._condition:
            if step in self._phases:
                self._phases.remove(step)

    # ---- the watcher's side ---------------------------------------------------------------------
    def _watch(self) -> None:
        with self._condition:
            if self._condition.wait_for(lambda: self._is_stopped, timeout=self.delay_s):
                return  # a quick load: nothing to show
            self._is_showing = True
            while not self._is_stopped:
                self._show_current()
                self._condition.wait(self.refresh_s)

    def _show_current(self) -> None:
        # Called with the condition held.
        if not self._phases:
            return
        text = self._phases[-1].text()
        elapsed_s = time.monotonic() - self._started_at
        # A terminal line is redrawn when its clock ticks too; a new line only for new text.
        shown = (text, int(elapsed_s)) if self.shows_elapsed_time else text
        if shown == self._last_shown:
            return
        self._last_shown = shown
        self.show(text, elapsed_s)

    # Whether the same text is shown again as the seconds pass (a terminal line's clock).
    shows_elapsed_time = False


class TerminalProgress(LoadProgress):
    """A load's phases on `stream` (stderr): one line rewritten in place on a terminal, plain
    lines otherwise (a pipe, a log file, a test)."""

    def __init__(self, what: str, stream: TextIO, *, delay_s: float | None = None, is_terminal: bool | None = None):
        self.is_terminal = stream.isatty() if is_terminal is None else is_terminal
        super().__init__(delay_s, TERMINAL_REFRESH_S if self.is_terminal else PLAIN_REFRESH_S)
        self.what = what
        self.stream = stream
        self.shows_elapsed_time = self.is_terminal
        self._width = 0

    def show(self, text: str, elapsed_s: float) -> None:
        line = f"loading {self.what}: {text} ({elapsed_s:.0f} s)"
        if self.is_terminal:
            # A line that wraps cannot be rewritten with \r: cut it to the terminal's width.
            line = line[:self._columns() - 1]
            # \r back to the line's start, then pad over what a longer line before left there.
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):  # not a real terminal: $COLUMNS, else 80
            return shutil.get_terminal_size().columns

    def end(self) -> None:
        if self.is_terminal:  # the summary line that follows takes the line's place
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


class LoggingProgress(LoadProgress):
    """A load's phases as log lines (a server's load, which a log records)."""

    def __init__(self, what: str, logger: logging.Logger, *, delay_s: float | None = None):
        super().__init__(delay_s, PLAIN_REFRESH_S)
        self.what = what
        self.logger = logger

    def show(self, text: str, elapsed_s: float) -> None:
        self.logger.info("loading %s: %s (%.0f s)", self.what, text, elapsed_s)
