"""`tokios bench offline`: tokios vs llama.cpp and transformers in one process, one run.

Single stream: decode tok/s over a greedy 128-token continuation (EOS ignored) and prefill tok/s of
a 512-token prompt (prompt length / time to first token), repeated; the systems are interleaved rep
by rep so that the noise of a shared machine falls on all of them alike, and every prompt starts
differently so no prompt cache is reused. Throughput: 64 prompts, tokios all at once through
LLM.generate, llama.cpp one after another (its Python binding has no batching). Prints Markdown
tables with medians, p5/p95 and ratios; --write-docs puts them into docs/benchmarks.md with the
command line. The systems themselves are in engines.py; prompts in prompts.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys

from tokios.engine_flags import add_engine_arguments, engine_options
from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.prompts import make_token_ids
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table
from tokios.tools.bench.stats import RepeatedFigure, ratio

SYSTEM_NAMES = ("tokios", "llama.cpp", "transformers")
SINGLE_STREAM_SECTION = "Offline: single stream"
THROUGHPUT_SECTION = "Offline: throughput"
DECODE_PROMPT_TOKENS = 16
DEFAULT_LLAMA_CPP_THREADS = 2


def noise_note() -> str:
    """What the machine was doing, measured when the report is written (not assumed)."""
    try:
        load = f"load average {os.getloadavg()[0]:.1f} when the report was written"
    except OSError:
        load = "load average unknown"
    return (f"Machine {load}. Absolute numbers move with other work on the machine; the ratios come "
            "from one run with both systems taking turns, so they are the figures to compare.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser, model_help="GGUF file (default: the default model), or a Hugging Face directory "
                                           "when llama.cpp is not among --systems")
    parser.add_argument("--systems", default="tokios,llama.cpp,transformers",
                        help=f"comma-separated subset of {', '.join(SYSTEM_NAMES)}; llama.cpp runs with --threads "
                             f"threads (default {DEFAULT_LLAMA_CPP_THREADS})")
    parser.add_argument("--dtype", default="auto", help="tokios --dtype values, comma-separated (one row each)")
    # tokios runs as LLM does (no step budget: no stream waits on a batch run); --threads is
    # both systems' threads, so that they compare on the same cores.
    add_engine_arguments(parser, own=("dtype",), defaults={"max_step_ms": None})
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--transformers-reps", type=int, default=2,
                        help="reps for transformers, which decodes at ~10 tok/s here")
    parser.add_argument("--transformers-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--throughput-prompts", type=int, default=64, help="0 skips the throughput run")
    parser.add_argument("--throughput-input-len", type=int, default=128)
    parser.add_argument("--throughput-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH",
                        help="update the offline sections of this Markdown file (default docs/benchmarks.md)")


def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEM_NAMES]
    if not names or unknown:
        raise InvalidRequestError(f"systems must be a comma-separated subset of {SYSTEM_NAMES}, got {text!r}",
                                  param="systems")
    return names


def require_peers(systems: list[str], transformers_reps: int) -> None:
    """A one-line error naming the missing package of a peer, before any model loads."""
    import importlib.util

    from tokios.errors import TokiosError
    from tokios.tools.bench.peers import require_llama_cpp

    others = ",".join(s for s in systems if s != "llama.cpp")
    if "llama.cpp" in systems:
        try:
            require_llama_cpp()
        except TokiosError as exc:
            raise TokiosError(f"{exc}; or leave llama.cpp out: --systems {others or 'tokios'}") from None
    if "transformers" in systems and transformers_reps > 0 and importlib.util.find_spec("transformers") is None:
        others = ",".join(s for s in systems if s != "transformers")
        raise TokiosError("transformers is not installed: pip install 'tokios[test]'; or leave it out: "
                          f"--systems {others or 'tokios'}")


def load_systems(args: argparse.Namespace, model_path: str) -> list:
    from tokios.tools.bench import engines

    systems = []
    for name in parse_systems(args.systems):
        if name == "tokios":
            for dtype in [d.strip() for d in args.dtype.split(",") if d.strip()]:
                print(f"loading tokios --dtype {dtype} ...", file=sys.stderr)
                systems.append(engines.TokiosSystem(model_path, **engine_options(args, dtype=dtype)))
        elif name == "llama.cpp":
            print("loading llama.cpp ...", file=sys.stderr)
            systems.append(engines.LlamaCppSystem(model_path, num_threads=llama_cpp_threads(args)))
        elif args.transformers_reps > 0:
            print("loading transformers (about 25 s) ...", file=sys.stderr)
            systems.append(engines.TransformersSystem(model_path, dtype=args.transformers_dtype))
    return systems


def llama_cpp_threads(args: argparse.Namespace) -> int:
    """--threads, or 2 (the cores of the hosts the figures in docs/benchmarks.md come from)."""
    return args.num_threads or DEFAULT_LLAMA_CPP_THREADS


# system name -> "decode" | "prefill" -> rep number -> tok/s
RepSamples = dict[str, dict[str, dict[int, float]]]


def measure_single_stream(systems: list, args: argparse.Namespace, codec) -> RepSamples:
    rng = random.Random(args.seed)
    # One fresh prompt per (rep, system); +1 rep for the warm-up that is not counted.
    num_runs = (args.reps + 1) * len(systems)
    prefill_prompts = [make_token_ids(args.prefill_tokens, rng, codec) for _ in range(num_runs)]
    decode_prompts = [make_token_ids(DECODE_PROMPT_TOKENS, rng, codec) for _ in range(num_runs)]
    samples: RepSamples = {s.name: {"prefill": {}, "decode": {}} for s in systems}
    for rep in range(args.reps + 1):
        for index, system in enumerate(systems):
            if system.name.startswith("transformers") and rep > args.transformers_reps:
                continue
            run = rep * len(systems) + index
            num_decode = args.decode_tokens if rep > 0 else 8
            ttft_s = system.first_token_s(prefill_prompts[run])
            decode = system.decode(decode_prompts[run], num_decode)
            if rep == 0:
                continue  # warm-up: first calls pay for lazy initialisation and compilation
            samples[system.name]["prefill"][rep] = args.prefill_tokens / ttft_s
            samples[system.name]["decode"][rep] = decode.tokens_per_s
            print(f"rep {rep}: {system.name}: prefill {args.prefill_tokens / ttft_s:.1f} tok/s, "
                  f"decode {decode.tokens_per_s:.1f} tok/s", file=sys.stderr)
    return samples


def measure_throughput(systems: list, args: argparse.Namespace, codec) -> dict[str, dict[str, float]]:
    rng = random.Random(args.seed + 7)
    results = {}
    for system in systems:
        if not hasattr(system, "batch"):
            continue  # transformers: ~10 tok/s single stream, a batch run would take many minutes
        prompts = [make_token_ids(args.throughput_input_len, rng, codec) for _ in range(args.throughput_prompts)]
        print(f"throughput: {system.name}, {len(prompts)} prompts ...", file=sys.stderr)
        timing = system.batch(prompts, args.throughput_output_len)
        results[system.name] = {"num_prompts": len(prompts), "input_tokens": timing.num_input_tokens,
                                "output_tokens": timing.num_output_tokens, "wall_s": timing.wall_s,
                                "input_tok_s": timing.num_input_tokens / timing.wall_s,
                                "output_tok_s": timing.num_output_tokens / timing.wall_s}
    return results


def _peer_name(names, prefix: str) -> str | None:
    return next((n for n in names if n.startswith(prefix)), None)


def paired_ratio(ours: dict[int, float], theirs: dict[int, float]) -> RepeatedFigure:
    """Median of per-rep ratios, over the reps both systems ran.

    On a shared machine the load drifts between reps; a ratio taken within one rep sees nearly
    the same load on both sides, so its median is steadier than a ratio of two medians.
    """
    return RepeatedFigure.of([ratio(ours[rep], theirs[rep]) for rep in sorted(ours) if rep in theirs])


def single_stream_table(samples: RepSamples) -> str:
    llama = _peer_name(samples, "llama.cpp")
    hf = _peer_name(samples, "transformers")

    def ratio_cell(name: str, peer: str | None, kind: str) -> str:
        if peer is None:
            return "-"
        paired = paired_ratio(samples[name][kind], samples[peer][kind])
        return f"{fmt_ratio(paired.median)} [{fmt_ratio(paired.p5)}, {fmt_ratio(paired.p95)}]"

    rows = []
    for name, by_kind in samples.items():
        decode, prefill = (RepeatedFigure.of(list(by_kind[k].values())) for k in ("decode", "prefill"))
        rows.append([
            name, f"{fmt(decode.median)} [{fmt(decode.p5)}, {fmt(decode.p95)}]",
            f"{fmt(prefill.median)} [{fmt(prefill.p5)}, {fmt(prefill.p95)}]", str(decode.num_reps),
            ratio_cell(name, llama, "decode"), ratio_cell(name, llama, "prefill"), ratio_cell(name, hf, "decode"),
        ])
    return markdown_table(["system", "decode tok/s p50 [p5, p95]", "prefill tok/s p50 [p5, p95]", "reps",
                           "decode / llama.cpp", "prefill / llama.cpp", "decode / transformers"], rows)


def throughput_table(results: dict[str, dict[str, float]]) -> str:
    llama = _peer_name(results, "llama.cpp")
    rows = [[name, str(r["num_prompts"]), str(r["input_tokens"]), str(r["output_tokens"]), fmt(r["wall_s"], 2),
             fmt(r["input_tok_s"]), fmt(r["output_tok_s"]),
             fmt_ratio(ratio(r["output_tok_s"], results[llama]["output_tok_s"])) if llama else "-"]
            for name, r in results.items()]
    return markdown_table(["system", "prompts", "input tokens", "output tokens", "wall s", "input tok/s",
                           "output tok/s", "output / llama.cpp"], rows)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} CPUs"


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.peers import benchmark_model_path, load_prompt_codec

    for name, minimum in (("reps", 1), ("decode_tokens", 2), ("prefill_tokens", 1), ("transformers_reps", 0),
                          ("throughput_prompts", 0), ("throughput_input_len", 1), ("throughput_output_len", 1)):
        if getattr(args, name) < minimum:
            raise InvalidRequestError(f"{name} must be >= {minimum}, got {getattr(args, name)}", param=name)
    systems_named = parse_systems(args.systems)
    require_peers(systems_named, args.transformers_reps)  # before loading anything
    model_path = benchmark_model_path(args, directory_ok="llama.cpp" not in systems_named)
    codec = load_prompt_codec(model_path)
    if codec is None:
        raise InvalidRequestError("no tokenizer could read the model file for exact prompt lengths", param="model")
    systems = load_systems(args, model_path)
    figures = measure_single_stream(systems, args, codec)
    throughput = measure_throughput(systems, args, codec) if args.throughput_prompts > 0 else {}
    load_lines = "\n".join(f"- {s.name}: loaded in {s.load_s:.1f} s" for s in systems)
    single = single_stream_table(figures)
    print(single)
    print()
    print(load_lines)
    if throughput:
        print()
        print(throughput_table(throughput))
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "load_s": {s.name: s.load_s for s in systems},
            "single_stream_tok_s_by_rep": figures,
            "throughput": throughput})
    if args.write_docs:
        write_docs(args, args.write_docs, single, load_lines, throughput)
    return 0


def write_docs(args: argparse.Namespace, path: str, single: str, load_lines: str, throughput: dict) -> None:
    command = report.command_line()
    header = f"Command: `{command}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
    report.update_docs_section(path, SINGLE_STREAM_SECTION, header + (
        f"Decode: {args.decode_tokens} greedy tokens after a {DECODE_PROMPT_TOKENS}-token prompt, EOS ignored, "
        f"tok/s = (tokens - 1) / (last token time - first token time). Prefill: a {args.prefill_tokens}-token "
        "prompt / time to first token; every prompt starts differently, so no prompt cache is reused. "
        f"Median of {args.reps} reps (transformers: its first {args.transformers_reps}) after one warm-up, "
        "[p5, p95] in brackets. Ratios are medians of per-rep ratios over the reps both systems ran (the "
        "systems take turns within a rep, so a ratio sees nearly the same machine load on both sides). "
        f"llama.cpp runs with {llama_cpp_threads(args)} threads on the same GGUF.\n\n{single}\n\n{load_lines}"))
    if throughput:
        report.update_docs_section(path, THROUGHPUT_SECTION, header + (
            f"{args.throughput_prompts} prompts of {args.throughput_input_len} tokens, "
            f"{args.throughput_output_len} greedy output tokens each (EOS ignored). tokios gets all of them at "
            "once (`LLM.generate`, continuous batching); llama.cpp runs them one after another, as its Python "
            "binding does. transformers is left out (about 10 tok/s single stream).\n\n"
            + throughput_table(throughput)))
    print(f"updated {path}", file=sys.stderr)
