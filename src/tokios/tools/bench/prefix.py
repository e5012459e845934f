"""`tokios bench prefix`: time to first token with a warm prefix cache vs a cold one.

Each rep makes a fresh 1,000-token "system prompt" (a start never seen before), sends it with one
user question (cold: nothing cached), then with another question (warm: the system prompt's
blocks are cached). The ratio cold / warm TTFT is the figure; the target is >= 5x. For tokios the
engine's prefix-cache hit counter is read around the warm request, so a "warm" figure that did not
hit the cache shows up as 0 hit tokens. llama.cpp (llama-cpp-python, which reuses the common prefix
of the previous prompt) runs the same prompts as a reference when it is installed.
"""

from __future__ import annotations

import argparse
import random
import sys

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.prompts import make_token_ids
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table
from tokios.tools.bench.stats import RepeatedFigure, ratio

SECTION = "Prefix caching"
TARGET_RATIO = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--dtype", default="auto", help="tokios --dtype")
    parser.add_argument("--system-prompt-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-llama-cpp", dest="with_llama_cpp", action="store_false",
                        help="skip the llama.cpp reference")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")


def _hit_tokens(system) -> int | None:
    llm = getattr(system, "llm", None)
    stats = llm.stats() if llm is not None and hasattr(llm, "stats") else None
    return getattr(stats, "prefix_cache_hits", None)


def measure(system, args: argparse.Namespace, codec) -> dict:
    rng = random.Random(args.seed)
    cold_s, warm_s, hit_tokens = [], [], []
    for rep in range(args.reps + 1):
        system_ids = make_token_ids(args.system_prompt_tokens, rng, codec)
        first_question = make_token_ids(args.question_tokens, rng, codec)
        second_question = make_token_ids(args.question_tokens, rng, codec)
        cold = system.first_token_s(system_ids + first_question)
        hits_before = _hit_tokens(system)
        warm = system.first_token_s(system_ids + second_question)
        hits_after = _hit_tokens(system)
        if rep == 0:
            continue  # warm-up
        cold_s.append(cold)
        warm_s.append(warm)
        if hits_before is not None and hits_after is not None:
            hit_tokens.append(hits_after - hits_before)
        print(f"rep {rep}: {system.name}: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms", file=sys.stderr)
    return {"cold_ttft_ms": RepeatedFigure.of([s * 1000 for s in cold_s]),
            "warm_ttft_ms": RepeatedFigure.of([s * 1000 for s in warm_s]),
            "warm_hit_tokens": hit_tokens}


def table(results: dict[str, dict]) -> str:
    rows = []
    for name, r in results.items():
        cold, warm = r["cold_ttft_ms"], r["warm_ttft_ms"]
        hits = r["warm_hit_tokens"]
        rows.append([name, f"{fmt(cold.median)} [{fmt(cold.p5)}, {fmt(cold.p95)}]",
                     f"{fmt(warm.median)} [{fmt(warm.p5)}, {fmt(warm.p95)}]",
                     fmt_ratio(ratio(cold.median, warm.median)),
                     f"{min(hits)}..{max(hits)}" if hits else "-"])
    return markdown_table(["system", "cold TTFT ms p50 [p5, p95]", "warm TTFT ms p50 [p5, p95]",
                           "cold / warm", "cached tokens per warm request"], rows)


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench import engines
    from tokios.tools.bench.peers import load_prompt_codec, resolve_model_path

    for name, minimum in (("reps", 1), ("system_prompt_tokens", 16), ("question_tokens", 1)):
        if getattr(args, name) < minimum:
            raise InvalidRequestError(f"{name} must be >= {minimum}, got {getattr(args, name)}", param=name)
    model_path = resolve_model_path(args.model)
    codec = load_prompt_codec(model_path)
    systems = [engines.TokiosSystem(model_path, dtype=args.dtype, enable_prefix_caching=True)]
    if args.with_llama_cpp:
        systems.append(engines.LlamaCppSystem(model_path, num_threads=args.threads))
    results = {system.name: measure(system, args, codec) for system in systems}
    text = table(results)
    print(text)
    tokios_ratio = ratio(results[systems[0].name]["cold_ttft_ms"].median,
                         results[systems[0].name]["warm_ttft_ms"].median)
    verdict = (f"tokios cold / warm = {tokios_ratio:.2f}x against a target of >= {TARGET_RATIO:.0f}x: "
               f"{'met' if tokios_ratio >= TARGET_RATIO else 'NOT met'}.")
    print(verdict)
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "results": {n: {k: (vars(v) if isinstance(v, RepeatedFigure) else v) for k, v in r.items()}
                        for n, r in results.items()}})
    if args.write_docs:
        write_docs(args, args.write_docs, text, verdict)
    return 0


def write_docs(args: argparse.Namespace, path: str, text: str, verdict: str) -> None:
    body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
            f"Each rep: a fresh {args.system_prompt_tokens}-token system prompt with a "
            f"{args.question_tokens}-token question (cold: nothing cached), then the same system prompt "
            f"with another question (warm). TTFT = time to the first token of a 1-token generation; median "
            f"of {args.reps} reps after one warm-up. llama.cpp (llama-cpp-python) reuses the common prefix "
            f"of its previous prompt, so it is shown as a reference.\n\n{text}\n\n{verdict}")
    report.update_docs_section(path, SECTION, body)
    print(f"updated {path}", file=sys.stderr)
