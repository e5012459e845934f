"""`tokios bench compare`: the same streaming load against `tokios serve` and `llama-server`.

Starts each server in turn on a free loopback port with the same GGUF, the same number of slots
(llama-server --parallel; tokios --max-num-seqs) and the same context per slot, runs the
serve.py sweep against it, reads its peak resident memory, and tears it down before the next
one starts, so the two never share the CPU. With --repeats the servers alternate for that many
rounds, in ABBA order (this machine drifts by up to 30% over minutes, so one round can favour
either side); the tables then show each level's median round, and a second table gives every
round's ratio and their median. Prints both full tables and a ratio table; --json, --plot-dir
and --write-docs as for the other bench commands. The llama-server binary comes from
peers.find_llama_server (given, cached, on PATH, or built once from the llama-cpp-python sdist).
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table
from tokios.tools.bench.serve import (add_load_arguments, build_requests, load_from_args, resolve_concurrencies,
                                      run_sweep)
from tokios.tools.bench.stats import ServeSummary, ratio

SECTION = "Serving"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--parallel", type=int, default=None,
                        help="slots on both servers (default: the largest concurrency)")
    add_server_pair_arguments(parser, ctx_per_slot=2048)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds, the servers alternating; tables show each level's median round")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")
    add_load_arguments(parser)


def add_server_pair_arguments(parser: argparse.ArgumentParser, *, ctx_per_slot: int) -> None:
    """How tokios serve and llama-server are started side by side (also bench fairness)."""
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary (default: cached build, PATH, or build it once)")
    parser.add_argument("--servers", default="tokios,llama.cpp", help="which of tokios,llama.cpp to run")
    parser.add_argument("--ctx-per-slot", type=int, default=ctx_per_slot, help="context tokens per slot on both servers")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads")
    parser.add_argument("--dtype", default="auto", help="tokios serve --dtype")
    parser.add_argument("--tokios-args", default="", help="extra arguments for tokios serve (one string)")
    parser.add_argument("--llama-server-args", default="", help="extra arguments for llama-server (one string)")


def tokios_command(args: argparse.Namespace, model_path: str, port: int, num_slots: int, *,
                   kv_cache_bytes: int | None = None, kv_cache_dtype: str = "bfloat16") -> list[str]:
    # By default the same context capacity as llama-server's 16-bit cache: a bfloat16 cache of the same size.
    if kv_cache_bytes is None:
        kv_cache_bytes = num_slots * args.ctx_per_slot * kv_bytes_per_token(model_path, "bfloat16")
    return [sys.executable, "-m", "tokios.cli", "serve", "--model", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", args.dtype, "--max-num-seqs", str(num_slots),
            "--max-model-len", str(args.ctx_per_slot), "--kv-cache-memory", str(kv_cache_bytes),
            "--kv-cache-dtype", kv_cache_dtype,
            *shlex.split(args.tokios_args)]


def llama_server_command(args: argparse.Namespace, binary: str, model_path: str, port: int,
                         num_slots: int) -> list[str]:
    # -c is the whole context; --no-kv-unified splits it evenly, so each slot owns ctx_per_slot.
    return [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(num_slots),
            "-t", str(args.threads), "-tb", str(args.threads), "-c", str(num_slots * args.ctx_per_slot),
            "--no-kv-unified", "--no-webui", *llama_machine_arguments(), *shlex.split(args.llama_server_args)]


def llama_machine_arguments() -> list[str]:
    """llama.cpp arguments this machine needs to run at all. On a CPU with AMX, a -DGGML_NATIVE
    build repacks weights for AMX and llama-server crashes (SIGSEGV in ggml_backend_amx_mul_mat,
    llama.cpp 0.3.36 in a VM on a Sapphire Rapids Xeon); --no-repack keeps it on its AVX-512 kernels."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            has_amx = " amx_int8" in cpuinfo.read()
    except OSError:
        has_amx = False
    return ["--no-repack"] if has_amx else []


# llama.cpp's cache types (-ctk/-ctv): q8_0 stores 32 values in 34 bytes (an fp16 scale each).
LLAMA_CACHE_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


def kv_bytes_per_token(model_path: str, kv_dtype: str | float) -> int:
    """KV bytes of one token (kv_cache/dtypes.py kv_bytes_per_token), of a tokios KV dtype (int8's
    scales included) or of a given bytes per element, for the model file's shape."""
    from tokios.kv_cache.dtypes import kv_bytes_per_element, kv_bytes_per_token as bytes_per_token
    from tokios.model.shape import read_model_shape

    shape = read_model_shape(model_path)
    bytes_per_element = kv_dtype if isinstance(kv_dtype, float) else kv_bytes_per_element(kv_dtype, shape.head_dim)
    return round(bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, bytes_per_element))


def ratio_table(tokios: list[ServeSummary], llama: list[ServeSummary]) -> str:
    rows = []
    for ours, theirs in zip(tokios, llama):
        rows.append([
            ours.label,
            f"{fmt(ours.output_throughput)} / {fmt(theirs.output_throughput)}",
            fmt_ratio(ratio(ours.output_throughput, theirs.output_throughput)),
            f"{fmt(ours.ttft.median_ms)} / {fmt(theirs.ttft.median_ms)}",
            f"{fmt(ours.tpot.median_ms)} / {fmt(theirs.tpot.median_ms)}",
            f"{fmt(ours.tpot.p95_ms)} / {fmt(theirs.tpot.p95_ms)}",
            fmt_ratio(ratio(ours.tpot.p95_ms, theirs.tpot.p95_ms)),
            f"{ours.num_failed} / {theirs.num_failed}",
        ])
    return markdown_table(["load", "output tok/s tokios / llama.cpp", "throughput ratio",
                           "TTFT p50 ms", "TPOT p50 ms", "TPOT p95 ms", "TPOT p95 ratio", "failed"], rows)


