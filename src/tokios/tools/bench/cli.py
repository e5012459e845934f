"""`tokios bench offline|serve|compare|prefix|fairness|restart|capacity|routing|agree|embed|agent|random-model`: wires the benchmark sub-commands to their modules.

Each module exposes `add_arguments(parser)` and `run(args) -> int`, like the top-level commands.
The modules keep torch, transformers and llama_cpp imports inside functions, so building this
parser stays cheap.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help)
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("tokios.tools.bench.offline",
                "single-stream decode/prefill and 64-prompt throughput: tokios vs llama.cpp and transformers"),
    "prefix": ("tokios.tools.bench.prefix",
               "TTFT with a warm vs a cold prefix cache (shared 1,000-token system prompt)"),
    "restart": ("tokios.tools.bench.restart",
                "TTFT of a 4,000-token prompt after a restart, with the prefix cache's disk tier and without"),
    "serve": ("tokios.tools.bench.serve", "streaming load generator against any OpenAI-compatible URL"),
    "compare": ("tokios.tools.bench.compare", "start tokios serve and llama-server, run the same load on both"),
    "capacity": ("tokios.tools.bench.capacity",
                 "long-context streams one KV memory serves at once: tokios bf16/int8 vs llama-server f16/q8_0"),
    "fairness": ("tokios.tools.bench.fairness",
                 "decoding streams' inter-token latency while a long prompt prefills: tokios vs llama-server"),
    "routing": ("tokios.tools.bench.routing",
                "prefix-aware against least-busy routing through real gateways, on shared system prompts"),
    "agree": ("tokios.tools.bench.agree",
              "llama-server's greedy text on the same GGUF against tokios's: identical, or where they part"),
    "embed": ("tokios.tools.bench.embed",
              "embeddings/s against llama-server --embedding, and chat streams' inter-token p99 beside an embedding load"),
    "agent": ("tokios.tools.bench.agent",
              "a scripted 20-turn agent session: prompt tokens recomputed per turn, tokios vs llama-server"),
    "random-model": ("tokios.tools.bench.random_model",
                     "a full-size random-weight model of an architecture no package ships, converted by llama.cpp"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    for name, (module_name, help_text) in BENCH_COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_bench_run=module.run)
    parser.set_defaults(_bench_parser=parser)


def run(args: argparse.Namespace) -> int:
    bench_run = getattr(args, "_bench_run", None)
    if bench_run is None:
        args._bench_parser.print_help()
        return 2
    return int(bench_run(args) or 0)
