"""Reading the user's turns for `tokios chat`: lines, \"\"\" blocks, history and Ctrl-C at the prompt.

Owns everything between the terminal (or a pipe) and one complete user turn; tokios.commands.chat
decides what a turn means (a slash command or a message for the model).

- A line is a turn. A line starting with \"\"\" opens a block that ends at the next line ending
  with \"\"\" (as in `ollama run`); the block, its lines joined with newlines, is one turn, and is
  never read as a slash command. `\"\"\"text\"\"\"` on one line is a one-line block.
- When stdin and stdout are both a terminal, lines are read with Python's `readline`: arrow keys
  move through the history (the last MAX_HISTORY_LINES lines, kept in a file across sessions
  unless the file is None) and edit the line. Otherwise lines are read from stdin as they come,
  with any prompt on stderr, so a pipe drives the chat exactly as a person does.
- Ctrl-C at the prompt: with text typed (or a block open) it clears that text; at an empty prompt
  it says how to quit, and a second Ctrl-C in a row quits (as llama-cli does). End of input
  (Ctrl-D) quits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

BLOCK_QUOTE = '"""'
PROMPT = "> "
CONTINUATION_PROMPT = "... "
MAX_HISTORY_LINES = 1000
QUIT_HINT = "(Ctrl-C again, Ctrl-D or /exit quits)"


@dataclass(frozen=True)
class Turn:
    text: str
    is_block: bool  # from a \"\"\" block: always a message, never a command


class StreamLines:
    """Lines from a stream (a pipe, or a terminal without readline); prompts go to `prompt_out`
    (None: no prompts, as when a script drives the chat)."""

    def __init__(self, stream: TextIO, prompt_out: TextIO | None):
        self.stream = stream
        self.prompt_out = prompt_out

    def read_line(self, prompt: str) -> str:
        if self.prompt_out is not None:
            self.prompt_out.write(prompt)
            self.prompt_out.flush()
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def pending_text(self) -> str:
        # The terminal driver discards a half-typed line on Ctrl-C and does not say what it held.
        return ""

    def close(self) -> None:
        pass


class ReadlineLines:
    """Lines from the terminal through GNU readline: editing, arrow-key history, and the history
    file (`history_path`, None: this session only) read at the start and written at close."""

    def __init__(self, history_path: Path | None, err: TextIO | None = None):
        import readline

        self.readline = readline
        self.history_path = history_path
        self.err = err or sys.stderr
        readline.set_history_length(MAX_HISTORY_LINES)
        if history_path is not None and history_path.is_file():
            try:
                readline.read_history_file(history_path)
            except OSError as exc:
                print(f"tokios chat: history file {history_path} is not readable ({exc.strerror}); "
                      "starting with an empty history", file=self.err)

    def read_line(self, prompt: str) -> str:
        try:
            return input(prompt)
        except EOFError:
            # Ctrl-D leaves the cursor after the prompt; the shell's prompt belongs on a line of its own.
            sys.stdout.write("\n")
            raise

    def pending_text(self) -> str:
        return self.readline.get_line_buffer()

    def close(self) -> None:
        if self.history_path is None:
            return
        try:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history_path)
        except OSError as exc:
            print(f"tokios chat: could not write the history file {self.history_path} ({exc.strerror})",
                  file=self.err)


def open_lines(history_path: Path | None, stdin: TextIO | None = None, stdout: TextIO | None = None,
               err: TextIO | None = None):
    """ReadlineLines when a person types at a terminal, StreamLines otherwise (the streams default
    to sys's at the call, not at import, so a redirection of them counts)."""
    stdin, stdout, err = stdin or sys.stdin, stdout or sys.stdout, err or sys.stderr
    if stdin.isatty() and stdout.isatty():
        try:
            return ReadlineLines(history_path, err)
        except ImportError:  # a Python built without readline: plain lines still work
            pass
    return StreamLines(stdin, err if stdin.isatty() else None)


class TurnReader:
    """The next user turn from a line source (StreamLines or ReadlineLines)."""

    def __init__(self, lines: StreamLines | ReadlineLines, err: TextIO | None = None):
        self.lines = lines
        self.err = err or sys.stderr
        self.num_empty_interrupts = 0
        self._in_block = False

    def next_turn(self) -> Turn | None:
        """The next turn; None at end of input or at a second Ctrl-C in a row at an empty prompt."""
        while True:
            self._in_block = False
            try:
                turn = self._read_turn()
            except KeyboardInterrupt:
                was_empty = not self._in_block and not self.lines.pending_text()
                if not was_empty:
                    self.num_empty_interrupts = 0
                    self.err.write("\n")
                    continue
                self.num_empty_interrupts += 1
                if self.num_empty_interrupts >= 2:
                    self.err.write("\n")
                    return None
                self.err.write(f"\n{QUIT_HINT}\n")
                continue
            self.num_empty_interrupts = 0
            return turn

    def _read_turn(self) -> Turn | None:
        try:
            line = self.lines.read_line(PROMPT)
        except EOFError:
            return None
        if not line.lstrip().startswith(BLOCK_QUOTE):
            return Turn(line, is_block=False)
        opening = line.lstrip()[len(BLOCK_QUOTE):]
        if opening.endswith(BLOCK_QUOTE):
            return Turn(opening[:-len(BLOCK_QUOTE)], is_block=True)
        self._in_block = True
        block_lines = [opening] if opening else []
        while True:
            try:
                line = self.lines.read_line(CONTINUATION_PROMPT)
            except EOFError:
                print(f'tokios chat: the {BLOCK_QUOTE} block was not closed before the end of input; '
                      "it was not sent", file=self.err)
                return None
            if line.endswith(BLOCK_QUOTE):
                closing = line[:-len(BLOCK_QUOTE)]
                if closing:
                    block_lines.append(closing)
                return Turn("\n".join(block_lines), is_block=True)
            block_lines.append(line)
