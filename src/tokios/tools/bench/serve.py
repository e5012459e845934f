"""`tokios bench serve`: a streaming load generator against any OpenAI-compatible server.

Sends /v1/chat/completions or /v1/completions requests with `stream: true` through httpx, at a
fixed concurrency (a list of them is a sweep) or at a Poisson request rate, and times every
streamed chunk. Token counts come from the final usage chunk (`stream_options.include_usage`)
when the server sends one, else one content chunk counts as one token. The figures are those of
`vllm bench serve` (see stats.py); report.py prints, saves and plots them. compare.py
drives this same code against tokios and llama-server.

`--json-schema builtin|FILE` constrains every request to a JSON schema (response_format on chat,
structured_outputs on completions); `--compare-unconstrained` runs each level twice on the same
prompts, unconstrained then constrained, and prints the output-throughput ratio with the
server's grammar compile and per-step mask times (from its /v1/engine/stats histograms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from tokios.errors import InvalidRequestError
from tokios.tools.bench.prompts import LengthSpec, TokenCodec, make_prompt
from tokios.tools.bench.stats import RequestRecord, ServeSummary, summarize_serve

ENDPOINT_TO_PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
                    "messages": "/v1/messages", "ollama-chat": "/api/chat"}


@dataclass(frozen=True)
class ServeLoad:
    """What to send, independent of how fast it is sent."""

    base_url: str
    endpoint: str = "chat"
    model: str | None = None
    num_prompts: int = 64
    input_len: LengthSpec = LengthSpec(128, 128)
    output_len: LengthSpec = LengthSpec(128, 128)
    ignore_eos: bool = True
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    # A JSON schema every request's output must match (None: unconstrained).
    json_schema: dict | None = None
    # Tools every chat request must call (tool_choice "required", one call): the streamed
    # arguments are the output.
    tools: list[dict] | None = None
    # A system message before each chat prompt (the tools' prompt, for a baseline that reads the
    # same tokens as the tool-calling requests).
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_TO_PATH:
            raise InvalidRequestError(
                f"endpoint must be one of {sorted(ENDPOINT_TO_PATH)}, got {self.endpoint!r}", param="endpoint")
        if self.num_prompts < 1:
            raise InvalidRequestError(f"num_prompts must be >= 1, got {self.num_prompts}", param="num_prompts")
        if not self.base_url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"base_url must start with http:// or https://, got {self.base_url!r}",
                                      param="base_url")

    @property
    def root_url(self) -> str:
        """The server root, accepting both http://host:port and http://host:port/v1."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    num_prompt_tokens_estimate: int


def build_requests(load: ServeLoad, codec: TokenCodec | None = None) -> list[BenchRequest]:
    """The same seeded list of prompts every run, each with its own drawn lengths."""
    rng = random.Random(load.seed)
    requests = []
    for _ in range(load.num_prompts):
        num_input = load.input_len.draw(rng)
        requests.append(BenchRequest(make_prompt(num_input, rng, codec), load.output_len.draw(rng), num_input))
    return requests


def request_body(load: ServeLoad, model: str, request: BenchRequest) -> dict:
    """The streamed request of `load.endpoint`, greedy, with `ignore_eos` (not in OpenAI's,
    Anthropic's or Ollama's APIs; vLLM, llama-server and tokios accept it: without it output
    lengths depend on when the model says EOS and runs are not comparable)."""
    messages = [{"role": "user", "content": request.prompt}]
    if load.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": load.system_prompt})
    if load.endpoint == "ollama-chat":
        options = {"temperature": 0.0, "num_predict": request.max_tokens}
        if load.ignore_eos:
            options["ignore_eos"] = True
        return {"model": model, "messages": messages, "stream": True, "options": options}
    body: dict = {"model": model, "temperature": 0.0, "stream": True}
    if load.ignore_eos:
        body["ignore_eos"] = True
    if load.endpoint == "responses":
        body.update(input=request.prompt, max_output_tokens=request.max_tokens)
    elif load.endpoint == "messages":
        body.update(messages=messages, max_tokens=request.max_tokens)
    else:
        body.update(max_tokens=request.max_tokens, stream_options={"include_usage": True})
        if load.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = request.prompt
    if load.tools is not None:
        if load.endpoint != "chat":
            raise InvalidRequestError("--tools works with --endpoint chat", param="endpoint")
        body.update(tools=load.tools, tool_choice="required", parallel_tool_calls=False)
    if load.json_schema is not None:
        if load.endpoint == "chat":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": load.json_schema}}
        elif load.endpoint == "completions":
            body["structured_outputs"] = {"json": load.json_schema}
        else:
            raise InvalidRequestError("--json-schema works with --endpoint chat or completions", param="endpoint")
    return body


