"""engine/cpu_turns.py: engines take turns first come first served, a turn is released when its
step raises, and a background engine's slice follows the foreground engine's steps."""

from __future__ import annotations

import threading
import time

import pytest

from tokios.engine import cpu_turns
from tokios.engine.cpu_turns import BACKGROUND_SLICE_FRACTION, CpuTurns


def test_turns_are_taken_in_arrival_order_and_never_overlap():
    turns = CpuTurns()
    order, inside = [], []
    first_holds = threading.Event()
    release_first = threading.Event()

    def take(name: str, foreground: bool, hold: threading.Event | None = None) -> None:
        with turns.turn(foreground):
            inside.append(name)
            assert len(inside) == 1, inside  # nobody else is inside a turn
            order.append(name)
            if hold is not None:
                first_holds.set()
                hold.wait(5)
            inside.remove(name)

    first = threading.Thread(target=take, args=("first", True, release_first))
    first.start()
    first_holds.wait(5)
    waiters = []
    for name, foreground in (("encoder", False), ("chat", True), ("other", True)):
        thread = threading.Thread(target=take, args=(name, foreground))
        thread.start()
        waiters.append(thread)
        time.sleep(0.05)  # each is queued before the next arrives
    release_first.set()
    for thread in [first, *waiters]:
        thread.join(5)
    assert order == ["first", "encoder", "chat", "other"]


def test_a_step_that_raises_releases_its_turn():
    turns = CpuTurns()
    with pytest.raises(RuntimeError):
        with turns.turn(foreground=True):
            raise RuntimeError("step failed")
    done = threading.Event()
    thread = threading.Thread(target=lambda: (turns.turn(False).__enter__(), done.set()))
    thread.start()
    assert done.wait(2)


def test_the_background_slice_follows_a_busy_foreground_engine(monkeypatch):
    turns = CpuTurns()
    assert turns.background_slice_s() is None  # no generative engine has stepped
    for _ in range(20):
        with turns.turn(foreground=True):
            time.sleep(0.01)
    slice_s = turns.background_slice_s()
    assert slice_s is not None and 0.5 * BACKGROUND_SLICE_FRACTION * 0.01 < slice_s < 3 * BACKGROUND_SLICE_FRACTION * 0.01
    # Idle for longer than FOREGROUND_BUSY_S: the background engine may take as long as it likes.
    monkeypatch.setattr(cpu_turns, "FOREGROUND_BUSY_S", 0.0)
    time.sleep(0.01)
    assert turns.background_slice_s() is None


def test_a_foreground_engine_waiting_for_its_turn_counts_as_busy(monkeypatch):
    """A background forward longer than FOREGROUND_BUSY_S must not make the next one think the
    generative engine idle while it waits for its turn."""
    monkeypatch.setattr(cpu_turns, "FOREGROUND_BUSY_S", 0.0)
    turns = CpuTurns()
    with turns.turn(foreground=True):
        time.sleep(0.01)
    waiting = threading.Event()

    def foreground_step():
        waiting.set()
        with turns.turn(foreground=True):
            pass

    with turns.turn(foreground=False):
        thread = threading.Thread(target=foreground_step)
        thread.start()
        waiting.wait(2)
        time.sleep(0.05)  # the foreground engine is now queued behind this turn
        assert turns.background_slice_s() is not None
    thread.join(2)
