"""The commands into AsyncEngine's step loop (engine/commands.py): typed messages that the sender's
thread checks, so a message the loop has no handler for fails where it is sent, not in the loop."""

from __future__ import annotations

import pytest

from tokios.engine.async_engine import AsyncEngine
from tokios.engine.commands import COMMAND_TYPES, AbortRequest, CommandQueue, FailEngine, ResetCounters
from tokios.errors import TokiosError


@pytest.mark.parametrize("command", [("abort", "r1"), ("add", "r1", None, [1], None, []), "abort", None])
def test_an_unknown_command_is_a_type_error_where_it_is_sent(command):
    commands = CommandQueue()
    with pytest.raises(TypeError, match="AsyncEngine takes AddRequest"):
        commands.send(command)
    assert not commands.wake.is_set()
    assert list(commands.drain()) == []


def test_commands_arrive_in_the_order_sent_and_wake_the_loop():
    commands = CommandQueue()
    sent = [AbortRequest("r1"), ResetCounters(), FailEngine(TokiosError("rank 1 exited")), AbortRequest("r2")]
    for command in sent:
        commands.send(command)
    assert commands.wake.is_set()
    assert list(commands.drain()) == sent
    assert list(commands.drain()) == []


def test_the_step_loop_has_one_handler_per_command_type():
    assert set(AsyncEngine._COMMAND_HANDLERS) == set(COMMAND_TYPES)


def test_commands_are_frozen():
    with pytest.raises(AttributeError):
        AbortRequest("r1").request_id = "r2"