# The builtin schema of --json-schema: a record whose list of notes cannot close before a few
# hundred tokens, so that constrained outputs run to max_tokens as unconstrained ones do (outputs
# that end early would make the batch smaller and the throughputs incomparable).
BUILTIN_JSON_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "rating": {"type": "integer", "minimum": 1,
                                                                          "maximum": 5},
                   "notes": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 100}},
    "required": ["title", "rating", "notes"], "additionalProperties": False,
}


def read_tools(value: str | None) -> list[dict] | None:
    """--tools: 'builtin' (one function whose arguments are the builtin schema's record, so that a
    call runs to max_tokens as a plain answer does) or a JSON file of OpenAI tools."""
    if value is None:
        return None
    if value == "builtin":
        return [{"type": "function", "function": {"name": "record_notes", "description": "Record notes on the text",
                                                  "parameters": BUILTIN_JSON_SCHEMA}}]
    try:
        with open(value, encoding="utf-8") as file:
            tools = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"--tools {value!r}: {exc}", param="tools") from None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"--tools {value!r} must hold a non-empty JSON list of tools", param="tools")
    return tools


def read_json_schema(value: str | None) -> dict | None:
    if value is None:
        return None
    if value == "builtin":
        return BUILTIN_JSON_SCHEMA
    try:
        with open(value) as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"--json-schema {value!r}: {exc}", param="json_schema") from None


def parse_sse_data(line: str) -> dict | str | None:
    """One SSE line -> its JSON payload, "[DONE]", or None for comments/blank/other fields."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


def parse_line(line: str, endpoint: str) -> dict | str | None:
    """A stream line's payload: SSE data for the OpenAI and Anthropic routes, one JSON object a
    line for Ollama's."""
    if endpoint == "ollama-chat":
        return json.loads(line) if line.strip() else None
    return parse_sse_data(line)


def chunk_text(payload: dict, endpoint: str) -> str:
    """Generated text carried by one streamed chunk ('' for role-only or usage-only chunks)."""
    if endpoint == "responses":
        return payload.get("delta") or "" if payload.get("type") == "response.output_text.delta" else ""
    if endpoint == "messages":
        delta = payload.get("delta") or {}
        return delta.get("text") or "" if payload.get("type") == "content_block_delta" else ""
    if endpoint == "ollama-chat":
        return (payload.get("message") or {}).get("content") or ""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        arguments = "".join((call.get("function") or {}).get("arguments") or ""
                            for call in delta.get("tool_calls") or ())
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "") + arguments
    return choices[0].get("text") or ""


