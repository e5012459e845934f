"""`tokios chat`: an interactive multi-turn conversation in the terminal.

Owns the read-reply loop: each user turn (a line, or a \"\"\" block; reading them, history and
Ctrl-C at the prompt are tokios.commands.chat_input's) is rendered with the whole conversation
through the model's chat template, and the reply is streamed to stdout (one reply per turn, ended
by a newline). Everything else (banner, help, notices, --stats) goes to stderr, so stdout holds
the replies only. It works the same when stdin is a pipe, so a script or a test can drive it.
Model loading, sampling flags and streaming come from tokios.commands.generate.

Slash commands (SLASH_COMMANDS): /help or /?, /reset or /clear, /exit, /quit or /bye. A line is
a command when its first word is "/" and letters (or "/?"); an unknown one is refused and never
sent to the model, as `ollama run` does. A line whose first word is not of that shape, such as a
path ("/usr/bin/env is what?") or a lone "/", is a message; so is anything in a \"\"\" block,
which is how to send a message that starts with "/word".

Ctrl-C during a reply stops it: the request is aborted between two engine steps (its KV blocks
are freed at once) and the prompt comes back. The stopped exchange is dropped from the
conversation: `ollama run` drops the partial reply too, and dropping the user turn with it keeps
the roles alternating, which many chat templates require; the arrow-up history brings the line
back to send it again.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from tokios.commands.chat_input import TurnReader, open_lines
from tokios.commands.generate import (add_model_arguments, add_sampling_arguments, close_engine, load_engine,
                                      prompt_token_ids_for, sampling_params_from_args, stream_completion)
from tokios.errors import ContextLengthExceededError

HELP, RESET, EXIT = "help", "reset", "exit"
# command -> what it does; each group's first name is the one /help shows first.
SLASH_COMMANDS: dict[str, str] = {"/help": HELP, "/?": HELP, "/reset": RESET, "/clear": RESET,
                                  "/exit": EXIT, "/quit": EXIT, "/bye": EXIT}
HELP_TEXT = """\
/help, /?              this list
/reset, /clear         start the conversation over (the --system message stays)
/exit, /quit, /bye     end the chat (Ctrl-D too)
\"\"\"                    open a multi-line message; it ends at a line ending with \"\"\"
Ctrl-C                 stop a reply; at the prompt clear the line; twice at an empty prompt, quit
Up/Down                earlier lines (history)
A line starting with /word is a command; put such text in a \"\"\" block to send it to the model."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="a system message that opens the conversation")
    parser.add_argument("--stats", action="store_true", help="print TTFT and tok/s of every reply on stderr")
    parser.add_argument("--history-file", default=None,
                        help="where the typed lines are kept for arrow-key history across sessions (default "
                             "<cache>/chat_history, the cache being $TOKIOS_CACHE_DIR, $XDG_CACHE_HOME/tokios "
                             "or ~/.cache/tokios); an empty value keeps them for this session only")
    add_model_arguments(parser)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    core = load_engine(args, for_chat=True)
    try:
        converse(core, params, args)
    finally:
        close_engine(core)
    return 0


def history_path_from_args(args: argparse.Namespace) -> Path | None:
    if args.history_file is None:
        from tokios.model_files import cache_directory

        return cache_directory() / "chat_history"
    return Path(args.history_file).expanduser() if args.history_file else None


def banner_name(core) -> str:
    """The name `tokios serve` gives the model (its /v1/models id), not the file's internal name."""
    from tokios.engine.async_engine import served_model_name

    return served_model_name(core.model_path)


@contextlib.contextmanager
def ctrl_c_stops_reply() -> Iterator[Callable[[], bool]]:
    """While open, Ctrl-C (SIGINT) only raises a flag, read between engine steps, instead of
    raising KeyboardInterrupt wherever the main thread happens to be (inside a step, the scheduler
    and the KV cache could be left half updated)."""
    is_requested = False

    def request_stop(signum, frame) -> None:
        nonlocal is_requested
        is_requested = True

    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield lambda: is_requested
    finally:
        signal.signal(signal.SIGINT, previous)


def converse(core, params, args: argparse.Namespace) -> None:
    """Read turns and stream each reply until /exit, end of input or a double Ctrl-C."""
    opening = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(opening)
    lines = open_lines(history_path_from_args(args))
    reader = TurnReader(lines)
    if sys.stdin.isatty():
        print(f"chatting with {banner_name(core)}; /help lists the commands, /exit or Ctrl-D ends",
              file=sys.stderr)
    try:
        while True:
            try:
                turn = reader.next_turn()
                if turn is None:
                    break
                messages, is_done = take_turn(core, params, args, turn, messages, opening)
                if is_done:
                    break
            except KeyboardInterrupt:
                # A Ctrl-C that came between the reply's handler and the prompt's (while a notice
                # or the stats line printed): the session goes on, without a half-taken exchange.
                if messages and messages[-1]["role"] == "user":
                    messages.pop()
                print(file=sys.stderr)
    finally:
        lines.close()


def take_turn(core, params, args: argparse.Namespace, turn, messages: list[dict], opening: list[dict]
              ) -> tuple[list[dict], bool]:
    """One turn: a slash command, or a message and its streamed reply. Returns the conversation
    and whether the chat ends."""
    command_word = None if turn.is_block else slash_command_word(turn.text)
    if command_word is not None:
        action = SLASH_COMMANDS.get(command_word)
        argument = turn.text.strip()[len(command_word):].strip()
        if action is None:
            print(f"unknown command {command_word}; /help lists the commands", file=sys.stderr)
        elif argument:
            print(f"{command_word} takes no argument (got {argument!r}); /help lists the commands", file=sys.stderr)
        elif action == EXIT:
            return messages, True
        elif action == HELP:
            print(HELP_TEXT, file=sys.stderr)
        else:
            print("(conversation reset)", file=sys.stderr)
            return list(opening), False
        return messages, False
    if not turn.text.strip():
        return messages, False
    messages.append({"role": "user", "content": turn.text})
    with ctrl_c_stops_reply() as is_stop_requested:
        try:
            token_ids = prompt_token_ids_for(core, messages, None)
            result = stream_completion(core, token_ids, params, sys.stdout, should_stop=is_stop_requested)
        except ContextLengthExceededError as exc:
            # The conversation outgrew the context: keep the session, drop this turn.
            messages.pop()
            print(f"tokios chat: error: {exc.message} Type /reset to start over.", file=sys.stderr)
            return messages, False
        # The user's Ctrl-C, not the finish reason: a request the engine failed ends "abort" too.
        was_stopped = is_stop_requested()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if was_stopped:
        messages.pop()
        print("(reply stopped; this exchange is not kept in the conversation)", file=sys.stderr)
    else:
        messages.append({"role": "assistant", "content": result.text})
    if args.stats:
        print(result.stats_line(), file=sys.stderr)
    return messages, False


def slash_command_word(text: str) -> str | None:
    """The command a line names ("/help"), or None when the line is a message: a command's first
    word is "/" followed by letters only, or "/?"."""
    words = text.split(maxsplit=1)
    if not words:
        return None
    first = words[0]
    if first == "/?" or (len(first) > 1 and first[0] == "/" and first[1:].isalpha() and first[1:].isascii()):
        return first
    return None
