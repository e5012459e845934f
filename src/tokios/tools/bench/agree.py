"""`tokios bench agree`: does llama.cpp's llama-server, on the same GGUF, give tokios's greedy text?

A second opinion on a model's arithmetic from the peer users compare us with (the tests compare
against transformers). Starts `tokios serve` and then llama-server on the same file, one after
the other, sends each the same raw completion prompts at temperature 0 (EOS ignored, a fixed
number of tokens), and reports per prompt whether the continuations are identical and, where
they are not, how many tokens (tokios's tokenizer) they share before they part. Both servers
compute in their own formats (llama.cpp quantizes activations to 8 bits for its block products;
tokios as its kernels do), so a continuation may part at a near-tie; the report prints the
texts where they part so a reader can judge.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from tokios.errors import InvalidRequestError

PROMPTS = (
    "The capital of France is",
    "def quicksort(items):\n",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# Compute the mean of each column\n",
    "Water boils at a temperature of",
    "Die Hauptstadt von Deutschland ist",
    "Q: What is 17 times 23?\nA:",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.compare import add_server_pair_arguments
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser)
    add_server_pair_arguments(parser, ctx_per_slot=1024)
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (EOS ignored)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)


def served_model(base_url: str) -> str:
    response = httpx.get(f"{base_url}/v1/models", timeout=60.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def complete(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "stream": False}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600.0)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def shared_tokens(tokenizer, ours: str, theirs: str) -> int:
    """Tokens (tokios's tokenizer on tokios's text) before the texts part."""
    common = 0
    while common < min(len(ours), len(theirs)) and ours[common] == theirs[common]:
        common += 1
    ids = tokenizer.encode(ours, add_special_tokens=False)
    for num_tokens in range(len(ids)):
        if len(tokenizer.decode(ids[:num_tokens + 1])) > common:
            return num_tokens
    return len(ids)


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.compare import llama_server_command, tokios_command
    from tokios.tools.bench.offline import machine_line
    from tokios.tools.bench.peers import ServerProcess, benchmark_model_path, find_llama_server, free_port
    from tokios.tokenizer import Tokenizer

    if args.servers != "tokios,llama.cpp":
        raise InvalidRequestError(f"bench agree always runs both servers, got --servers {args.servers!r}",
                                  param="servers")
    if args.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {args.max_tokens}", param="max_tokens")
    model_path = benchmark_model_path(args)
    binary = find_llama_server(args.llama_server)
    texts: dict[str, list[str]] = {}
    for name in ("tokios", "llama.cpp"):
        port = free_port()
        command = (tokios_command(args, model_path, port, 1) if name == "tokios"
                   else llama_server_command(args, binary, model_path, port, 1))
        print(f"starting {name}: {' '.join(command)}", file=sys.stderr)
        with ServerProcess(name, command, port).start(timeout_s=args.startup_timeout) as server:
            model = served_model(server.base_url)
            texts[name] = [complete(server.base_url, model, prompt, args.max_tokens) for prompt in PROMPTS]
    tokenizer = Tokenizer.from_gguf_file(model_path)
    num_identical = 0
    lines = [f"Greedy continuations of {len(PROMPTS)} prompts, {args.max_tokens} tokens each, EOS ignored: "
             f"tokios serve --dtype {args.dtype} and llama-server on {model_path}. Measured {machine_line()}.", ""]
    for prompt, ours, theirs in zip(PROMPTS, texts["tokios"], texts["llama.cpp"]):
        if ours == theirs:
            num_identical += 1
            lines.append(f"- identical: {prompt!r} -> {ours[:60]!r}...")
        else:
            shared = shared_tokens(tokenizer, ours, theirs)
            lines.append(f"- part after {shared} tokens: {prompt!r}\n    tokios:    {ours!r}\n    llama.cpp: {theirs!r}")
    lines.insert(1, f"{num_identical} of {len(PROMPTS)} identical.")
    print("\n".join(lines))
    return 0
