"""`tokios bench capacity`: how many long-context streams one KV cache memory serves at once,
tokios with a bfloat16 and an int8 cache against llama-server with f16 and q8_0 caches.

Every server gets the same --kv-memory for its KV cache. tokios gets it as --kv-cache-memory
(its paged blocks go to whichever requests need them); llama-server as slots of --context tokens
each (-c slots x context, --no-kv-unified), as many as its cache type fits in the memory
(llama.cpp reserves a slot's whole context up front). Then --requests requests, each a distinct
prompt that with its --output reply fills --context tokens, arrive at once. Reported per
server: the streams the memory holds by each one's own arithmetic, the most requests it ran at
once (its /metrics, polled: tokios:num_requests_running, llamacpp:requests_processing), tokios'
preemptions (a request evicted for lack of blocks, recomputed later), aggregate output tok/s
and each stream's TTFT and time per output token. Servers run one after the other on the same
GGUF, never sharing the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field

import httpx

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.prompts import LengthSpec, make_prompt
from tokios.tools.bench.report import fmt, markdown_table
from tokios.tools.bench.serve import BenchRequest, ServeLoad, _client, discover_model, send_one
from tokios.tools.bench.stats import RequestRecord, summarize_serve

SECTION = "Capacity: long-context streams in a fixed KV memory"
BLOCK_SIZE = 16  # tokios serve's default --block-size
# Tokens each prompt leaves free beyond its reply: the completion endpoint's BOS, and rounding in
# the prompt maker.
PROMPT_MARGIN = 16
RUNNING_METRIC = {"tokios": "tokios:num_requests_running", "llama.cpp": "llamacpp:requests_processing"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary (default: cached build, PATH, or build it once)")
    parser.add_argument("--variants", default="tokios:bfloat16,tokios:int8,llama.cpp:f16,llama.cpp:q8_0",
                        help="server:cache-type pairs to run (default: all four)")
    parser.add_argument("--kv-memory", default="256MiB", help="KV cache memory every server gets (default 256MiB)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of each stream: prompt + reply")
    parser.add_argument("--output", type=int, default=128, help="reply tokens of each stream (EOS ignored)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests sent at once (default: two more than the largest capacity)")
    parser.add_argument("--dtype", default="auto", help="tokios serve --dtype")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")


@dataclass(frozen=True)
class Variant:
    server: str  # tokios | llama.cpp
    cache_type: str  # tokios --kv-cache-dtype, or llama.cpp -ctk/-ctv

    @property
    def label(self) -> str:
        return f"{self.server} {self.cache_type}"


def parse_variants(text: str) -> list[Variant]:
    from tokios.kv_cache.dtypes import ENGINE_KV_DTYPES
    from tokios.tools.bench.compare import LLAMA_CACHE_TYPE_BYTES

    allowed = {"tokios": ENGINE_KV_DTYPES, "llama.cpp": tuple(LLAMA_CACHE_TYPE_BYTES)}
    variants = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        server, _, cache_type = item.partition(":")
        if server not in allowed or cache_type not in allowed[server]:
            choices = ", ".join(f"{s}:{c}" for s, types in allowed.items() for c in types)
            raise InvalidRequestError(f"variants: {item!r} is not one of {choices}", param="variants")
        variants.append(Variant(server, cache_type))
    if not variants:
        raise InvalidRequestError("variants lists nothing to run", param="variants")
    return variants


def streams_that_fit(variant: Variant, kv_memory: int, bytes_per_token: int, context: int) -> int:
    """Whole --context streams in kv_memory by the server's own allocation: tokios in blocks of
    BLOCK_SIZE tokens shared by all requests, llama.cpp in slots of `context` tokens."""
    if variant.server == "tokios":
        tokens = kv_memory // (bytes_per_token * BLOCK_SIZE) * BLOCK_SIZE
        return tokens // (math.ceil(context / BLOCK_SIZE) * BLOCK_SIZE)
    return kv_memory // (bytes_per_token * context)


@dataclass
class CapacityRound:
    variant: Variant
    bytes_per_token: int
    fits: int
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    peak_running: int = 0
    preemptions: float | None = None
    error: str = ""


def metric_value(text: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples (any labels), None if absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([-+0-9.eE]+|NaN)\s*$", re.MULTILINE)
    values = [float(v) for v in pattern.findall(text)]
    return sum(values) if values else None


async def poll_running(client: httpx.AsyncClient, url: str, name: str, done: asyncio.Event) -> int:
    peak = 0
    while not done.is_set():
        try:
            value = metric_value((await client.get(url)).text, name)
            peak = max(peak, int(value or 0))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return peak


async def run_round(base_url: str, result: CapacityRound, prompts: list[str], output: int) -> None:
    load = ServeLoad(base_url=base_url, endpoint="completions", num_prompts=len(prompts),
                     input_len=LengthSpec(1, 1), output_len=LengthSpec(output, output), timeout_s=3600.0)
    metrics_url = load.root_url + "/metrics"
    async with _client(load, len(prompts) + 4) as client:
        model = await discover_model(client, load)
        await send_one(client, load, model, BenchRequest("Hello", 4, 1))  # warm-up
        preemptions_before = metric_value((await client.get(metrics_url)).text, "tokios:num_preemptions_total")
        done = asyncio.Event()
        poller = asyncio.create_task(poll_running(client, metrics_url, RUNNING_METRIC[result.variant.server], done))
        started = time.perf_counter()
        result.records = await asyncio.gather(*(send_one(client, load, model, BenchRequest(p, output, 0))
                                                for p in prompts))
        result.duration_s = time.perf_counter() - started
        done.set()
        result.peak_running = await poller
        if preemptions_before is not None:
            after = metric_value((await client.get(metrics_url)).text, "tokios:num_preemptions_total")
            result.preemptions = (after or 0) - preemptions_before
    errors = [r.error for r in result.records if not r.is_success]
    if errors:
        result.error = errors[0]


def result_table(rounds: list[CapacityRound], context: int) -> str:
    rows = []
    for r in rounds:
        summary = summarize_serve(r.variant.label, r.records, r.duration_s) if r.records and r.duration_s else None
        ok = summary is not None and summary.num_completed > 0
        rows.append([r.variant.label, f"{r.bytes_per_token:,}", str(r.fits), str(r.peak_running),
                     "-" if r.preemptions is None else f"{r.preemptions:.0f}",
                     fmt(summary.output_throughput) if ok else "-",
                     fmt(summary.ttft.median_ms / 1000, 1) if ok else "-",
                     fmt(summary.ttft.p99_ms / 1000, 1) if ok else "-",
                     fmt(summary.tpot.median_ms) if ok else "-",
                     str(summary.num_failed if summary else len(r.records))])
    return markdown_table(["server, KV cache", "KV bytes / token", f"{context}-token streams that fit",
                           "most running at once", "preemptions", "output tok/s", "TTFT p50 s", "TTFT p99 s",
                           "TPOT p50 ms", "failed"], rows)


def run(args: argparse.Namespace) -> int:
    from tokios.config import parse_size
    from tokios.tools.bench.compare import (LLAMA_CACHE_TYPE_BYTES, kv_bytes_per_token, llama_machine_arguments,
                                            tokios_command)
    from tokios.tools.bench.peers import (ServerProcess, benchmark_model_path, find_llama_server, free_port,
                                          load_prompt_codec)

    variants = parse_variants(args.variants)
    kv_memory = parse_size(args.kv_memory, field_name="kv_memory")
    if not 0 < args.output < args.context - PROMPT_MARGIN:
        raise InvalidRequestError(f"output {args.output} must be within (0, context - {PROMPT_MARGIN})",
                                  param="output")
    model_path = benchmark_model_path(args)
    bytes_per_token = {
        v: kv_bytes_per_token(model_path, v.cache_type if v.server == "tokios" else LLAMA_CACHE_TYPE_BYTES[v.cache_type])
        for v in variants}
    fits = {v: streams_that_fit(v, kv_memory, bytes_per_token[v], args.context) for v in variants}
    for v in variants:
        if fits[v] < 1:
            raise InvalidRequestError(f"kv_memory {args.kv_memory} holds no {args.context}-token stream for "
                                      f"{v.label} ({bytes_per_token[v]} bytes a token)", param="kv_memory")
    num_requests = args.requests or max(fits.values()) + 2
    codec = load_prompt_codec(model_path)
    rng = random.Random(args.seed)
    prompts = [make_prompt(args.context - args.output - PROMPT_MARGIN, rng, codec) for _ in range(num_requests)]
    binary = find_llama_server(args.llama_server) if any(v.server == "llama.cpp" for v in variants) else None

    rounds = []
    for variant in variants:
        port = free_port()
        if variant.server == "tokios":
            compare_args = argparse.Namespace(ctx_per_slot=args.context, dtype=args.dtype, tokios_args="")
            command = tokios_command(compare_args, model_path, port, num_requests, kv_cache_bytes=kv_memory,
                                     kv_cache_dtype=variant.cache_type)
        else:
            slots = fits[variant]
            # Quantized V caches need flash attention in llama.cpp; f16 runs with it too, so both match.
            command = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "--parallel",
                       str(slots), "-c", str(slots * args.context), "--no-kv-unified", "-t", str(args.threads),
                       "-tb", str(args.threads), "-ctk", variant.cache_type, "-ctv", variant.cache_type,
                       "-fa", "on", "--metrics", "--no-webui", *llama_machine_arguments()]
        result = CapacityRound(variant, bytes_per_token[variant], fits[variant])
        print(f"{variant.label}: {' '.join(command)}", file=sys.stderr)
        with ServerProcess(variant.label, command, port).start(timeout_s=args.startup_timeout) as server:
            asyncio.run(run_round(server.base_url, result, prompts, args.output))
        done = [r for r in result.records if r.is_success]
        print(f"  most running at once {result.peak_running}, {len(done)}/{num_requests} completed in "
              f"{result.duration_s:.1f} s" + (f"; failed: {result.error}" if result.error else ""), file=sys.stderr)
        rounds.append(result)

    text = result_table(rounds, args.context)
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "rounds": [{"variant": r.variant.label, "bytes_per_token": r.bytes_per_token, "fits": r.fits,
                        "peak_running": r.peak_running, "preemptions": r.preemptions, "duration_s": r.duration_s,
                        "ttft_s": [x.ttft_s for x in r.records if x.is_success],
                        "tpot_s": [x.tpot_s for x in r.records if x.is_success], "error": r.error}
                       for r in rounds]})
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"Every server's KV cache gets {args.kv_memory}; {num_requests} requests arrive at once, each a "
                f"distinct prompt that with its {args.output}-token reply (EOS ignored) fills {args.context} tokens. "
                f"tokios shares its paged blocks among all requests; llama-server gets as many {args.context}-token "
                f"slots as its cache type fits (llama.cpp reserves a slot's whole context). 'Most running at once' "
                f"is each server's own gauge, polled every 0.2 s. One run per server, one after the other.\n\n{text}")
        report.update_docs_section(args.write_docs, SECTION, body)
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0 if all(not r.error for r in rounds) else 1
