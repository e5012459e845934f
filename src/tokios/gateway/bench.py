"""Gateway overhead benchmark: the same streamed load sent directly to a backend and through the
gateway, in alternating rounds so machine noise hits both alike.

Owns the load generator (httpx, one task per concurrent stream) and the comparison figures:
TTFT p50/p95 of each target, the TTFT added by the gateway, and the throughput ratio. Used by
`tokios gateway bench` and benchmarks/gateway_overhead.py.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tokios.errors import InvalidRequestError


@dataclass(frozen=True)
class LoadSpec:
    model: str
    concurrency: int = 16
    num_requests: int = 64
    max_tokens: int = 64
    prompt: str = "Write a short story about a lighthouse keeper."

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 1024:
            raise InvalidRequestError(f"concurrency must be in [1, 1024], got {self.concurrency}", param="concurrency")
        if self.num_requests < self.concurrency:
            raise InvalidRequestError(
                f"num_requests must be >= concurrency={self.concurrency}, got {self.num_requests}", param="num_requests"
            )


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (fraction in [0, 1])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(fraction * (len(ordered) - 1))))
    return ordered[rank]


async def _one_stream(client: httpx.AsyncClient, url: str, headers: dict[str, str], spec: LoadSpec) -> tuple[float, int]:
    body = {
        "model": spec.model,
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    ttft_s = None
    num_tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                num_tokens += 1
    if ttft_s is None:
        raise RuntimeError(f"{url} streamed no content")
    return ttft_s, num_tokens


async def run_load(url: str, api_key: str | None, spec: LoadSpec) -> dict[str, Any]:
    """Run spec.num_requests streams, spec.concurrency at a time; TTFTs and output throughput."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = url.rstrip("/")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(spec.num_requests):
        queue.put_nowait(index)
    ttfts_s: list[float] = []
    num_tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal num_tokens
        while not queue.empty():
            queue.get_nowait()
            ttft_s, tokens = await _one_stream(client, url, headers, spec)
            ttfts_s.append(ttft_s)
            num_tokens += tokens

    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(spec.concurrency)))
        wall_s = time.perf_counter() - started
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts_s),
        "ttft_p95_ms": 1000 * percentile(ttfts_s, 0.95),
        "output_tokens_per_s": num_tokens / wall_s,
        "num_tokens": num_tokens,
        "wall_s": wall_s,
    }


async def compare(
    spec: LoadSpec,
    *,
    direct_url: str,
    direct_api_key: str | None,
    gateway_url: str,
    gateway_api_key: str | None,
    num_rounds: int = 3,
) -> dict[str, Any]:
    """Alternate direct and gateway rounds; report medians over rounds and the overhead."""
    if num_rounds < 1:
        raise InvalidRequestError(f"num_rounds must be >= 1, got {num_rounds}", param="num_rounds")
    # One short warm-up each: first-request costs (connections, caches) are not overhead.
    warm_up = LoadSpec(spec.model, 1, 1, 4, spec.prompt)
    await run_load(direct_url, direct_api_key, warm_up)
    await run_load(gateway_url, gateway_api_key, warm_up)
    rounds: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    for _ in range(num_rounds):
        rounds["direct"].append(await run_load(direct_url, direct_api_key, spec))
        rounds["gateway"].append(await run_load(gateway_url, gateway_api_key, spec))

    def median_of(target: str, name: str) -> float:
        return statistics.median(r[name] for r in rounds[target])

    summary = {
        target: {name: median_of(target, name) for name in ("ttft_p50_ms", "ttft_p95_ms", "output_tokens_per_s")}
        for target in rounds
    }
    return {
        "spec": {"model": spec.model, "concurrency": spec.concurrency, "num_requests": spec.num_requests,
                 "max_tokens": spec.max_tokens, "num_rounds": num_rounds},
        "direct": summary["direct"],
        "gateway": summary["gateway"],
        "added_ttft_p50_ms": summary["gateway"]["ttft_p50_ms"] - summary["direct"]["ttft_p50_ms"],
        "added_ttft_p95_ms": summary["gateway"]["ttft_p95_ms"] - summary["direct"]["ttft_p95_ms"],
        "throughput_ratio": summary["gateway"]["output_tokens_per_s"] / summary["direct"]["output_tokens_per_s"],
        "rounds": rounds,
    }


def format_comparison(result: dict[str, Any]) -> str:
    spec = result["spec"]
    lines = [
        f"model={spec['model']} concurrency={spec['concurrency']} requests/round={spec['num_requests']}"
        f" max_tokens={spec['max_tokens']} rounds={spec['num_rounds']} (medians over rounds)",
        f"{'target':<8} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'tok/s':>10}",
    ]
    for target in ("direct", "gateway"):
        figures = result[target]
        lines.append(
            f"{target:<8} {figures['ttft_p50_ms']:>12.2f} {figures['ttft_p95_ms']:>12.2f} {figures['output_tokens_per_s']:>10.1f}"
        )
    lines.append(
        f"added TTFT p50 {result['added_ttft_p50_ms']:+.2f} ms, p95 {result['added_ttft_p95_ms']:+.2f} ms;"
        f" throughput ratio {result['throughput_ratio']:.3f}"
    )
    return "\n".join(lines)
