"""`tokios generate PROMPT`: one completion, streamed to the terminal as it is produced.

Owns the command, plus the pieces `tokios chat` shares with it: the model and sampling flags
(the engine's own are engine_flags.py's), loading an EngineCore from them and closing
it, and streaming one request's text deltas. Talks to tokios.engine (EngineCore steps the model;
OutputProcessor turns token ids into text deltas) and the tokenizer's chat template. The text
goes to stdout; load time, TTFT, prompt tok/s and decode tok/s go to stderr, so stdout stays
pipeable.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from tokios import sampling_defaults
from tokios.engine_flags import add_engine_arguments, engine_config_from_args
from tokios.errors import InvalidRequestError

DEFAULT_MAX_TOKENS = 256


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and the engine's flags."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    add_engine_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    sampling_defaults.add_arguments(parser, applies_to="each reply")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message, or plain text with --raw)")
    parser.add_argument("--raw", action="store_true",
                        help="complete the prompt as plain text instead of applying the chat template")
    parser.add_argument("--system", default=None, help="a system message (chat template only)")
    add_model_arguments(parser)
    add_sampling_arguments(parser)


def sampling_params_from_args(args: argparse.Namespace):
    """The request's SamplingParams: the flags, then the model's sampling defaults (the ones
    `tokios serve` gives a request that sets nothing), checked before the model loads."""
    from tokios.model_files import resolve_model_path
    from tokios.sampling_params import SamplingParams

    defaults = sampling_defaults.from_args(args, resolve_model_path(args.model))
    return SamplingParams(**defaults.apply({"max_tokens": args.max_tokens, "seed": args.seed}))


def load_engine(args: argparse.Namespace, err: TextIO = sys.stderr, *, for_chat: bool = False):
    """EngineCore for the model flags; reports where the model came from and how long it took
    (and, for a load past a couple of seconds, what it is doing: load_progress.py). The caller
    closes it (close_engine): a parallel group's ranks are processes of their own. for_chat: the
    caller renders chat messages, so a model without a chat template (and no --chat-template) is
    refused before it loads, with the error the template would give after."""
    # Validate the flags before paying for torch and the model (callers validate sampling first).
    config = engine_config_from_args(args, model=args.model, seed=args.seed or 0)
    from tokios import load_progress
    from tokios.model_files import resolve_model_path

    path = resolve_model_path(config.load.model)
    if for_chat and config.load.chat_template is None:
        refuse_chat_without_template(path)
    started = time.perf_counter()
    with load_progress.reporting(load_progress.TerminalProgress(os.path.basename(os.path.normpath(path)), err)):
        with load_progress.phase("importing torch and the engine"):
            from tokios.engine import EngineCore

        core = EngineCore(config)
    total_seconds = time.perf_counter() - started
    # Every token takes a block slot in each KV group (a sliding group only within its window).
    capacity = core.kv.pool.num_blocks // len(core.kv.groups) * core.kv.block_size
    print(f"loaded {core.model_path} ({core.weight_format}) in {total_seconds:.2f} s "
          f"(weights {core.load_seconds:.2f} s); KV cache holds {capacity} tokens", file=err)
    return core


def refuse_chat_without_template(path: str) -> None:
    """The chat template's own refusal, raised from the file's metadata before any weight is read."""
    from tokios.tokenizer.tokenizer import has_chat_template, no_chat_template_error

    if not has_chat_template(path):
        raise no_chat_template_error()


def close_engine(core) -> None:
    """Write the prefix cache to its disk tier (--kv-cache-disk), so the next run starts warm, and
    stop a parallel group's ranks."""
    try:
        core.save_prefix_cache()
    finally:
        core.close()


