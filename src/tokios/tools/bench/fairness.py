"""`tokios bench fairness`: what one long prompt does to the streams already decoding, tokios
against llama-server.

--streams requests (default 8) decode long replies (--stream-output tokens, EOS ignored);
--long-after seconds after every stream has its first token, one --long-prompt-token prompt
arrives. For each server
the streams' inter-token latency (the gap between consecutive streamed chunks, assigned to the
window where the gap ends) is reported before the long prompt (from each stream's first token
to the long prompt's arrival) and during its prefill (from its arrival to its first
token), with the long prompt's own TTFT: the trade fair chunked prefill makes (`--max-step-ms`).

"Before" is not the same streams at the same point: while the long prompt is prefilled the
streams decode on, their contexts grow, and their own steps slow (8 streams' KV reads double
from 300 to 1,000 tokens of context). So each round also runs the streams alone (a control,
unless --no-control): "without" is their gaps at the very chunk positions that fell during the
prefill, the p99 the long prompt is to be compared with.

Servers run one after the other with the same GGUF, the same slots and the same context per
slot (compare.py's commands), never sharing the CPU; --tokios-step-budgets runs tokios once
per --max-step-ms value (auto,off compares fair chunking with the token budget alone; a value
may carry more server flags: 'auto,auto --no-prefill-layer-slices'). With
--repeats the servers alternate in ABBA order, and each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
from dataclasses import dataclass, field, replace

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.prompts import LengthSpec, make_prompt
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table
from tokios.tools.bench.serve import BenchRequest, ServeLoad, _client, discover_model, send_one
from tokios.tools.bench.stats import RequestRecord, percentile

SECTION = "Fairness: a long prompt among decoding streams"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.compare import add_server_pair_arguments
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser)
    add_server_pair_arguments(parser, ctx_per_slot=8192)
    parser.add_argument("--tokios-step-budgets", default="250,auto,off",
                        help="comma-separated --max-step-ms values; tokios runs once per value (default: the "
                             "server's default, auto and off: the trade); a value may carry more server flags, "
                             "as in 'auto,auto --no-prefill-layer-slices'")
    parser.add_argument("--streams", type=int, default=8, help="streams decoding when the long prompt arrives")
    parser.add_argument("--stream-prompt", type=int, default=128, help="each stream's prompt tokens")
    parser.add_argument("--stream-output", type=int, default=1024, help="each stream's reply tokens")
    parser.add_argument("--long-prompt", type=int, default=5500, help="the long prompt's tokens")
    parser.add_argument("--long-output", type=int, default=16, help="the long prompt's reply tokens")
    parser.add_argument("--long-after", type=float, default=3.0,
                        help="seconds after every stream has its first token that the long prompt arrives")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, the servers alternating (ABBA)")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="skip the rounds with the streams alone (the 'without it' column)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")


@dataclass(frozen=True)
class FairnessRound:
    """One server's run: the streams' gaps before and during the long prefill, in ms."""

    itl_before_ms: list[float]
    itl_during_ms: list[float]
    long_ttft_s: float
    streams_ended_early: int  # streams that finished before the long prompt's first token
    error: str = ""
    # Per stream, the indices of the chunks whose gaps fell during the prefill (gap_indices),
    # and the control's gaps at those indices (the streams alone).
    during_gap_indices: list[list[int]] = field(default_factory=list)
    itl_without_ms: list[float] = field(default_factory=list)

    def figure(self, name: str) -> float:
        values = {"before p50": (self.itl_before_ms, 50), "before p99": (self.itl_before_ms, 99),
                  "during p50": (self.itl_during_ms, 50), "during p99": (self.itl_during_ms, 99),
                  "during max": (self.itl_during_ms, 100), "without p99": (self.itl_without_ms, 99)}
        if name == "ttft":
            return self.long_ttft_s
        samples, q = values[name]
        return percentile(samples, q) if samples else math.nan


def gap_indices(streams: list[RequestRecord], start: float, end: float) -> list[list[int]]:
    """Per stream, the indices k >= 1 of the chunks whose gap from chunk k - 1 ends in [start,
    end). Gaps are between a stream's own chunks, so none includes its prompt's prefill."""
    return [[k for k in range(1, len(r.chunk_times)) if start <= r.chunk_times[k] < end] for r in streams]


def gaps_at(streams: list[RequestRecord], indices: list[list[int]]) -> list[float]:
    """The streams' gaps (ms) ending at those chunk indices, stream by stream (an index past a
    stream's end has no gap)."""
    return [(r.chunk_times[k] - r.chunk_times[k - 1]) * 1000
            for r, stream_indices in zip(streams, indices) for k in stream_indices if k < len(r.chunk_times)]