def median_round(rounds: list[list[ServeSummary]]) -> list[ServeSummary]:
    """Per level, the round with the median output throughput (the lower middle of an even count)."""
    return [sorted(level, key=lambda s: s.output_throughput)[(len(level) - 1) // 2] for level in zip(*rounds)]


def round_ratio_table(tokios_rounds: list[list[ServeSummary]], llama_rounds: list[list[ServeSummary]]) -> str:
    """Every round's output throughput ratio per level, and their median."""
    rows = []
    for level, (ours, theirs) in enumerate(zip(zip(*tokios_rounds), zip(*llama_rounds))):
        ratios = [ratio(a.output_throughput, b.output_throughput) for a, b in zip(ours, theirs)]
        measured = [r for r in ratios if not math.isnan(r)]  # NaN: a round where a side failed
        rows.append([ours[0].label, *(fmt_ratio(r) for r in ratios),
                     fmt_ratio(statistics.median(measured) if measured else math.nan)])
    return markdown_table(["load", *(f"round {i + 1}" for i in range(len(tokios_rounds))), "median"], rows)


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.peers import (ServerProcess, find_llama_server, free_port, benchmark_model_path,
                                          load_prompt_codec)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in ("tokios", "llama.cpp") for s in servers):
        raise InvalidRequestError(f"servers must be a subset of tokios,llama.cpp, got {args.servers!r}",
                                  param="servers")
    if args.repeats < 1:
        raise InvalidRequestError(f"repeats must be at least 1, got {args.repeats}", param="repeats")
    concurrencies = resolve_concurrencies(args.concurrency, args.request_rate)
    num_slots = args.parallel or max(c or args.num_prompts for c in concurrencies)
    model_path = benchmark_model_path(args)
    requests = build_requests(load_from_args(args, "http://127.0.0.1", None), load_prompt_codec(model_path))
    binary = find_llama_server(args.llama_server) if "llama.cpp" in servers else None

    name_to_rounds: dict[str, list[list[ServeSummary]]] = {name: [] for name in servers}
    name_to_peak_rss: dict[str, int] = {name: 0 for name in servers}
    for round_index in range(args.repeats):
        # ABBA order: a drift of the machine over the run then weighs on both sides alike.
        for name in (servers if round_index % 2 == 0 else servers[::-1]):
            port = free_port()
            command = (tokios_command(args, model_path, port, num_slots) if name == "tokios"
                       else llama_server_command(args, binary, model_path, port, num_slots))
            print(f"round {round_index + 1}/{args.repeats}, starting {name}: {' '.join(command)}", file=sys.stderr)
            with ServerProcess(name, command, port).start(timeout_s=args.startup_timeout) as server:
                load = load_from_args(args, server.base_url, None)
                name_to_rounds[name].append(run_sweep(load, requests, concurrencies=concurrencies,
                                                      request_rate=args.request_rate, num_warmups=args.num_warmups,
                                                      show_progress=args.show_progress, label_prefix=""))
                name_to_peak_rss[name] = max(name_to_peak_rss[name], server.peak_rss_bytes())
    name_to_summaries = {name: median_round(rounds) for name, rounds in name_to_rounds.items()}

    parts = []
    for name, summaries in name_to_summaries.items():
        parts.append(report.serve_table(summaries, title=f"{name} (peak RSS "
                                        f"{name_to_peak_rss[name] / 2**20:.0f} MiB)"))
    if len(name_to_summaries) == 2:
        title = "**tokios / llama.cpp**" + (" (each level's median round)" if args.repeats > 1 else "")
        parts.append(title + "\n\n" + ratio_table(name_to_summaries["tokios"], name_to_summaries["llama.cpp"]))
        if args.repeats > 1:
            parts.append("**Output throughput ratio, every round**\n\n"
                         + round_ratio_table(name_to_rounds["tokios"], name_to_rounds["llama.cpp"]))
    text = "\n\n".join(parts)
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(), "num_slots": num_slots,
            "peak_rss_bytes": name_to_peak_rss,
            "servers": {n: [s.to_dict() for s in ss] for n, ss in name_to_summaries.items()},
            "rounds": {n: [[s.to_dict() for s in ss] for ss in rounds] for n, rounds in name_to_rounds.items()}})
    if args.plot_dir:
        for path in report.plot_serve(name_to_summaries, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"Both servers serve the same GGUF with {num_slots} slots of {args.ctx_per_slot} tokens "
                f"(llama-server `--parallel {num_slots} -t {args.threads}`), one after the other, never at the "
                f"same time, alternating for {args.repeats} round(s). Load: {args.num_prompts} streamed {args.endpoint} requests per level, "
                f"prompts {args.input_len} tokens, outputs {args.output_len} tokens (EOS ignored), "
                f"temperature 0. TTFT/TPOT as `vllm bench serve` defines them.\n\n{text}")
        report.update_docs_section(args.write_docs, SECTION, body)
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0 if all(s.num_failed == 0 for rounds in name_to_rounds.values() for ss in rounds for s in ss) else 1
