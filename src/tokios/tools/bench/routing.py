"""`tokios bench routing`: prefix-aware routing against least-busy, through real gateways, on the
same local backends, with a workload that shares long system prompts.

Starts `--num-backends` `tokios serve` processes and two gateways (`--routing prefix` with the
model's tokenizer, and `--routing least-busy`), each backend connected to both by its own
`tokios connect --report-cache-events`. A round sends `--num-requests` chat requests through one
gateway at `--concurrency`: each is one of `--num-shared-prompts` system prompts of
`--shared-prompt-tokens` tokens (drawn at random per request) followed by a question of its own;
rounds alternate the two gateways and every round draws new system prompts, so no round finds
another's blocks cached. Reported per policy: TTFT p50/p95, output throughput, and the prefix
cache's hit rate summed over the backends (tokens found / tokens looked up, each engine's own
counters from /v1/engine/stats), with medians over rounds. Into docs/scale-out.md with
--write-docs. The processes' logs stay in the peers cache (routing/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokios.errors import InvalidRequestError, TokiosError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.report import fmt, fmt_ratio, markdown_table
from tokios.tools.bench.serve import BenchRequest, ServeLoad, run_level

SECTION = "Prefix-aware routing against least-busy"
SERVED_NAME = "bench"
POLICIES = ("prefix", "least-busy")
TOKIOS = [sys.executable, "-m", "tokios.cli"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--num-backends", type=int, default=3)
    parser.add_argument("--num-shared-prompts", type=int, default=4, help="distinct system prompts per round")
    parser.add_argument("--shared-prompt-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=48, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per policy, alternating")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="each backend's")
    parser.add_argument("--backend-threads", type=int, default=1,
                        help="each backend's engine threads (default 1: the backends share this machine's cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--write-docs", nargs="?", const="docs/scale-out.md", default=None, metavar="PATH")


def _check(args: argparse.Namespace) -> None:
    for name in ("num_backends", "num_shared_prompts", "num_requests", "concurrency", "rounds", "output_tokens"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1, got {getattr(args, name)}", param=name)
    if args.shared_prompt_tokens < 64:
        raise InvalidRequestError("shared_prompt_tokens must be >= 64", param="shared_prompt_tokens")


class _Connectors:
    """`tokios connect` processes (no port to wait on), stopped with their sessions on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.popens: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.popens.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env={**os.environ, **env}, start_new_session=True))

    def stop_all(self) -> None:
        for popen in self.popens:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
        for popen in self.popens:
            try:
                popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TokiosError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _engine_totals(backend_urls: list[str]) -> tuple[int, int]:
    """(prompt tokens looked up in the prefix cache, of those found there), summed over the
    backends: each engine's own hit rate counters."""
    num_queried = num_hit = 0
    for url in backend_urls:
        stats = httpx.get(url + "/v1/engine/stats", timeout=30).json()
        num_queried += stats["prefix_cache_queries"]
        num_hit += stats["prefix_cache_hits"]
    return num_queried, num_hit


def _round_requests(args: argparse.Namespace, rng: random.Random, codec) -> list[BenchRequest]:
    from tokios.tools.bench.prompts import make_prompt

    shared = [make_prompt(args.shared_prompt_tokens, rng, codec) for _ in range(args.num_shared_prompts)]
    return [BenchRequest(f"{rng.choice(shared)}\n\n{make_prompt(args.question_tokens, rng, codec)}",
                         args.output_tokens, args.shared_prompt_tokens + args.question_tokens)
            for _ in range(args.num_requests)]


