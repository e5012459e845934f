"""`tokios generate` and `tokios chat` as a user runs them: real processes on the real model.

generate at --temperature 0 streams exactly the engine's greedy text to stdout and its figures (load time, TTFT,
prompt and decode tok/s) to stderr; chat reads turns from a pipe, keeps the conversation (the
second turn's prompt holds the first turn and its reply), and stops at /exit or end of input.
A load shows its phases on stderr when told to show every one; a chat with a model that has no
chat template is refused before the model loads, and --chat-template makes it work.
Process failures (missing model, bad flags) are covered in test_load_errors.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tokios.gguf_file import GGUFFile
from tokios.load_progress import DELAY_ENVIRONMENT_VARIABLE
from tokios.model_files import default_model_path, gemma3_model_path
from tokios.sampling_params import SamplingParams

MAX_TOKENS = 6


def run_cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokios.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


# Every load shows its phases (by default only a load past two seconds does).
SHOW_EVERY_PHASE = {DELAY_ENVIRONMENT_VARIABLE: "0"}


def test_generate_raw_streams_the_engines_greedy_text_and_reports_figures(engine_float32):
    prompt = "The capital of France is"
    (expected,) = engine_float32.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    result = run_cli("generate", prompt, "--raw", "--dtype", "float32", "--temperature", "0",
                     "--max-tokens", str(MAX_TOKENS), env=SHOW_EVERY_PHASE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == expected.outputs[0].text.rstrip("\n")
    assert re.search(r"loaded .+ \(float32\) in [0-9.]+ s", result.stderr)
    # The load's phases, as plain lines (stderr is a pipe here), before the summary line.
    weights_bytes = sum(info.num_bytes for info in GGUFFile(default_model_path()).tensors.values())
    phases = result.stderr.split("\nloaded ")[0]
    assert "\r" not in phases
    assert re.search(rf"^loading {re.escape(default_model_path().name)}: reading weights: \d+ / "
                     rf"{weights_bytes / 2**20:.0f} MiB \(\d+ s\)$", phases, re.MULTILINE), result.stderr
    assert "preparing the KV cache" in phases
    stats = result.stderr.strip().splitlines()[-1]
    assert f"{len(expected.prompt_token_ids)} prompt tokens" in stats
    assert f"{len(expected.outputs[0].token_ids)} generated" in stats
    assert re.search(r"TTFT [0-9]+ ms, prompt [0-9.]+ tok/s", stats), stats
    if len(expected.outputs[0].token_ids) > 1:
        assert re.search(r"decode [0-9.]+ tok/s", stats), stats


def test_generate_applies_the_chat_template_by_default(engine_float32):
    tokenizer = engine_float32.tokenizer
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is gravity?"}])
    num_prompt_tokens = len(tokenizer.encode(rendered, add_special_tokens=False))
    result = run_cli("generate", "What is gravity?", "--dtype", "float32", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert f"{num_prompt_tokens} prompt tokens" in result.stderr
    assert result.stdout.strip()


def test_generate_takes_the_engine_flags_and_tensor_parallel_keeps_the_text():
    """The engine's flags are every engine-building command's (engine_flags.py): three
    ranks splitting each layer give the single process's greedy text, and the ranks stop with it."""
    prompt = ["generate", "The capital of France is", "--raw", "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    single = run_cli(*prompt)
    parallel = run_cli(*prompt, "--tensor-parallel-size", "3")
    assert single.returncode == 0, single.stderr
    assert parallel.returncode == 0, parallel.stderr
    assert parallel.stdout == single.stdout and single.stdout.strip()


def test_chat_keeps_the_conversation_and_stops_at_exit():
    turns = "My name is Ola.\n\nWhat is my name?\n/exit\nThis line is never read.\n"
    result = run_cli("chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--stats",
                     stdin=turns)
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    assert len(replies) == 2 and all(reply.strip() for reply in replies), result.stdout
    prompt_sizes = [int(n) for n in re.findall(r"^(\d+) prompt tokens", result.stderr, re.MULTILINE)]
    generated = [int(n) for n in re.findall(r"(\d+) generated", result.stderr)]
    assert len(prompt_sizes) == 2, result.stderr
    # The second prompt holds the first turn, its reply and the new question.
    assert prompt_sizes[1] > prompt_sizes[0] + generated[0]


def test_chat_with_a_model_without_a_template_is_refused_before_it_loads():
    """Gemma 3 270M (pretrained) has no chat template: the refusal the template gives after a
    load comes from the file's metadata, before any phase of the load starts."""
    result = run_cli("chat", "--model", str(gemma3_model_path()), stdin="Hi\n", env=SHOW_EVERY_PHASE)
    assert result.returncode == 1
    assert "tokios chat: error: this model has no chat template" in result.stderr
    assert "--chat-template" in result.stderr
    assert "loading " not in result.stderr and "loaded " not in result.stderr, result.stderr
    generate = run_cli("generate", "Hi", "--model", str(gemma3_model_path()), env=SHOW_EVERY_PHASE)
    assert generate.returncode == 1 and "loaded " not in generate.stderr
    assert generate.stderr.replace("tokios generate:", "tokios chat:") == result.stderr


def test_a_chat_template_flag_lets_a_model_without_one_chat():
    result = run_cli("generate", "Name a colour.", "--model", str(gemma3_model_path()), "--chat-template", "gemma",
                     "--max-tokens", "2", "--max-model-len", "512")
    assert result.returncode == 0, result.stderr
    assert "loaded " in result.stderr and re.search(r"^\d+ prompt tokens", result.stderr, re.MULTILINE)


def test_chat_ends_at_end_of_input():
    result = run_cli("chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", "2", stdin="Hi\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1
