"""A load's progress line (tokios/load_progress.py): every phase a load enters is shown once the
delay has passed, nothing at all for a load that ends within it, one line rewritten in place on a
terminal and plain lines elsewhere, log lines for a server, and the phase that is running when
the delay runs out is shown by the watcher even though nothing new happens (a load waiting for
another process's kernel build). The kernel build's phase says which of building, checking or
waiting it is, from the build directory."""

from __future__ import annotations

import io
import logging
import threading

import pytest

from tokios import load_progress
from tokios.errors import InvalidRequestError
from tokios.load_progress import LoadProgress, LoggingProgress, TerminalProgress, phase, reporting

MIB = 2**20


def run_a_load() -> None:
    """The phases of a load as the engine enters them: the kernels' phase inside the model's."""
    with phase("reading weights", 3 * MIB) as reading:
        for _ in range(3):
            reading.advance(MIB)
    with phase("building the model's 2 layers"):
        with phase("building the CPU kernels"):
            pass
    with phase("preparing the KV cache (64 MiB)"):
        pass


def test_every_phase_is_a_plain_line_when_not_a_terminal():
    stream = io.StringIO()
    with reporting(TerminalProgress("model.gguf", stream, delay_s=0, is_terminal=False)):
        run_a_load()
    lines = stream.getvalue().splitlines()
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        "loading model.gguf: reading weights: 0 / 3 MiB",
        "loading model.gguf: building the model's 2 layers",
        "loading model.gguf: building the CPU kernels",
        "loading model.gguf: preparing the KV cache (64 MiB)",
    ]
    assert "\r" not in stream.getvalue()
    assert all(line.endswith(" s)") for line in lines)  # the time since the load started


def test_a_load_that_ends_within_the_delay_shows_nothing():
    stream = io.StringIO()
    with reporting(TerminalProgress("model.gguf", stream, delay_s=3600, is_terminal=True)):
        run_a_load()
    assert stream.getvalue() == ""


def test_a_terminal_gets_one_line_rewritten_in_place_and_cleared_at_the_end():
    stream = io.StringIO()
    with reporting(TerminalProgress("model.gguf", stream, delay_s=0, is_terminal=True)):
        run_a_load()
    output = stream.getvalue()
    assert "\n" not in output
    shown = [part for part in output.split("\r") if part.strip()]
    assert shown[0].startswith("loading model.gguf: reading weights: 0 / 3 MiB (")
    assert any(part.startswith("loading model.gguf: preparing the KV cache (64 MiB) (") for part in shown)
    # Each rewrite pads over the longer line before it; the end blanks the line for the summary.
    assert output.endswith("\r") and output.rsplit("\r", 2)[1].strip() == ""


def test_a_terminal_line_is_cut_to_the_terminals_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a line that wrapped could not be rewritten with \r
    stream = io.StringIO()
    with reporting(TerminalProgress("model.gguf", stream, delay_s=0, is_terminal=True)):
        run_a_load()
    shown = stream.getvalue().split("\r")
    assert max(len(part) for part in shown) == 39
    assert shown[1] == "loading model.gguf: reading weights: 0 "


def test_a_server_logs_the_phases(caplog):
    logger = logging.getLogger("tokios.test_load_progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        with reporting(LoggingProgress("model gemma", logger, delay_s=0)):
            run_a_load()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("loading model gemma: reading weights: 0 / 3 MiB (")
    assert any(message.startswith("loading model gemma: building the CPU kernels (") for message in messages)


class RecordedProgress(LoadProgress):
    def __init__(self, delay_s: float):
        super().__init__(delay_s)
        self.texts: list[str] = []
        self.was_shown = threading.Event()

    def show(self, text: str, elapsed_s: float) -> None:
        self.texts.append(text)
        self.was_shown.set()


def test_the_phase_running_when_the_delay_ends_is_shown_without_anything_new_happening():
    progress = RecordedProgress(delay_s=0.05)
    with reporting(progress):
        with phase("waiting for another process's build of the CPU kernels"):
            # The load sits here (as on another process's lock); the watcher shows it.
            assert progress.was_shown.wait(timeout=60)
    assert progress.texts[0] == "waiting for another process's build of the CPU kernels"


def test_without_a_reporter_a_phase_is_only_a_counter():
    with phase("reading weights", MIB) as reading:
        reading.advance(MIB)
    assert reading.text() == "reading weights: 1 / 1 MiB"


def test_a_phase_entered_after_the_load_shows_nothing():
    progress = RecordedProgress(delay_s=0)
    with reporting(progress):
        pass
    progress.enter(load_progress.Phase("a thread that outlived the load"))
    assert progress.texts == []


@pytest.mark.parametrize("value, expected", [("0", 0.0), ("2.5", 2.5), ("", load_progress.LOAD_PROGRESS_DELAY_S)])
def test_the_delay_comes_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(load_progress.DELAY_ENVIRONMENT_VARIABLE, value)
    assert load_progress.progress_delay_s() == expected


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_delay_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(load_progress.DELAY_ENVIRONMENT_VARIABLE, value)
    with pytest.raises(InvalidRequestError, match="TOKIOS_LOAD_PROGRESS_DELAY_S must be a number of seconds >= 0"):
        load_progress.progress_delay_s()


def test_the_kernel_phase_says_building_checking_or_waiting(tmp_path):
    from tokios.model.kernels import _build_phase

    assert _build_phase(tmp_path, "kernels", "native").startswith("building the CPU kernels (cpu_kernels.cpp")
    (tmp_path / "kernels.so").write_bytes(b"")
    assert _build_phase(tmp_path, "kernels", "native") == f"checking the cached build of the CPU kernels in {tmp_path}"
    (tmp_path / "lock").write_bytes(b"")  # torch's FileBaton: another process holds the build
    assert _build_phase(tmp_path, "kernels", "native") == (
        f"waiting for another process's build of the CPU kernels (its lock: {tmp_path / 'lock'})")