def run(args: argparse.Namespace) -> int:
    from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyStore
    from tokios.tools.bench.peers import ServerProcess, free_port, load_prompt_codec, peers_dir, resolve_model_path

    _check(args)
    model_path = resolve_model_path(args.model)
    codec = load_prompt_codec(model_path)
    with tempfile.TemporaryDirectory(prefix="tokios-bench-routing-") as work_dir, contextlib.ExitStack() as stack:
        db_path = Path(work_dir) / "gateway.db"
        store = KeyStore(db_path)
        client_key = store.create(KIND_CLIENT, "bench")[1]
        connector_token = store.create(KIND_CONNECTOR, "bench")[1]
        store.close()
        log_dir = peers_dir() / "routing"
        log_dir.mkdir(parents=True, exist_ok=True)
        backends = [ServerProcess(f"backend-{index}", [
            *TOKIOS, "serve", "--port", str(port), "--model", model_path, "--served-model-name", SERVED_NAME,
            "--kv-cache-memory", args.kv_cache_memory, "--threads", str(args.backend_threads)], port,
            log_path=log_dir / f"backend-{index}.log") for index, port in
            ((index, free_port()) for index in range(args.num_backends))]
        gateways = {policy: ServerProcess(f"gateway-{policy}", [
            *TOKIOS, "gateway", "--port", str(port), "--db", str(db_path), "--routing", policy, "--tokenizer",
            f"{SERVED_NAME}={model_path}", "--log-level", "warning"], port, log_path=log_dir / f"gateway-{policy}.log")
            for policy, port in ((policy, free_port()) for policy in POLICIES)}
        for server in [*backends, *gateways.values()]:
            stack.enter_context(server.start())
        backend_urls = [backend.base_url for backend in backends]
        policy_to_gateway_url = {policy: gateway.base_url for policy, gateway in gateways.items()}
        connectors = _Connectors(log_dir)
        stack.callback(connectors.stop_all)
        for policy, gateway_url in policy_to_gateway_url.items():
            for index, backend_url in enumerate(backend_urls):
                connectors.start(f"connector-{policy}-{index}",
                                 [*TOKIOS, "connect", gateway_url, "--backend-url", backend_url, "--backend-id",
                                  f"backend-{index}", "--report-cache-events", "--log-level", "warning"],
                                 env={"TOKIOS_CONNECTOR_TOKEN": connector_token})
        headers = {"Authorization": f"Bearer {client_key}"}
        for gateway_url in policy_to_gateway_url.values():
            _wait(lambda: len(httpx.get(gateway_url + "/status", headers=headers, timeout=5).json()
                              ["indexed_backends"]) == args.num_backends, 120,
                  f"backends on {gateway_url} (logs in {log_dir})")
        print(f"{args.num_backends} backends, two gateways ready", file=sys.stderr)

        policy_to_rounds: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
        rng = random.Random(args.seed)
        for round_index in range(args.rounds):
            order = POLICIES if round_index % 2 == 0 else tuple(reversed(POLICIES))
            for policy in order:
                requests = _round_requests(args, rng, codec)
                load = ServeLoad(base_url=policy_to_gateway_url[policy], model=SERVED_NAME,
                                 num_prompts=len(requests), api_key=client_key, seed=args.seed + round_index)
                queried_before, hit_before = _engine_totals(backend_urls)
                summary, _ = asyncio.run(run_level(load, requests, label=f"{policy} round {round_index + 1}",
                                                   max_concurrency=args.concurrency, num_warmups=0))
                queried_after, hit_after = _engine_totals(backend_urls)
                decisions = httpx.get(policy_to_gateway_url[policy] + "/status", headers=headers,
                                      timeout=30).json()["routing_decisions"]
                result = {"ttft_p50_ms": summary.ttft.median_ms, "ttft_p95_ms": summary.ttft.p95_ms,
                          "output_tok_s": summary.output_throughput, "num_failed": summary.num_failed,
                          "hit_rate": (hit_after - hit_before) / max(1, queried_after - queried_before),
                          "decisions": decisions}
                policy_to_rounds[policy].append(result)
                print(f"{policy} round {round_index + 1}: TTFT p50 {result['ttft_p50_ms']:.0f} ms, p95 "
                      f"{result['ttft_p95_ms']:.0f} ms, {result['output_tok_s']:.1f} tok/s, hit rate "
                      f"{result['hit_rate']:.1%}, failed {summary.num_failed}", file=sys.stderr)

    def median(policy: str, key: str) -> float:
        return statistics.median(result[key] for result in policy_to_rounds[policy])

    rows = [[policy, fmt(median(policy, "ttft_p50_ms")), fmt(median(policy, "ttft_p95_ms")),
             fmt(median(policy, "output_tok_s")), f"{median(policy, 'hit_rate'):.1%}",
             str(sum(result["num_failed"] for result in policy_to_rounds[policy]))] for policy in POLICIES]
    text = (markdown_table(["routing", "TTFT p50 ms", "TTFT p95 ms", "output tok/s", "prefix cache hit rate",
                            "failed"], rows)
            + f"\n\nleast-busy / prefix: TTFT p50 {fmt_ratio(median('least-busy', 'ttft_p50_ms') / median('prefix', 'ttft_p50_ms'))}, "
              f"p95 {fmt_ratio(median('least-busy', 'ttft_p95_ms') / median('prefix', 'ttft_p95_ms'))}; "
              f"throughput prefix / least-busy "
              f"{fmt_ratio(median('prefix', 'output_tok_s') / median('least-busy', 'output_tok_s'))}. "
              f"The prefix gateway's decisions, all rounds: {policy_to_rounds['prefix'][-1]['decisions']}.")
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {"command": report.command_line(), "machine": machine_line(),
                                           "rounds": policy_to_rounds})
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"{args.num_backends} `tokios serve` backends (default model, `--kv-cache-memory "
                f"{args.kv_cache_memory} --threads {args.backend_threads}` each) behind two gateways, one routing by prefix and one by load, each "
                f"backend connected to both with `tokios connect --report-cache-events`. A round: "
                f"{args.num_requests} chat requests at concurrency {args.concurrency}, each one of "
                f"{args.num_shared_prompts} system prompts of {args.shared_prompt_tokens} tokens plus a "
                f"{args.question_tokens}-token question, {args.output_tokens} output tokens; new prompts every "
                f"round, rounds alternating, medians of {args.rounds} rounds per policy. The processes share this "
                f"machine's two cores, so the figures show what a cache hit saves in compute, not a fleet's "
                f"scaling.\n\n{text}\n")
        report.update_docs_section(args.write_docs, SECTION, body)
    return 0
