"""`tokios chat`: an interactive multi-turn conversation in the terminal.

Owns the read-reply loop: each line read from stdin is a user turn; the whole conversation is
rendered with the model's chat template and the reply is streamed to stdout (one reply per
turn, ended by a newline). `/reset` starts over, `/exit` (or end of input) ends. It works the
same when stdin is a pipe, so a script or a test can drive it. Model loading, sampling flags and
streaming come from tokios.commands.generate.
"""

from __future__ import annotations

import argparse
import sys

from tokios.commands.generate import (add_model_arguments, add_sampling_arguments, close_engine, load_engine,
                                      prompt_token_ids_for, sampling_params_from_args, stream_completion)
from tokios.errors import ContextLengthExceededError

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="a system message that opens the conversation")
    parser.add_argument("--stats", action="store_true", help="print TTFT and tok/s of every reply on stderr")
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


def converse(core, params, args: argparse.Namespace) -> None:
    """Read turns from stdin and stream each reply until /exit or end of input."""
    interactive = sys.stdin.isatty()
    opening = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(opening)
    if interactive:
        print(f"chatting with {core.model_config.name or core.model_path}; "
              f"{RESET_COMMAND} starts over, {EXIT_COMMANDS[0]} or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # end of input
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS:
            break
        if command == RESET_COMMAND:
            messages = list(opening)
            print("(conversation reset)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        token_ids = prompt_token_ids_for(core, messages, None)
        try:
            result = stream_completion(core, token_ids, params, sys.stdout)
        except ContextLengthExceededError as exc:
            # The conversation outgrew the context: keep the session, drop this turn.
            messages.pop()
            print(f"tokios chat: error: {exc.message} Type {RESET_COMMAND} to start over.", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": result.text})
        if args.stats:
            print(result.stats_line(), file=sys.stderr)
