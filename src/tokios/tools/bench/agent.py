"""`tokios bench agent`: a scripted agent session replayed against `tokios serve` and llama-server,
turn after turn, and what each recomputes of the conversation it is re-sent.

The session is tools/bench/agent_session.py's: a system prompt with tool schemas, tool calls and
results, a regenerated turn and an interrupted one (a stream dropped after --interrupt-after
chunks), 20 turns. Both servers get the same conversation and the same tokens:

- the assistant turns re-sent are the script's, never a server's own answer (two servers answer
  differently even greedily, and then their next prompts would differ); what each generates
  (--max-tokens, greedy, fixed seed) is measured and dropped;
- the conversation is sent as plain text messages (agent_session.plain_messages: tools in the
  system prompt, calls and results as <tool_call> / <tool_response> text) rendered by one
  template file both servers are given (tokios --chat-template, llama-server --jinja
  --chat-template-file): each server's own tool prompt would differ.

Both are driven through the OpenAI chat API, streamed with usage. Per turn: the prompt tokens
(counted here with the same template and tokenizer, and checked against what each server
reports), the tokens each recomputed (tokios: prompt_tokens - prompt_tokens_details.cached_tokens;
llama-server: timings.prompt_n of its last chunk), the bound tokios is held to (the tokens after
the longest common prefix with what the server already computed, rounded up to a block, plus a
block; agent_session.recompute_bound), time to first token and the request's time. An
interrupted turn's counts never reach the client that dropped it ("-"); the turn after it shows
what the interruption cost. Servers run one after the other, never sharing the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.agent_session import (INTERRUPTED, MAX_TURNS, TURN, AgentTurn, agent_session,
                                              plain_messages, recompute_bound)
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.report import fmt, markdown_table

SECTION = "Agent session: the prefix cache across turns"
BLOCK_SIZE = 16  # tokios serve's default block size, which the bound is stated in


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.bench.compare import add_server_pair_arguments
    from tokios.tools.bench.peers import add_model_arguments

    add_model_arguments(parser)
    add_server_pair_arguments(parser, ctx_per_slot=8192)
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_NAME",
                        help="the template both servers render the session with: a Jinja file or a built-in "
                             "name (chatml, gemma); default: the GGUF's own")
    parser.add_argument("--turns", type=int, default=MAX_TURNS, help=f"turns of the session (1..{MAX_TURNS})")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each turn generates (greedy)")
    parser.add_argument("--interrupt-after", type=int, default=4,
                        help="streamed chunks the interrupted turn reads before it drops the connection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", default=None, metavar="PATH")


@dataclass
class TurnResult:
    index: int
    kind: str
    num_prompt_tokens: int  # counted here, with the template and tokenizer both servers use
    max_recomputed_tokens: int  # agent_session.recompute_bound
    num_reported_prompt_tokens: int | None  # the server's usage.prompt_tokens (None: not reported)
    num_recomputed_tokens: int | None
    ttft_s: float | None
    total_s: float
    error: str = ""


def _stream_turn(http, base_url: str, body: dict, is_interrupted: bool, interrupt_after: int) -> dict:
    """One streamed chat request: its usage, timings, answer text and times (dropped after
    interrupt_after content chunks when is_interrupted)."""
    import httpx

    started = time.perf_counter()
    first_token_s = None
    usage = timings = None
    text = []
    with http.stream("POST", base_url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise httpx.HTTPStatusError(f"HTTP {response.status_code}: {response.text[:300]}",
                                        request=response.request, response=response)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first_token_s = first_token_s or time.perf_counter() - started
                    text.append(content)
            if is_interrupted and len(text) >= interrupt_after:
                break  # leaving the block closes the connection mid-answer
    return {"usage": usage, "timings": timings, "text": "".join(text), "ttft_s": first_token_s,
            "total_s": time.perf_counter() - started}


def replay(base_url: str, server_name: str, turns: list[AgentTurn], prompt_ids: list[list[int]], tokenizer,
           args: argparse.Namespace) -> list[TurnResult]:
    import httpx

    results = []
    computed: list[list[int]] = []  # what the server has computed: each prompt and its answer
    # A connection per request: llama-server may close a kept-alive one as the next request goes out
    # on it ("Server disconnected without sending a response", seen after a streamed turn).
    with httpx.Client(timeout=600.0, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        model = http.get(base_url + "/v1/models").json()["data"][0]["id"]
        warm_up = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                   "temperature": 0}
        http.post(base_url + "/v1/chat/completions", json=warm_up).raise_for_status()
        for turn, ids in zip(turns, prompt_ids):
            bound = recompute_bound(ids, computed, BLOCK_SIZE)
            is_interrupted = turn.kind == INTERRUPTED
            body = {"model": model, "messages": plain_messages(turn.messages), "max_tokens": args.max_tokens,
                    "temperature": 0, "seed": args.seed, "stream": True, "stream_options": {"include_usage": True}}
            try:
                answer = _stream_turn(http, base_url, body, is_interrupted, args.interrupt_after)
            except (httpx.HTTPError, ValueError) as exc:
                results.append(TurnResult(turn.index, turn.kind, len(ids), bound, None, None, None, 0.0, str(exc)))
                computed.append(ids)
                continue
            usage, timings = answer["usage"], answer["timings"]
            num_reported = usage.get("prompt_tokens") if usage else None
            num_recomputed = None
            if server_name == "llama.cpp" and timings and not is_interrupted:
                num_recomputed = timings.get("prompt_n")
            elif usage:
                num_recomputed = usage["prompt_tokens"] - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            results.append(TurnResult(turn.index, turn.kind, len(ids), bound, num_reported, num_recomputed,
                                      answer["ttft_s"], answer["total_s"]))
            # The answer's tokens as the server computed them, near enough: its text encoded again.
            computed.append(ids + tokenizer.encode(answer["text"], add_special_tokens=False))
            print(f"  turn {turn.index} ({turn.kind}): {len(ids)} prompt tokens, recomputed "
                  f"{'-' if num_recomputed is None else num_recomputed} (bound {bound}), "
                  f"{answer['total_s']:.2f} s", file=sys.stderr)
    return results


def table(name_to_results: dict[str, list[TurnResult]]) -> str:
    names = list(name_to_results)
    first = name_to_results[names[0]]
    headers = ["turn", "kind", "prompt tokens", "bound"]
    for name in names:
        headers += [f"{name} recomputed", f"{name} TTFT ms", f"{name} time ms"]
    rows = []
    for position, turn in enumerate(first):
        row = [str(turn.index), turn.kind, str(turn.num_prompt_tokens), str(turn.max_recomputed_tokens)]
        for name in names:
            result = name_to_results[name][position]
            recomputed = "-" if result.num_recomputed_tokens is None else str(result.num_recomputed_tokens)
            if result.error:
                recomputed = "failed"
            row += [recomputed, fmt(None if result.ttft_s is None else result.ttft_s * 1000, 0),
                    fmt(result.total_s * 1000, 0)]
        rows.append(row)
    total = ["total", "", str(sum(t.num_prompt_tokens for t in first)),
             str(sum(t.max_recomputed_tokens for t in first))]
    for name in names:
        results = name_to_results[name]
        total += [str(sum(r.num_recomputed_tokens or 0 for r in results)),
                  fmt(sum((r.ttft_s or 0.0) for r in results) * 1000, 0),
                  fmt(sum(r.total_s for r in results) * 1000, 0)]
    rows.append(total)
    return markdown_table(headers, rows)


def verdicts(name_to_results: dict[str, list[TurnResult]]) -> list[str]:
    lines = []
    for name, results in name_to_results.items():
        measured = [r for r in results if r.num_recomputed_tokens is not None]
        within = sum(1 for r in measured if r.num_recomputed_tokens <= r.max_recomputed_tokens)
        mismatched = [r.index for r in results if r.num_reported_prompt_tokens not in (None, r.num_prompt_tokens)]
        line = f"{name}: {within} of {len(measured)} reported turns within the bound"
        if mismatched:
            line += f"; its prompt token count differs from the client's at turns {mismatched}"
        failed = [r.index for r in results if r.error]
        if failed:
            line += f"; failed turns {failed}: {next(r.error for r in results if r.error)}"
        lines.append(line + ".")
    return lines


def docs_body(args: argparse.Namespace, turns: list[AgentTurn], text: str, lines: list[str]) -> str:
    kinds = ", ".join(f"turn {turn.index} {turn.kind}" for turn in turns if turn.kind != TURN)
    return (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
            f"The scripted {len(turns)}-turn agent session (tools/bench/agent_session.py: tool schemas, tool calls "
            f"and results; {kinds or 'no regenerated or interrupted turn'}; an interrupted turn reads "
            f"{args.interrupt_after} streamed chunks), the same conversation and tokens sent to each server through "
            f"the OpenAI chat API, {args.max_tokens} greedy tokens a turn. Recomputed: tokios prompt_tokens - "
            f"cached_tokens, llama-server timings.prompt_n; bound: the tokens after the longest common prefix with "
            f"what the server already computed, rounded up to a {BLOCK_SIZE}-token block, plus a block.\n\n"
            f"{text}\n\n" + "\n".join(f"- {line}" for line in lines))


def _template_source(args: argparse.Namespace, model_path: str) -> str:
    from tokios.tokenizer.chat_template import resolve_chat_template
    from tokios.tokenizer.tokenizer import Tokenizer

    if args.chat_template is not None:
        return resolve_chat_template(args.chat_template)
    source = Tokenizer.from_gguf_file(model_path).chat_template
    if not source:
        raise InvalidRequestError(f"{model_path} has no chat template: pass --chat-template (a file, or a built-in "
                                  "name such as gemma)", param="chat_template")
    return source


def run(args: argparse.Namespace) -> int:
    from tokios.tools.bench.compare import llama_server_command, tokios_command
    from tokios.tools.bench.peers import ServerProcess, benchmark_model_path, find_llama_server, free_port
    from tokios.tokenizer.tokenizer import Tokenizer

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in ("tokios", "llama.cpp") for s in servers):
        raise InvalidRequestError(f"servers must be a subset of tokios,llama.cpp, got {args.servers!r}",
                                  param="servers")
    if not 1 <= args.turns <= MAX_TURNS:
        raise InvalidRequestError(f"turns must be in 1..{MAX_TURNS}, got {args.turns}", param="turns")
    if args.max_tokens < 1 or args.interrupt_after < 1:
        raise InvalidRequestError("max_tokens and interrupt_after must be at least 1", param="max_tokens")
    model_path = benchmark_model_path(args)
    source = _template_source(args, model_path)
    tokenizer = Tokenizer.from_gguf_file(model_path).with_chat_template(source)
    turns = agent_session(args.turns)
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(plain_messages(turn.messages),
                                                                 add_generation_prompt=True), add_special_tokens=False)
                  for turn in turns]
    if max(len(ids) for ids in prompt_ids) + args.max_tokens > args.ctx_per_slot:
        raise InvalidRequestError(f"ctx_per_slot {args.ctx_per_slot} is below the session's longest request",
                                  param="ctx_per_slot")
    binary = find_llama_server(args.llama_server) if "llama.cpp" in servers else None
    compare_args = argparse.Namespace(ctx_per_slot=args.ctx_per_slot, dtype=args.dtype, threads=args.threads,
                                      llama_server_args=args.llama_server_args, tokios_args=args.tokios_args)
    name_to_results: dict[str, list[TurnResult]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", encoding="utf-8") as template_file:
        template_file.write(source)
        template_file.flush()
        for name in servers:
            port = free_port()
            if name == "llama.cpp":
                command = llama_server_command(compare_args, binary, model_path, port, 1) + [
                    "--jinja", "--chat-template-file", template_file.name]
            else:
                command = tokios_command(compare_args, model_path, port, 1) + ["--chat-template", template_file.name]
            print(f"{name}: {' '.join(command)}", file=sys.stderr)
            with ServerProcess(name, command, port).start(timeout_s=args.startup_timeout) as server:
                name_to_results[name] = replay(server.base_url, name, turns, prompt_ids, tokenizer, args)
    text = table(name_to_results)
    lines = verdicts(name_to_results)
    print(text)
    print("\n".join(lines))
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "results": {name: [asdict(r) for r in results] for name, results in name_to_results.items()}})
    if args.write_docs:
        # One section per model file, so that the SmolLM2 and the Gemma 3 runs stand side by side.
        report.update_docs_section(args.write_docs, f"{SECTION} ({Path(model_path).name})",
                                   docs_body(args, turns, text, lines))
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0
