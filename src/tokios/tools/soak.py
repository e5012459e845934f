"""`tokios soak`: thousands of mixed requests against a server, then proof that nothing leaked.

The mix (seeded, so a run can be repeated): chat and completions, streamed and not, n of 1 or 2,
logprobs, stop strings, random temperatures; 10% of the streams are dropped by the client after
a few events, and 5% of the requests are malformed (broken JSON, a wrong type, an unknown model)
and must get a 4xx. Every other request must succeed. Afterwards the server must hold no KV
block and no request, its invariants must hold, its open descriptors and asyncio tasks must be
back at their level before the run, and its resident memory after the run must be within
--rss-tolerance of what it was after the first 10% of the requests (a leak grows with the
request count; warm-up does not). Reads the server's figures from /v1/engine/stats.

Without --url it starts its own `tokios serve` (with --serve-flag flags) on a free port.
docs/reliability.md has the command and the figures of a 2,000-request run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from tokios.tools.bench.stats import percentile

PROMPTS = ["Write a haiku about the sea.", "List three colours.", "What is 2 + 2?", "Tell me a short story.",
           "Explain recursion in one sentence.", "Name a planet.", "Say hello in French.", "Count to five."]
MALFORMED_BODIES = [b'{"messages": [', b'{"messages": "not a list"}', b'[1, 2, 3]',
                    b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}',
                    b'{"messages": [{"role": "wizard", "content": "hi"}]}', b'{"prompt": "x", "max_tokens": -3}']


@dataclass
class SoakReport:
    num_requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    rss_curve: list[tuple[int, int]] = field(default_factory=list)  # (requests done, RSS bytes)
    failures: list[str] = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def _request_plan(rng: random.Random, index: int) -> dict:
    roll = rng.random()
    if roll < 0.05:
        return {"kind": "malformed", "path": "/v1/chat/completions" if index % 2 else "/v1/completions",
                "raw": rng.choice(MALFORMED_BODIES)}
    is_chat = rng.random() < 0.6
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "n": rng.choice([1, 1, 1, 2]), "stream": stream}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    prompt = rng.choice(PROMPTS)
    if is_chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
    else:
        body["prompt"] = prompt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
    return {"kind": "cancelled" if stream and rng.random() < 0.2 else "normal",  # 20% of streams ~ 10%
            "path": "/v1/chat/completions" if is_chat else "/v1/completions", "body": body}


async def _one(client: httpx.AsyncClient, plan: dict, report: SoakReport) -> None:
    started = time.perf_counter()
    try:
        if plan["kind"] == "malformed":
            response = await client.post(plan["path"], content=plan["raw"],
                                         headers={"Content-Type": "application/json"})
            report.count("malformed_4xx" if 400 <= response.status_code < 500 else f"malformed_{response.status_code}")
            if not 400 <= response.status_code < 500:
                report.failures.append(f"malformed body got {response.status_code}: {response.text[:200]}")
            return
        body = plan["body"]
        if not body["stream"]:
            response = await client.post(plan["path"], json=body)
            if response.status_code != 200:
                report.failures.append(f"{plan['path']} got {response.status_code}: {response.text[:200]}")
            report.count(f"whole_{response.status_code}")
        else:
            async with client.stream("POST", plan["path"], json=body) as response:
                num_events, last = 0, ""
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    num_events += 1
                    last = line
                    if '"error"' in line:
                        report.failures.append(f"stream error event: {line[:200]}")
                    if plan["kind"] == "cancelled" and num_events >= 3:
                        break  # leaving mid-stream closes the connection
            if plan["kind"] == "cancelled":
                report.count("stream_cancelled")
            elif response.status_code != 200 or last != "data: [DONE]":
                report.failures.append(f"stream ended with status {response.status_code}, last event {last[:100]!r}")
                report.count("stream_broken")
            else:
                report.count("stream_done")
        report.latencies_s.append(time.perf_counter() - started)
    except httpx.HTTPError as exc:
        report.failures.append(f"{plan['path']}: {type(exc).__name__}: {exc}")
        report.count("transport_error")


async def _stats(client: httpx.AsyncClient) -> dict:
    return (await client.get("/v1/engine/stats")).json()


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await _stats(client)
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_requests_in_flight"] == 0) \
                or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def run_soak(url: str, num_requests: int, concurrency: int, seed: int = 0, api_key: str | None = None,
                   rss_tolerance: float = 0.05, check_rss: bool = True) -> SoakReport:
    """Runs the mix and the checks; every violated check is a line in report.failures."""
    rng = random.Random(seed)
    report = SoakReport(num_requests=num_requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:
        # The level before the run, measured through a fresh connection pool state.
        report.before = (await _wait_idle(client))["process"]
        plans = [_request_plan(rng, index) for index in range(num_requests)]
        checkpoint = max(1, num_requests // 10)
        queue: asyncio.Queue = asyncio.Queue()
        for plan in plans:
            queue.put_nowait(plan)
        done = 0

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                await _one(client, queue.get_nowait(), report)
                done += 1
                if done % checkpoint == 0:
                    report.rss_curve.append((done, (await _stats(client))["process"]["rss_bytes"]))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats = await _wait_idle(client)
    # A fresh client: the run's pooled connections are closed and their descriptors released.
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        await asyncio.sleep(0.5)
        stats = await _stats(client)
    report.after = stats["process"]
    if stats["num_running"] or stats["num_waiting"] or stats["num_blocks_used"]:
        report.failures.append(f"after the run: {stats['num_running']} running, {stats['num_waiting']} waiting, "
                               f"{stats['num_blocks_used']} KV blocks held")
    if stats["invariants_error"]:
        report.failures.append(f"KV invariants: {stats['invariants_error']}")
    # One connection (this client's) may be open beyond the level before.
    if report.after["num_open_fds"] > report.before["num_open_fds"] + 1:
        report.failures.append(f"open descriptors grew {report.before['num_open_fds']} -> "
                               f"{report.after['num_open_fds']}")
    if report.after["num_asyncio_tasks"] > report.before["num_asyncio_tasks"] + 1:
        report.failures.append(f"asyncio tasks grew {report.before['num_asyncio_tasks']} -> "
                               f"{report.after['num_asyncio_tasks']}")
    if check_rss and report.rss_curve:
        first_rss = report.rss_curve[0][1]
        growth = report.after["rss_bytes"] / first_rss - 1
        if growth > rss_tolerance:
            report.failures.append(f"RSS grew {100 * growth:.1f}% after the first {report.rss_curve[0][0]} requests "
                                   f"(tolerance {100 * rss_tolerance:.0f}%)")
    return report


def format_report(report: SoakReport) -> str:
    mib = 1024 * 1024
    lines = [f"{report.num_requests} requests: " + ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items()))]
    if report.latencies_s:
        lines.append("latency s: p50 {:.3f}, p90 {:.3f}, p99 {:.3f}, max {:.3f}".format(
            percentile(report.latencies_s, 50), percentile(report.latencies_s, 90),
            percentile(report.latencies_s, 99), max(report.latencies_s)))
    lines.append("RSS MiB after N requests: " + ", ".join(f"{n}: {rss / mib:.1f}" for n, rss in report.rss_curve))
    lines.append(f"before: {report.before}")
    lines.append(f"after:  {report.after}")
    lines.append("checks: " + ("all passed" if not report.failures else f"{len(report.failures)} FAILED"))
    lines.extend(f"  - {failure}" for failure in report.failures[:20])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (default: start `tokios serve` for the run)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=2000, help="requests in the run (default 2000)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="allowed RSS growth after the first 10%% of requests (default 0.05)")
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="a flag for the server this command starts (repeatable), e.g. --serve-flag=--dtype=bfloat16")


def _start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "tokios.cli", "serve", "--port", "0", *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            url = match.group(1)
            break
    else:
        raise RuntimeError("tokios serve exited before listening")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                # Keep reading its log so that the pipe never fills and blocks the server.
                threading.Thread(target=process.stderr.read, daemon=True).start()
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("tokios serve did not become healthy")


def run(args: argparse.Namespace) -> int:
    process = None
    url = args.url
    if url is None:
        process, url = _start_server(args.serve_flag)
    try:
        report = asyncio.run(run_soak(url, args.requests, args.concurrency, args.seed, args.api_key,
                                      args.rss_tolerance))
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    print(format_report(report))
    print(json.dumps({"outcomes": report.outcomes, "rss_curve": report.rss_curve, "failures": len(report.failures)}))
    return 1 if report.failures else 0