def chunk_usage(payload: dict, endpoint: str, usage: dict[str, int]) -> bool:
    """Folds the token counts a chunk carries into `usage` ({prompt, completion}); True at the
    stream's last event."""
    if endpoint == "responses":
        if payload.get("type") in ("response.completed", "response.incomplete"):
            counts = (payload.get("response") or {}).get("usage") or {}
            usage.update(prompt=counts.get("input_tokens", 0), completion=counts.get("output_tokens", 0))
            return True
        return False
    if endpoint == "messages":
        kind = payload.get("type")
        if kind == "message_start":
            usage["prompt"] = ((payload.get("message") or {}).get("usage") or {}).get("input_tokens", 0)
        elif kind == "message_delta":
            usage["completion"] = (payload.get("usage") or {}).get("output_tokens", 0)
        return kind == "message_stop"
    if endpoint == "ollama-chat":
        if payload.get("done"):
            usage.update(prompt=payload.get("prompt_eval_count", 0), completion=payload.get("eval_count", 0))
            return True
        return False
    counts = payload.get("usage")
    if counts:
        usage.update(prompt=counts["prompt_tokens"], completion=counts["completion_tokens"])
    return False


def stream_error(payload: dict) -> str | None:
    error = payload.get("error")
    if error is None and payload.get("type") != "error":
        return None
    return f"stream error: {json.dumps(error if error is not None else payload)[:200]}"


