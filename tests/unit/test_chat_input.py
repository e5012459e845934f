"""Reading `tokios chat` turns from a stream (the pipe path; the terminal path is driven through a
pseudo-terminal in tests/model/test_chat_terminal.py): lines, \"\"\" blocks as in `ollama run`,
which lines are slash commands, and the end of input."""

from __future__ import annotations

import io

import pytest

from tokios.commands.chat import SLASH_COMMANDS, slash_command_word
from tokios.commands.chat_input import StreamLines, Turn, TurnReader


def turns_of(text: str) -> tuple[list[Turn], str]:
    err = io.StringIO()
    reader = TurnReader(StreamLines(io.StringIO(text), prompt_out=None), err=err)
    turns = []
    while (turn := reader.next_turn()) is not None:
        turns.append(turn)
    return turns, err.getvalue()


def test_each_line_is_a_turn_and_a_block_is_one_turn():
    turns, err = turns_of('Hi\n"""\nfirst line\n\nsecond line\n"""\nBye\n')
    assert turns == [Turn("Hi", False), Turn("first line\n\nsecond line", True), Turn("Bye", False)]
    assert err == ""


def test_a_block_keeps_text_on_its_opening_and_closing_lines():
    turns, _ = turns_of('"""one\ntwo\nthree"""\n"""inline"""\n')
    assert turns == [Turn("one\ntwo\nthree", True), Turn("inline", True)]


def test_a_block_left_open_at_end_of_input_is_not_sent():
    turns, err = turns_of('Hi\n"""\nnever closed\n')
    assert turns == [Turn("Hi", False)]
    assert 'block was not closed' in err


def test_prompts_go_to_the_prompt_stream_only():
    prompts = io.StringIO()
    reader = TurnReader(StreamLines(io.StringIO('"""\na\n"""\n'), prompt_out=prompts), err=io.StringIO())
    assert reader.next_turn() == Turn("a", True)
    assert prompts.getvalue() == "> ... ... "


@pytest.mark.parametrize("line, word", [
    ("/help", "/help"), ("/?", "/?"), ("  /reset  ", "/reset"), ("/exit now", "/exit"),
    ("/etc", "/etc"),  # command-shaped: refused as unknown by the chat, never sent
    ("/usr/bin/env is what?", None), ("/ hello", None), ("/", None), ("//help", None),
    ("/x1", None), ("hello /help", None), ("", None),
])
def test_which_lines_are_commands(line, word):
    assert slash_command_word(line) == word


def test_every_command_is_command_shaped():
    assert all(slash_command_word(name) == name for name in SLASH_COMMANDS)