def split_gaps(streams: list[RequestRecord], long_sent: float,
               long_first_token: float) -> tuple[list[float], list[float]]:
    """Inter-chunk gaps (ms) of the streams that end before the long prompt was sent and in
    [long_sent, long_first_token)."""
    return (gaps_at(streams, gap_indices(streams, -math.inf, long_sent)),
            gaps_at(streams, gap_indices(streams, long_sent, long_first_token)))


async def run_round(base_url: str, args: argparse.Namespace, stream_prompts: list[str], long_prompt: str | None,
                    warmup_prompt: str) -> FairnessRound | list[RequestRecord]:
    """One round against a started server; long_prompt None: the control (the streams alone),
    whose records come back as they are."""
    load = ServeLoad(base_url=base_url, endpoint="chat", num_prompts=len(stream_prompts) + 1,
                     input_len=LengthSpec(args.stream_prompt, args.stream_prompt),
                     output_len=LengthSpec(args.stream_output, args.stream_output), timeout_s=1800.0)
    async with _client(load, len(stream_prompts) + 2) as client:
        model = await discover_model(client, load)
        await send_one(client, load, model, BenchRequest(warmup_prompt, 8, 0))
        records = [RequestRecord(start_time=0.0) for _ in stream_prompts]
        stream_tasks = [asyncio.create_task(send_one(client, load, model, BenchRequest(p, args.stream_output, 0), r))
                        for p, r in zip(stream_prompts, records)]
        if long_prompt is None:
            return list(await asyncio.gather(*stream_tasks))
        # The long prompt comes once every stream decodes: a server slow to prefill the streams'
        # own prompts would otherwise see it arrive among them, not among decodes.
        while not all(r.chunk_times for r in records) and not all(t.done() for t in stream_tasks):
            await asyncio.sleep(0.02)
        await asyncio.sleep(args.long_after)
        long_record = await send_one(client, load, model, BenchRequest(long_prompt, args.long_output, 0))
        streams = await asyncio.gather(*stream_tasks)
    errors = [r.error for r in [*streams, long_record] if not r.is_success]
    if errors:
        return FairnessRound([], [], math.nan, 0, error=errors[0])
    long_sent, long_first = long_record.start_time, long_record.chunk_times[0]
    before, during = split_gaps(streams, long_sent, long_first)
    ended_early = sum(1 for r in streams if r.chunk_times[-1] < long_first)
    return FairnessRound(before, during, long_first - long_sent, ended_early,
                         during_gap_indices=gap_indices(streams, long_sent, long_first))


def parse_step_budgets(text: str) -> list[str]:
    from tokios.engine_flags import parse_step_budget

    budgets = [" ".join(value.split()) for value in text.split(",") if value.strip()]
    if not budgets:
        raise InvalidRequestError("tokios_step_budgets lists no value", param="tokios_step_budgets")
    for value in budgets:
        try:
            parse_step_budget(value.split()[0])
        except argparse.ArgumentTypeError as exc:
            raise InvalidRequestError(f"tokios_step_budgets: {exc}", param="tokios_step_budgets") from None
    return budgets


FIGURES = ["before p50", "before p99", "during p50", "during p99", "during max", "without p99", "ttft"]


