"""`tokios bench restart`: time to first token of a long prompt after a restart, with the prefix
cache's disk tier (--kv-cache-disk) and without.

Each rep makes a fresh --prompt-tokens prompt, runs it on an engine with a disk tier in a new
directory, closes that engine (the memory cache goes to disk, as a server does at shutdown), then
starts a new engine over the same directory (the restart) and times the first token of the same
prompt; a third engine without the tier gives the cold figure. Engines are in-process (LLM), so
the figure is the engine's TTFT without HTTP; the loads are outside the timing. The target is
cold / warm >= 5x. llama-server keeps no prompt cache across a restart: it is started, given the
prompt, restarted and timed on the same prompt (over HTTP, so its figure carries a request's
overhead, a millisecond or two here).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.prompts import make_token_ids
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table

SECTION = "Prefix cache across a restart"
TARGET_RATIO = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--dtype", default="auto", help="tokios --dtype")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--no-llama-cpp", dest="with_llama_cpp", action="store_false",
                        help="skip the llama-server reference")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary (default: cached build, PATH, or build it once)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")


def first_token_s(llm, prompt_ids: list[int]) -> float:
    from tokios.sampling_params import SamplingParams

    started = time.perf_counter()
    llm.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - started


def measure_tokios(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[float]]:
    from tokios.engine import LLM

    def engine(disk: str | None):
        return LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, kv_cache_disk=disk,
                   max_model_len=args.prompt_tokens + 64)

    warm, cold, hits = [], [], []
    for index, prompt in enumerate(prompts):
        with tempfile.TemporaryDirectory(prefix="tokios-kv-disk-") as directory:
            before = engine(directory)
            first_token_s(before, prompt)
            before.close()
            del before
            restarted = engine(directory)
            warm.append(first_token_s(restarted, prompt))
            hits.append(restarted.stats().disk_cache_hit_tokens)
            del restarted
        plain = engine(None)
        cold.append(first_token_s(plain, prompt))
        del plain
        print(f"rep {index + 1}: after a restart {warm[-1] * 1000:.0f} ms with the disk tier "
              f"({hits[-1]} tokens from disk), {cold[-1] * 1000:.0f} ms without", file=sys.stderr)
    return {"warm": warm, "cold": cold, "hits": hits}


def measure_llama_server(args: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    """llama-server keeps no prompt cache across a restart (slots can be saved by hand, not
    automatically): each prompt runs once, the server restarts, and the same prompt is timed."""
    import httpx

    from tokios.tools.bench.compare import llama_machine_arguments
    from tokios.tools.bench.peers import ServerProcess, find_llama_server, free_port, resolve_model_path

    binary, model_path = find_llama_server(args.llama_server), resolve_model_path(args.model)
    times = []
    for prompt in prompts:
        for attempt in ("before", "after a restart"):
            port = free_port()
            command = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
                       "-tb", str(args.threads), "-c", str(args.prompt_tokens + 64), "--no-webui",
                       *llama_machine_arguments()]
            with ServerProcess("llama.cpp", command, port).start() as server:
                started = time.perf_counter()
                response = httpx.post(f"{server.base_url}/completion", timeout=600,
                                      json={"prompt": prompt, "n_predict": 1, "temperature": 0.0})
                response.raise_for_status()
                if attempt != "before":
                    times.append(time.perf_counter() - started)
        print(f"llama-server after a restart: {times[-1] * 1000:.0f} ms", file=sys.stderr)
    return times


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.compare import llama_machine_arguments
    from tokios.tools.bench.peers import load_prompt_codec, resolve_model_path

    if args.reps < 1 or args.prompt_tokens < 32:
        raise InvalidRequestError("reps must be >= 1 and prompt_tokens >= 32", param="reps")
    codec = load_prompt_codec(resolve_model_path(args.model))
    rng = random.Random(args.seed)
    prompts = [make_token_ids(args.prompt_tokens, rng, codec) for _ in range(args.reps)]
    results = measure_tokios(args, prompts)
    llama = measure_llama_server(args, prompts) if args.with_llama_cpp else None
    ratios = [c / w for c, w in zip(results["cold"], results["warm"])]
    rows = [["tokios, disk tier, after a restart", fmt(statistics.median(results["warm"]) * 1000),
             f"{statistics.median(results['hits']):.0f}"],
            ["tokios, no disk tier, after a restart", fmt(statistics.median(results["cold"]) * 1000), "0"]]
    if llama:
        rows.append(["llama-server, after a restart (no prompt cache survives)",
                     fmt(statistics.median(llama) * 1000), "0"])
    text = (markdown_table([f"{args.prompt_tokens}-token prompt", "TTFT p50 ms", "tokens from disk"], rows)
            + f"\n\nCold / warm per rep: {', '.join(fmt_ratio(r) for r in ratios)}; median "
              f"{fmt_ratio(statistics.median(ratios))} (target >= {TARGET_RATIO:g}x).")
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {"command": report.command_line(), "machine": machine_line(),
                                           "tokios": results, "llama_cpp": llama})
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"Each rep: a fresh prompt runs on an engine with `--kv-cache-disk` in a new directory, the engine "
                f"closes (its memory cache goes to disk, as at server shutdown), a new engine starts over the same "
                f"directory and the first token of the same prompt is timed; an engine without the tier gives the "
                f"cold figure. In-process engines: TTFT without HTTP, model loads not timed. llama-server keeps no "
                f"prompt cache across a restart: it is started, given the prompt, restarted, and timed on the same "
                f"prompt over HTTP{' (with --no-repack: this CPU has AMX, whose path crashes it)' if llama_machine_arguments() else ''}."
                f"\n\n{text}")
        report.update_docs_section(args.write_docs, SECTION, body)
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0