@dataclass
class StreamResult:
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    ttft_seconds: float | None
    decode_seconds: float | None

    def stats_line(self) -> str:
        parts = [f"{self.num_prompt_tokens} prompt tokens", f"{self.num_output_tokens} generated"]
        if self.ttft_seconds:
            parts.append(f"TTFT {self.ttft_seconds * 1000:.0f} ms")
            parts.append(f"prompt {self.num_prompt_tokens / self.ttft_seconds:.1f} tok/s")
        if self.decode_seconds and self.num_output_tokens > 1:
            parts.append(f"decode {(self.num_output_tokens - 1) / self.decode_seconds:.1f} tok/s")
        parts.append(f"finish {self.finish_reason}")
        return ", ".join(parts)


_request_numbers = itertools.count(1)


def stream_completion(core, prompt_token_ids: list[int], params, out: TextIO,
                      should_stop: Callable[[], bool] | None = None) -> StreamResult:
    """Run one request to the end on `core`, writing each text delta to `out` as it comes.

    `should_stop` is asked between steps; when it answers True the request is aborted in the core
    (its KV blocks are freed) and the result holds the text written so far, finish reason "abort"."""
    from tokios.engine.output_processor import OutputProcessor

    request_id = f"cli-{next(_request_numbers)}"
    processor = OutputProcessor(core.tokenizer)
    requests = core.make_requests(request_id, prompt_token_ids, params)
    started = time.perf_counter()
    processor.add_request(request_id, None, prompt_token_ids, params)
    core.add_requests(requests)
    first_token_at = last_token_at = None
    final = None
    written: list[str] = []
    num_output_tokens = 0

    def result(text: str, num_output_tokens: int, finish_reason: str | None) -> StreamResult:
        return StreamResult(
            text=text, num_prompt_tokens=len(prompt_token_ids), num_output_tokens=num_output_tokens,
            finish_reason=finish_reason, ttft_seconds=None if first_token_at is None else first_token_at - started,
            decode_seconds=None if first_token_at is None else last_token_at - first_token_at)

    while core.has_unfinished:
        if should_stop is not None and should_stop():
            # Asked between steps, never inside one: the scheduler and the KV cache are consistent
            # here, so the abort frees every block the request holds.
            core.abort([sequence.request_id for sequence in requests])
            return result("".join(written), num_output_tokens, "abort")
        outputs, stopped = processor.process(core.step())
        core.abort(stopped)
        for output in outputs:
            completion = output.outputs[0]
            if completion.token_ids_delta:
                num_output_tokens += len(completion.token_ids_delta)
                last_token_at = time.perf_counter()
                first_token_at = first_token_at or last_token_at
            if completion.text_delta:
                written.append(completion.text_delta)
                out.write(completion.text_delta)
                out.flush()
            if output.finished:
                final = completion
    if final is None:
        raise InvalidRequestError("the engine finished without an output for the request", param="prompt")
    return result(final.text, len(final.token_ids), final.finish_reason)


def prompt_token_ids_for(core, messages: list[dict] | None, raw_text: str | None) -> list[int]:
    """Chat messages through the model's template, or plain text as is."""
    if messages is not None:
        rendered = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already wrote any BOS the model wants.
        return core.tokenizer.encode(rendered, add_special_tokens=False)
    return core.tokenizer.encode(raw_text)


def run(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise InvalidRequestError("the prompt is empty; give some text", param="prompt")
    params = sampling_params_from_args(args)
    if args.raw and args.system is not None:
        raise InvalidRequestError("--system needs the chat template; drop --raw", param="system")
    core = load_engine(args, for_chat=not args.raw)
    try:
        if args.raw:
            token_ids = prompt_token_ids_for(core, None, args.prompt)
        else:
            messages = [{"role": "system", "content": args.system}] if args.system is not None else []
            messages.append({"role": "user", "content": args.prompt})
            token_ids = prompt_token_ids_for(core, messages, None)
        result = stream_completion(core, token_ids, params, sys.stdout)
    finally:
        close_engine(core)
    if not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(result.stats_line(), file=sys.stderr)
    return 0
