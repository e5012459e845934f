"""`tokios chat` at a terminal, as a person uses it: one real process on the default model, driven
through a pseudo-terminal (pexpect), so that readline, the terminal's Ctrl-C and the prompt are
the real ones.

The session checks, in order: the banner names the model as `tokios serve` does (its /v1/models
id); /help lists the commands; an unknown /word is refused and never reaches the model; up-arrow
+ Enter sends an earlier line again; Ctrl-C during a long reply stops it (finish "abort") and
returns to the prompt, the stopped exchange is dropped (the next prompt holds only the new
question) and the next turn is answered; a \"\"\" block is one user turn; Ctrl-C clears a
half-typed line; two Ctrl-C in a row at an empty prompt end the chat with exit status 0; the
history file holds the typed lines.

Below it, the same stop in-process: stream_completion stopped midway leaves nothing running and
no KV block in use, and the core serves the next request to its full length.
"""

from __future__ import annotations

import io
import re
import sys

import pexpect

from tokios.sampling_params import SamplingParams

PROMPT = "> "
STATS = re.compile(r"(\d+) prompt tokens, (\d+) generated[^\r\n]*finish (\w+)")
LONG_REPLY_MAX_TOKENS = 400
UP_ARROW = "\x1b[A"


def rendered_length(tokenizer, messages: list[dict]) -> int:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(rendered, add_special_tokens=False))


def send_line(child, text: str) -> None:
    """Type a line and wait for its echo, so that what follows is the program's answer to it."""
    child.send(text + "\r")
    child.expect_exact(text.splitlines()[-1])


def expect_stats(child) -> tuple[int, int, str]:
    child.expect(STATS)
    return int(child.match.group(1)), int(child.match.group(2)), child.match.group(3)


def test_chat_at_a_terminal(tmp_path):
    from tokios.engine.async_engine import served_model_name
    from tokios.model_files import resolve_model_path
    from tokios.tokenizer.tokenizer import load_tokenizer

    model_path = resolve_model_path(None)
    tokenizer = load_tokenizer(model_path)
    history_file = tmp_path / "chat_history"
    child = pexpect.spawn(sys.executable, ["-m", "tokios.cli", "chat", "--temperature", "0", "--stats",
                                           "--max-tokens", str(LONG_REPLY_MAX_TOKENS),
                                           "--history-file", str(history_file)],
                          encoding="utf-8", timeout=600, dimensions=(40, 250))
    try:
        # The banner: the served name, not the file's internal one.
        child.expect(r"chatting with (\S+);")
        assert child.match.group(1) == served_model_name(model_path)
        child.expect_exact(PROMPT)

        send_line(child, "/help")
        child.expect_exact("/reset, /clear")
        child.expect_exact(PROMPT)

        send_line(child, "/nonsense")
        child.expect_exact("unknown command /nonsense; /help lists the commands")
        child.expect_exact(PROMPT)
        assert not STATS.search(child.before)  # the model never saw it

        # History: the previous line comes back with one up-arrow, the one before with two.
        child.send(UP_ARROW + "\r")
        child.expect_exact("unknown command /nonsense")
        child.expect_exact(PROMPT)
        child.send(UP_ARROW + UP_ARROW + "\r")
        child.expect_exact("/reset, /clear")
        child.expect_exact(PROMPT)

        # Ctrl-C in the middle of a long reply.
        send_line(child, "Write a very long story about a dragon who learns to cook.")
        child.expect(r"[A-Za-z]{3}")  # the reply is streaming
        child.sendintr()
        child.expect_exact("(reply stopped")
        _, num_generated, finish = expect_stats(child)
        assert finish == "abort" and num_generated < LONG_REPLY_MAX_TOKENS
        child.expect_exact(PROMPT)

        # The next turn is answered, and its prompt holds only itself: the stopped exchange is gone.
        question = "What is 2 + 2?"  # a short greedy answer (12 tokens)
        send_line(child, question)
        num_prompt_tokens, _, finish = expect_stats(child)
        assert finish in ("stop", "length")
        assert num_prompt_tokens == rendered_length(tokenizer, [{"role": "user", "content": question}])
        child.expect_exact(PROMPT)

        # A """ block is one user turn: one reply, whose prompt is the block's lines joined.
        send_line(child, "/reset")
        child.expect_exact("(conversation reset)")
        child.expect_exact(PROMPT)
        send_line(child, '"""')
        send_line(child, "Name two colours.")
        send_line(child, 'Answer in one line."""')
        num_prompt_tokens, _, _ = expect_stats(child)
        block = "Name two colours.\nAnswer in one line."
        assert num_prompt_tokens == rendered_length(tokenizer, [{"role": "user", "content": block}])
        child.expect_exact(PROMPT)

        # Ctrl-C with a half-typed line clears it (the next line is read on its own).
        child.send("this is never sent")
        child.expect_exact("never sent")
        child.sendintr()
        child.expect_exact(PROMPT)
        assert "quits" not in child.before  # clearing a line is not a step towards quitting
        send_line(child, "/help")
        child.expect_exact("/reset, /clear")
        child.expect_exact(PROMPT)
        assert not STATS.search(child.before)

        # Ctrl-C at an empty prompt says how to quit; a second one quits, with status 0.
        child.sendintr()
        child.expect_exact("(Ctrl-C again, Ctrl-D or /exit quits)")
        child.expect_exact(PROMPT)
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
    history = history_file.read_text().splitlines()
    assert "/nonsense" in history and question in history and '"""' in history


class _CountingWriter(io.StringIO):
    def __init__(self):
        super().__init__()
        self.num_writes = 0

    def write(self, text: str) -> int:
        self.num_writes += 1
        return super().write(text)


def test_a_stopped_reply_frees_its_blocks_and_the_core_serves_on():
    from tokios.commands.generate import stream_completion
    from tokios.config import CacheConfig, EngineConfig, LoadConfig
    from tokios.engine import EngineCore

    core = EngineCore(EngineConfig(load=LoadConfig(dtype="float32"),
                                   cache=CacheConfig(kv_cache_memory_bytes=64 * 1024**2)))
    try:
        prompt_token_ids = core.tokenizer.encode("Once upon a time")
        out = _CountingWriter()
        stopped = stream_completion(core, prompt_token_ids, SamplingParams(max_tokens=64, temperature=0.0,
                                                                           ignore_eos=True),
                                    out, should_stop=lambda: out.num_writes >= 3)
        assert stopped.finish_reason == "abort"
        assert stopped.text == out.getvalue() and out.num_writes == 3
        assert 3 <= stopped.num_output_tokens < 64
        stats = core.stats()
        assert not core.has_unfinished and stats.num_running == stats.num_waiting == 0
        assert stats.num_blocks_used == 0
        core.check_invariants()

        full = stream_completion(core, prompt_token_ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True), io.StringIO())
        assert full.finish_reason == "length" and full.num_output_tokens == 8
        # Greedy: the stopped reply was the start of the same text.
        assert full.text.startswith(stopped.text) or stopped.text.startswith(full.text)
    finally:
        core.close()