async def send_one(client: httpx.AsyncClient, load: ServeLoad, model: str, request: BenchRequest,
                   record: RequestRecord | None = None) -> RequestRecord:
    """Stream one request; `record` (filled as the chunks arrive) lets a caller watch it run."""
    record = record or RequestRecord(start_time=0.0)
    record.start_time = time.perf_counter()
    num_chunks = 0
    usage: dict[str, int] = {}
    try:
        url = load.root_url + ENDPOINT_TO_PATH[load.endpoint]
        async with client.stream("POST", url, json=request_body(load, model, request)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for line in response.aiter_lines():
                payload = parse_line(line, load.endpoint)
                if payload == "[DONE]":
                    break
                if not isinstance(payload, dict):
                    continue
                if (error := stream_error(payload)) is not None:
                    record.error = error
                    return record
                if chunk_text(payload, load.endpoint):
                    record.chunk_times.append(time.perf_counter())
                    num_chunks += 1
                if chunk_usage(payload, load.endpoint, usage):
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    finally:
        record.end_time = time.perf_counter()
    if num_chunks == 0:
        record.error = "the stream carried no generated text"
        return record
    record.num_output_tokens = int(usage.get("completion") or num_chunks)
    record.num_prompt_tokens = int(usage.get("prompt") or request.num_prompt_tokens_estimate)
    record.is_success = True
    return record


async def discover_model(client: httpx.AsyncClient, load: ServeLoad) -> str:
    """The model id to send: --model, else the first one the server lists."""
    if load.model:
        return load.model
    response = await client.get(load.root_url + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise InvalidRequestError(f"{load.root_url}/v1/models lists no model; pass --model", param="model")
    return models[0]["id"]


def _client(load: ServeLoad, max_connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(load.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
    )


async def run_level(load: ServeLoad, requests: list[BenchRequest], *, label: str,
                    max_concurrency: int | None = None, request_rate: float = math.inf,
                    num_warmups: int = 1, show_progress: bool = True) -> tuple[ServeSummary, list[RequestRecord]]:
    """Send every request once, at most max_concurrency in flight, arriving at request_rate/s."""
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidRequestError(f"concurrency must be >= 1, got {max_concurrency}", param="concurrency")
    if not request_rate > 0:
        raise InvalidRequestError(f"request_rate must be > 0, got {request_rate}", param="request_rate")
    limit = max_concurrency or len(requests)
    async with _client(load, limit) as client:
        model = await discover_model(client, load)
        for warmup in requests[:num_warmups]:
            await send_one(client, load, model, BenchRequest(warmup.prompt, min(warmup.max_tokens, 8), 0))
        semaphore = asyncio.Semaphore(limit)
        progress = _progress(len(requests), label, show_progress)
        rng = random.Random(load.seed + 1)

        async def limited(request: BenchRequest) -> RequestRecord:
            async with semaphore:
                record = await send_one(client, load, model, request)
            progress.update(1)
            return record

        started = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(limited(request)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        records = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - started
        progress.close()
    return summarize_serve(label, records, duration_s), records


def _progress(total: int, label: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar then
        enabled = False
    if not enabled:
        class _Silent:
            def update(self, _n: int) -> None: ...

            def close(self) -> None: ...
        return _Silent()
    return tqdm(total=total, desc=label, file=sys.stderr, leave=False, unit="req")


def run_sweep(load: ServeLoad, requests: list[BenchRequest], *, concurrencies: list[int | None],
              request_rate: float = math.inf, num_warmups: int = 1, show_progress: bool = True,
              label_prefix: str = "") -> list[ServeSummary]:
    """One level per concurrency (None: unlimited), the same requests at each level."""
    summaries = []
    for concurrency in concurrencies:
        label = label_prefix + (f"c={concurrency}" if concurrency else f"rate={request_rate:g}/s")
        summary, _ = asyncio.run(run_level(load, requests, label=label, max_concurrency=concurrency,
                                           request_rate=request_rate, num_warmups=num_warmups,
                                           show_progress=show_progress))
        summaries.append(summary)
    return summaries


# ---------------------------------------------------------------- command line

def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `bench serve` and `bench compare`."""
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_TO_PATH), default="chat")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", default="128", help="prompt tokens: N or LOW:HIGH (uniform)")
    parser.add_argument("--output-len", default="128", help="max tokens: N or LOW:HIGH (uniform)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated max in-flight requests; several values make a sweep "
                             "(default 1,4,16, or no cap with --request-rate)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrival rate in requests/s (default: all at once)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let the model stop at EOS (output lengths then vary)")
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-model", default=None,
                        help="GGUF whose tokenizer cuts prompts to exact lengths (default: the default model)")
    parser.add_argument("--json", dest="json_path", default=None, help="write all figures as JSON here")
    parser.add_argument("--plot-dir", default=None, help="write PNG plots here")
    parser.add_argument("--no-progress", dest="show_progress", action="store_false")
    parser.add_argument("--json-schema", default=None,
                        help="constrain every output to this JSON schema: 'builtin' or a file")
    parser.add_argument("--tools", default=None,
                        help="every chat request must call one of these tools (tool_choice required), its "
                             "arguments streamed: 'builtin' or a JSON file of OpenAI tools")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 URL")
    parser.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    add_load_arguments(parser)
    parser.add_argument("--compare-endpoints", default=None, metavar="LIST",
                        help="comma-separated endpoints (e.g. chat,responses,messages,ollama-chat): run the same "
                             "requests through each, alternating, and report TTFT p50 and output throughput "
                             "against the first")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of --compare-endpoints (default 3)")
    parser.add_argument("--cold-load", action="store_true",
                        help="time a model's cold load to its first token: unload it (Ollama keep_alive 0), "
                             "send one request, --repeats times; needs a tokios server")
    parser.add_argument("--compare-unconstrained", action="store_true",
                        help="with --json-schema or --tools: run each level unconstrained, then constrained, and "
                             "report the output throughput ratio and the server's grammar timings")
    parser.add_argument("--tools-baseline", choices=["same-prompt", "no-tools"], default="same-prompt",
                        help="with --tools --compare-unconstrained: the baseline sends the tools' instructions as a "
                             "system message, the same prompt tokens (same-prompt, default: the cost of the calls' "
                             "grammar, parsing and streaming), or just the user prompt (no-tools: also the cost "
                             "of the longer prompt)")


def parse_concurrencies(text: str) -> list[int | None]:
    """'1,4,16' -> [1, 4, 16]; 'inf' or '0' -> [None] (no limit)."""
    values: list[int | None] = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if part in ("inf", "0", "none"):
            values.append(None)
            continue
        if not part.isdigit():
            raise InvalidRequestError(f"concurrency must be a comma-separated list of integers >= 1, got {text!r}",
                                      param="concurrency")
        values.append(int(part))
    return values


def resolve_concurrencies(text: str | None, request_rate: float) -> list[int | None]:
    if text is not None:
        return parse_concurrencies(text)
    # A rate alone means no concurrency cap, as in vllm bench serve.
    return [None] if request_rate != math.inf else [1, 4, 16]


def load_from_args(args: argparse.Namespace, base_url: str, model: str | None) -> ServeLoad:
    return ServeLoad(
        base_url=base_url, endpoint=args.endpoint, model=model, num_prompts=args.num_prompts,
        input_len=LengthSpec.parse(args.input_len, field_name="input_len"),
        output_len=LengthSpec.parse(args.output_len, field_name="output_len"),
        ignore_eos=args.ignore_eos, api_key=getattr(args, "api_key", None), seed=args.seed,
        json_schema=read_json_schema(getattr(args, "json_schema", None)),
        tools=read_tools(getattr(args, "tools", None)))


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench import report
    from tokios.tools.bench.peers import load_prompt_codec

    load = load_from_args(args, args.base_url, args.model)
    concurrencies = resolve_concurrencies(args.concurrency, args.request_rate)
    requests = build_requests(load, load_prompt_codec(args.tokenizer_model))
    if args.compare_endpoints:
        return run_endpoint_comparison(args, load, requests, concurrencies)
    if args.cold_load:
        return run_cold_load(args, load)
    if args.compare_unconstrained:
        if load.json_schema is None and load.tools is None:
            raise InvalidRequestError("--compare-unconstrained needs --json-schema or --tools",
                                      param="compare_unconstrained")
        return run_structured_comparison(args, load, requests, concurrencies)
    summaries = run_sweep(load, requests, concurrencies=concurrencies, request_rate=args.request_rate,
                          num_warmups=args.num_warmups, show_progress=args.show_progress)
    print(report.serve_table(summaries, title=f"{load.root_url} ({load.endpoint}, "
                             f"in {load.input_len}, out {load.output_len})"))
    if args.json_path:
        report.write_json(args.json_path, {"load": report.load_to_dict(load),
                                           "levels": [s.to_dict() for s in summaries]})
    if args.plot_dir:
        for path in report.plot_serve({"server": summaries}, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s.num_failed == 0 for s in summaries) else 1


# ---------------------------------------------------------------- one server, several dialects

def run_endpoint_comparison(args, load: ServeLoad, requests: list[BenchRequest],
                            concurrencies: list[int | None]) -> int:
    """The same requests through each endpoint, round after round (so that drift on a noisy
    machine hits every endpoint alike); per level the median over rounds of each endpoint's TTFT
    p50 and of its output throughput over the first endpoint's in the same round."""
    from dataclasses import replace

    endpoints = [name.strip() for name in args.compare_endpoints.split(",") if name.strip()]
    for endpoint in endpoints:
        if endpoint not in ENDPOINT_TO_PATH:
            raise InvalidRequestError(f"compare_endpoints: {endpoint!r} is not one of {sorted(ENDPOINT_TO_PATH)}",
                                      param="compare_endpoints")
    if args.repeats < 1:
        raise InvalidRequestError("repeats must be >= 1", param="repeats")
    lines = ["| level | endpoint | TTFT p50 ms (median of rounds) | out tok/s (median) | throughput vs "
             f"{endpoints[0]} (median [min, max]) | TTFT p50 vs {endpoints[0]} |", "|---|---|---|---|---|---|"]
    results = []
    ok = True
    for concurrency in concurrencies:
        label = f"c={concurrency}" if concurrency else f"rate={args.request_rate:g}/s"
        rounds: dict[str, list[ServeSummary]] = {endpoint: [] for endpoint in endpoints}
        for round_index in range(args.repeats):
            for endpoint in endpoints:
                summary, _ = asyncio.run(run_level(replace(load, endpoint=endpoint), requests,
                                                   label=f"{label} {endpoint} #{round_index + 1}",
                                                   max_concurrency=concurrency, request_rate=args.request_rate,
                                                   num_warmups=args.num_warmups, show_progress=args.show_progress))
                ok = ok and summary.num_failed == 0
                rounds[endpoint].append(summary)
        base = rounds[endpoints[0]]
        for endpoint in endpoints:
            ratios = [mine.output_throughput / first.output_throughput
                      for mine, first in zip(rounds[endpoint], base) if first.output_throughput]
            ttft_ratios = [mine.ttft.median_ms / first.ttft.median_ms
                           for mine, first in zip(rounds[endpoint], base) if first.ttft.median_ms]
            ttft = statistics.median(summary.ttft.median_ms for summary in rounds[endpoint])
            throughput = statistics.median(summary.output_throughput for summary in rounds[endpoint])
            lines.append(f"| {label} | {endpoint} | {ttft:.1f} | {throughput:.1f} | "
                         f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] | "
                         f"{statistics.median(ttft_ratios):.3f} |")
            results.append({"level": label, "endpoint": endpoint, "ttft_p50_ms": ttft,
                            "output_throughput": throughput, "throughput_ratios": ratios,
                            "ttft_ratios": ttft_ratios})
    print(f"{load.root_url} (in {load.input_len}, out {load.output_len}, {args.repeats} rounds)")
    print("\n".join(lines))
    if args.json_path:
        from tokios.tools.bench import report

        report.write_json(args.json_path, {"load": report.load_to_dict(load), "endpoints": results})
    return 0 if ok else 1


def run_cold_load(args, load: ServeLoad) -> int:
    """Cold load to first token: unload the model, then time one streamed request."""
    if args.repeats < 1:
        raise InvalidRequestError("repeats must be >= 1", param="repeats")
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}

    async def one() -> tuple[float, float]:
        async with _client(load, 1) as client:
            model = await discover_model(client, load)
            unloaded = await client.post(load.root_url + "/api/generate",
                                         json={"model": model, "prompt": "", "keep_alive": 0}, headers=headers)
            if unloaded.status_code != 200:
                raise InvalidRequestError(f"cold_load: unloading {model!r} failed ({unloaded.status_code}): "
                                          f"{unloaded.text[:200]}", param="cold_load")
            record = await send_one(client, load, model, BenchRequest("Hello", 1, 1))
            if not record.is_success:
                raise InvalidRequestError(f"cold_load: the request failed: {record.error}", param="cold_load")
            warm = await send_one(client, load, model, BenchRequest("Hello", 1, 1))
            return record.chunk_times[0] - record.start_time, warm.chunk_times[0] - warm.start_time

    times = [asyncio.run(one()) for _ in range(args.repeats)]
    cold = sorted(time_s for time_s, _ in times)
    warm = sorted(time_s for _, time_s in times)
    print(f"{load.root_url} model {load.model or '(the first)'}: cold load to first token "
          f"p50 {1000 * statistics.median(cold):.0f} ms [min {1000 * cold[0]:.0f}, max {1000 * cold[-1]:.0f}], "
          f"then warm {1000 * statistics.median(warm):.0f} ms, {args.repeats} rounds")
    return 0


# ---------------------------------------------------------------- constrained vs unconstrained

def engine_histograms(load: ServeLoad) -> dict[str, dict]:
    """The server's grammar histograms (tokios /v1/engine/stats); {} from a server without them."""
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    try:
        stats = httpx.get(load.root_url + "/v1/engine/stats", headers=headers, timeout=30).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return {}
    return {name: stats[name] for name in ("grammar_compile_seconds", "grammar_mask_seconds")
            if isinstance(stats.get(name), dict)}


def histogram_quantile(before: dict | None, after: dict, quantile: float) -> float | None:
    """The upper bound of the bucket holding `quantile` of the observations made between two reads."""
    counts = [a - (before["counts"][i] if before else 0) for i, a in enumerate(after["counts"])]
    total = sum(counts)
    if total == 0:
        return None
    bounds = [*after["buckets"], math.inf]
    running = 0
    for bound, count in zip(bounds, counts):
        running += count
        if running >= quantile * total:
            return bound
    return math.inf


def run_structured_comparison(args, load: ServeLoad, requests: list[BenchRequest],
                              concurrencies: list[int | None]) -> int:
    from dataclasses import replace

    from tokios.tools.bench import report

    plain_load = replace(load, json_schema=None, tools=None)
    constraint = "tools" if load.tools is not None else "JSON schema"
    if load.tools is not None and getattr(args, "tools_baseline", "same-prompt") == "same-prompt":
        # The baseline reads the same prompt: the tools' instructions as a system message (what
        # the server writes for a template that does not take tools, tool_calls/prompt.py), so
        # the ratio is the cost of the calls' grammar, parsing and streaming, not of a longer
        # prompt.
        from tokios.tool_calls import ToolSet
        from tokios.tool_calls.prompt import tools_instructions

        plain_load = replace(plain_load, system_prompt=tools_instructions(ToolSet.from_request(
            load.tools, "required", False)))
    lines = ["| level | unconstrained out tok/s | constrained out tok/s | ratio | compiles | compile p50 / p99 "
             "| mask per step p50 / p99 |", "|---|---|---|---|---|---|---|"]
    results = []
    ok = True
    for concurrency in concurrencies:
        label = f"c={concurrency}" if concurrency else f"rate={args.request_rate:g}/s"
        plain, _ = asyncio.run(run_level(plain_load, requests, label=label + " plain", max_concurrency=concurrency,
                                         request_rate=args.request_rate, num_warmups=args.num_warmups,
                                         show_progress=args.show_progress))
        before = engine_histograms(load)
        constrained, _ = asyncio.run(run_level(load, requests, label=f"{label} {constraint}",
                                               max_concurrency=concurrency,
                                               request_rate=args.request_rate, num_warmups=args.num_warmups,
                                               show_progress=args.show_progress))
        after = engine_histograms(load)
        ok = ok and plain.num_failed == 0 and constrained.num_failed == 0
        ratio = constrained.output_throughput / plain.output_throughput if plain.output_throughput else math.nan
        timings = {}
        for name in ("grammar_compile_seconds", "grammar_mask_seconds"):
            if name in after:
                prior = before.get(name)
                timings[name] = {"count": after[name]["count"] - (prior["count"] if prior else 0),
                                 "p50_s": histogram_quantile(prior, after[name], 0.5),
                                 "p99_s": histogram_quantile(prior, after[name], 0.99)}

        def ms(name: str, key: str) -> str:
            value = timings.get(name, {}).get(key)
            return "-" if value is None else ("> max bucket" if value == math.inf else f"<= {value * 1e3:g} ms")

        lines.append(f"| {label} | {plain.output_throughput:.1f} | {constrained.output_throughput:.1f} | {ratio:.3f} "
                     f"| {timings.get('grammar_compile_seconds', {}).get('count', '-')} "
                     f"| {ms('grammar_compile_seconds', 'p50_s')} / {ms('grammar_compile_seconds', 'p99_s')} "
                     f"| {ms('grammar_mask_seconds', 'p50_s')} / {ms('grammar_mask_seconds', 'p99_s')} |")
        results.append({"level": label, "unconstrained": plain.to_dict(), "constrained": constrained.to_dict(),
                        "ratio": ratio, "grammar": timings})
    print(f"{load.root_url} ({load.endpoint}, in {load.input_len}, out {load.output_len}), {constraint} vs none, "
          "same prompts:\n")
    print("\n".join(lines))
    if args.json_path:
        report.write_json(args.json_path, {"load": report.load_to_dict(load), "levels": results})
    return 0 if ok else 1