def result_table(name_to_rounds: dict[str, list[FairnessRound]]) -> str:
    rows = []
    for name, rounds in name_to_rounds.items():
        good = [r for r in rounds if not r.error]

        def median(figure: str) -> float:
            values = [r.figure(figure) for r in good if not math.isnan(r.figure(figure))]
            return statistics.median(values) if values else math.nan

        def median_ratio(of: str, to: str) -> float:
            ratios = [ratio for ratio in (r.figure(of) / r.figure(to) for r in good) if not math.isnan(ratio)]
            return statistics.median(ratios) if ratios else math.nan

        rows.append([name, fmt(median("before p50")), fmt(median("before p99")), fmt(median("during p50")),
                     fmt(median("during p99")), fmt(median("during max")), fmt(median("without p99")),
                     fmt_ratio(median_ratio("during p99", "before p99")),
                     fmt_ratio(median_ratio("during p99", "without p99")),
                     fmt(median("ttft"), 2), f"{len(rounds) - len(good)}"])
    return markdown_table(["server", "ITL p50 before ms", "ITL p99 before ms", "ITL p50 during ms",
                           "ITL p99 during ms", "longest gap during ms", "ITL p99 without it ms",
                           "p99 during / before", "p99 during / without", "long prompt TTFT s",
                           "failed rounds"], rows)


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.compare import llama_server_command, tokios_command
    from tokios.tools.bench.peers import (ServerProcess, benchmark_model_path, find_llama_server, free_port,
                                          load_prompt_codec)

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in ("tokios", "llama.cpp") for s in servers):
        raise InvalidRequestError(f"servers must be a subset of tokios,llama.cpp, got {args.servers!r}",
                                  param="servers")
    if args.repeats < 1 or args.streams < 1:
        raise InvalidRequestError("repeats and streams must be at least 1", param="repeats")
    needed = max(args.long_prompt + args.long_output, args.stream_prompt + args.stream_output) + 64
    if args.ctx_per_slot < needed:
        raise InvalidRequestError(f"ctx_per_slot {args.ctx_per_slot} is below the {needed} tokens a request needs",
                                  param="ctx_per_slot")
    budgets = parse_step_budgets(args.tokios_step_budgets) if "tokios" in servers else []
    model_path = benchmark_model_path(args)
    codec = load_prompt_codec(model_path)
    rng = random.Random(args.seed)
    stream_prompts = [make_prompt(args.stream_prompt, rng, codec) for _ in range(args.streams)]
    long_prompt = make_prompt(args.long_prompt, rng, codec)
    warmup_prompt = make_prompt(16, rng, codec)
    binary = find_llama_server(args.llama_server) if "llama.cpp" in servers else None
    num_slots = args.streams + 1
    # The same knobs compare.py's commands read.
    compare_args = argparse.Namespace(ctx_per_slot=args.ctx_per_slot, dtype=args.dtype, threads=args.threads,
                                      llama_server_args=args.llama_server_args)

    # (label, server, --max-step-ms value or None, whether it is the streams-alone control)
    variants: list[tuple[str, str, str | None, bool]] = []
    for name in servers:
        if name == "tokios":
            variants += [(f"tokios --max-step-ms {b}", name, b, False) for b in budgets]
        else:
            variants.append(("llama.cpp", name, None, False))
        if args.control:
            # Without a prompt to prefill the step budget never acts: one control serves every budget.
            variants.append((f"{name}, streams alone", name, budgets[0] if name == "tokios" else None, True))
    name_to_rounds: dict[str, list[FairnessRound]] = {label: [] for label, _, _, is_control in variants
                                                      if not is_control}
    for round_index in range(args.repeats):
        controls: dict[str, list[RequestRecord]] = {}
        for label, server_name, budget, is_control in (variants if round_index % 2 == 0 else variants[::-1]):
            port = free_port()
            if server_name == "llama.cpp":
                command = llama_server_command(compare_args, binary, model_path, port, num_slots)
            else:
                compare_args.tokios_args = f"{args.tokios_args} --max-step-ms {budget}"
                command = tokios_command(compare_args, model_path, port, num_slots)
            print(f"round {round_index + 1}/{args.repeats}, {label}: {' '.join(command)}", file=sys.stderr)
            with ServerProcess(label, command, port).start(timeout_s=args.startup_timeout) as server:
                result = asyncio.run(run_round(server.base_url, args, stream_prompts, None if is_control else long_prompt,
                                               warmup_prompt))
            if is_control:
                controls[server_name] = result
                failed = [r.error for r in result if not r.is_success]
                print(f"  failed: {failed[0]}" if failed else "  done", file=sys.stderr)
            elif result.error:
                print(f"  failed: {result.error}", file=sys.stderr)
            else:
                print(f"  ITL p99 before {result.figure('before p99'):.1f} ms, during {result.figure('during p99'):.1f}"
                      f" ms; long TTFT {result.long_ttft_s:.2f} s; streams ended early: {result.streams_ended_early}",
                      file=sys.stderr)
            if not is_control:
                name_to_rounds[label].append(result)
        # Each round's control: the streams alone, their gaps at the chunks that fell during the prefill.
        for label, server_name, _, is_control in variants:
            control = controls.get(server_name)
            if is_control or control is None or any(not r.is_success for r in control):
                continue
            result = name_to_rounds[label][-1]
            if not result.error:
                name_to_rounds[label][-1] = replace(result, itl_without_ms=gaps_at(control, result.during_gap_indices))

    text = result_table(name_to_rounds)
    early = sum(r.streams_ended_early for rounds in name_to_rounds.values() for r in rounds)
    if early:
        text += (f"\n\n{early} stream(s) ended before a long prompt's first token: raise --stream-output "
                 "so every stream decodes through the whole prefill.")
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "rounds": {name: [r.__dict__ for r in rounds] for name, rounds in name_to_rounds.items()}})
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"{args.streams} streams ({args.stream_prompt}-token prompts) decode {args.stream_output}-token replies "
                f"(EOS ignored, greedy); {args.long_after:g} s after every stream has its first token, a "
                f"{args.long_prompt}-token prompt arrives. "
                f"Inter-token latency (ITL) of the streams before it (from each stream's first token) and "
                f"during its prefill (its arrival to its first token), and \"without it\": the streams alone "
                f"(a control round), their gaps at the same chunks as fell during the prefill, so at the "
                f"same contexts; each server alone on the machine with "
                f"{num_slots} slots of {args.ctx_per_slot} tokens; median of {args.repeats} round(s), "
                f"servers alternating.\n\n{text}")
        report.update_docs_section(args.write_docs, SECTION, body)
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0 if all(not r.error for rounds in name_to_rounds.values() for r in rounds) else 1
