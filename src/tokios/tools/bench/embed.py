"""`tokios bench embed`: embedding throughput against llama-server on the same GGUF, and what an
embedding load does to chat streams decoding on another model of the same server.

Throughput: --num-sentences sentences of --min-tokens..--max-tokens tokens (seeded words of the
model's own vocabulary, lengths counted with its tokenizer, [CLS] and [SEP] included), sent as
batches of --batch-size inputs by --concurrency clients through the OpenAI /v1/embeddings API,
to `tokios serve` and to `llama-server --embedding` in turn, never at once, with the same
threads; --rounds rounds, servers alternating. Embeddings per second (all sentences over the
wall time) and each request's latency (p50 / p99); the ratio is tokios over llama-server, per
round, and its median.

Interference: `tokios serve` with a chat model and the embedding model; --chat-streams streams
of --chat-tokens greedy tokens each (ignore_eos) decode on the chat model, alone and then with
--concurrency embedding clients sending batches for as long as the streams run. The streams'
inter-token gaps (p50 / p99) with and without the embedding load, and the embeddings per second
the load got meanwhile; rounds alternate the two.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from tokios.errors import InvalidRequestError
from tokios.tools.bench import report
from tokios.tools.bench.offline import machine_line, noise_note
from tokios.tools.bench.stats import percentile, ratio

SECTION = "Embeddings: tokios vs llama-server, and chat streams beside an embedding load"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="embedding model GGUF (default: all-MiniLM-L6-v2 as llama.cpp's converter writes it, F32)")
    parser.add_argument("--chat-model", default=None, help="chat model GGUF for the interference part (default: "
                                                           "the default model)")
    parser.add_argument("--num-sentences", type=int, default=10_000)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--servers", default="tokios,llama.cpp", help="which servers the throughput part runs")
    parser.add_argument("--chat-streams", type=int, default=8, help="0 skips the interference part")
    parser.add_argument("--chat-tokens", type=int, default=256)
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: the cached build)")
    parser.add_argument("--llama-parallel", type=int, default=4,
                        help="llama-server --parallel (slots; 4 was its fastest of 1, 2, 4, 8, 16, 32 on all-MiniLM-L6-v2)")
    parser.add_argument("--tokios-args", default="", help="extra arguments for tokios serve (one string)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--write-docs", default=None, metavar="PATH",
                        help="replace this benchmark's section of a Markdown file (docs/benchmarks.md)")


def sentences(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """`count` sentences of whole words from the vocabulary, each min..max tokens long as the
    tokenizer counts them (special tokens included), lengths spread evenly."""
    words = [token for token in (tokenizer.convert_ids_to_tokens([token_id])[0]
                                 for token_id in range(tokenizer.vocab_size))
             if token.isalpha() and token.islower() and len(token) >= 3]
    if not words:
        raise InvalidRequestError("the model's vocabulary has no plain words to make sentences of", param="model")
    rng = random.Random(seed)
    result = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens)
        text = rng.choice(words).capitalize()
        while True:
            candidate = f"{text} {rng.choice(words)}"
            if len(tokenizer.encode(candidate + ".", add_special_tokens=True)) > target:
                break
            text = candidate
        result.append(text + ".")
    return result


@dataclass
class ThroughputRun:
    server: str
    num_embeddings: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def embeddings_per_s(self) -> float:
        return self.num_embeddings / self.wall_s if self.wall_s > 0 else float("nan")


def _post_embeddings(client, base_url: str, model: str, texts: list[str]) -> int:
    response = client.post(f"{base_url}/v1/embeddings", json={"model": model, "input": texts}, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
    data = response.json()["data"]
    if len(data) != len(texts):
        raise RuntimeError(f"{len(data)} embeddings for {len(texts)} inputs")
    return len(data)


def run_throughput(server: str, base_url: str, model: str, texts: list[str], batch_size: int,
                   concurrency: int, stop: threading.Event | None = None) -> ThroughputRun:
    """Sends every batch once (or, with `stop`, loops over them until it is set)."""
    import httpx

    batches = [texts[start:start + batch_size] for start in range(0, len(texts), batch_size)]
    next_batch = iter(range(10**12) if stop is not None else range(len(batches)))
    lock = threading.Lock()
    run = ThroughputRun(server, 0, 0.0)

    def client_loop() -> None:
        with httpx.Client() as client:
            while stop is None or not stop.is_set():
                with lock:
                    index = next(next_batch, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    count = _post_embeddings(client, base_url, model, batches[index % len(batches)])
                except Exception as exc:  # counted and reported, the run goes on
                    with lock:
                        run.errors.append(str(exc))
                    continue
                with lock:
                    run.latencies_s.append(time.perf_counter() - started)
                    run.num_embeddings += count

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - started
    return run


def _stream_gaps(base_url: str, model: str, max_tokens: int, gaps: list[float], lock: threading.Lock,
                 index: int) -> None:
    import httpx

    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Tell story number {index} about a lighthouse keeper."}]}
    times = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                times.append(time.perf_counter())
    with lock:
        gaps.extend(current - previous for previous, current in zip(times, times[1:]))


def run_chat(base_url: str, chat_model: str, num_streams: int, num_tokens: int, embed_model: str | None,
             texts: list[str], batch_size: int, concurrency: int) -> tuple[list[float], ThroughputRun | None]:
    """The streams' inter-token gaps, with an embedding load running beside them when embed_model."""
    gaps: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()
    load: list[ThroughputRun] = []
    load_thread = None
    if embed_model is not None:
        load_thread = threading.Thread(target=lambda: load.append(
            run_throughput("tokios", base_url, embed_model, texts, batch_size, concurrency, stop)))
        load_thread.start()
        time.sleep(0.5)  # the load is running before the streams start
    threads = [threading.Thread(target=_stream_gaps, args=(base_url, chat_model, num_tokens, gaps, lock, index))
               for index in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    if load_thread is not None:
        load_thread.join()
    return gaps, (load[0] if load else None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def run(args: argparse.Namespace) -> int:
    import shlex

    from tokios.model_files import default_model_path, minilm_gguf_path
    from tokios.tokenizer import load_tokenizer
    from tokios.tools.bench.compare import llama_machine_arguments
    from tokios.tools.bench.peers import ServerProcess, find_llama_server, free_port

    for name in ("num_sentences", "batch_size", "concurrency", "rounds", "threads", "min_tokens"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1, got {getattr(args, name)}", param=name)
    if args.max_tokens < args.min_tokens:
        raise InvalidRequestError("max_tokens must be >= min_tokens", param="max_tokens")
    servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    if any(name not in ("tokios", "llama.cpp") for name in servers):
        raise InvalidRequestError(f"servers must be a subset of tokios,llama.cpp, got {args.servers!r}",
                                  param="servers")
    model_path = args.model or str(minilm_gguf_path("f32"))
    chat_path = args.chat_model or str(default_model_path())
    tokenizer = load_tokenizer(model_path)
    texts = sentences(tokenizer, args.num_sentences, args.min_tokens, args.max_tokens, args.seed)
    lengths = [len(tokenizer.encode(text, add_special_tokens=True)) for text in texts]
    max_len = max(lengths)
    binary = find_llama_server(args.llama_server) if "llama.cpp" in servers else None

    def tokios_command(port: int, *models: str) -> list[str]:
        command = [sys.executable, "-m", "tokios.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--threads", str(args.threads)]
        for model in models:
            command += ["--model", model]
        return command + shlex.split(args.tokios_args)

    def llama_command(port: int) -> list[str]:
        # Every input is one sequence of a slot; a non-causal model needs each input whole in one
        # micro-batch, so the micro-batch takes the longest input of all slots together.
        context = args.llama_parallel * max(max_len, 64)
        return [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "--embedding",
                "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(args.llama_parallel),
                "-c", str(context), "-b", str(context), "-ub", str(context), "--no-webui",
                *llama_machine_arguments()]

    rounds: list[dict[str, ThroughputRun]] = []
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else list(reversed(servers))
        results = {}
        for name in order:
            port = free_port()
            command = tokios_command(port, f"{model_path}=embed") if name == "tokios" else llama_command(port)
            print(f"round {round_index + 1}, {name}: {' '.join(command)}", file=sys.stderr)
            with ServerProcess(f"bench-embed-{name}", command, port).start(timeout_s=args.startup_timeout) as server:
                run_throughput(name, server.base_url, "embed", texts[:args.batch_size * args.concurrency],
                               args.batch_size, args.concurrency)  # warm-up
                results[name] = run_throughput(name, server.base_url, "embed", texts, args.batch_size,
                                               args.concurrency)
            result = results[name]
            print(f"  {name}: {result.embeddings_per_s:.1f} embeddings/s, p99 {_ms(percentile(result.latencies_s, 99))} "
                  f"ms, {len(result.errors)} errors", file=sys.stderr)
        rounds.append(results)

    chat_rounds: list[dict] = []
    if args.chat_streams > 0:
        port = free_port()
        command = tokios_command(port, f"{chat_path}=chat", f"{model_path}=embed")
        print(f"interference: {' '.join(command)}", file=sys.stderr)
        with ServerProcess("bench-embed-chat", command, port).start(timeout_s=args.startup_timeout) as server:
            run_chat(server.base_url, "chat", 2, 8, "embed", texts, args.batch_size, 1)  # both models loaded
            for round_index in range(args.rounds):
                alone, _ = run_chat(server.base_url, "chat", args.chat_streams, args.chat_tokens, None, texts,
                                    args.batch_size, args.concurrency)
                loaded, load = run_chat(server.base_url, "chat", args.chat_streams, args.chat_tokens, "embed", texts,
                                        args.batch_size, args.concurrency)
                chat_rounds.append({"alone": alone, "loaded": loaded, "load": load})
                print(f"  round {round_index + 1}: inter-token p99 {_ms(percentile(alone, 99))} ms alone, "
                      f"{_ms(percentile(loaded, 99))} ms beside {load.embeddings_per_s:.1f} embeddings/s",
                      file=sys.stderr)

    text = tables(args, rounds, chat_rounds, lengths)
    print(text)
    if args.json_path:
        report.write_json(args.json_path, {
            "command": report.command_line(), "machine": machine_line(),
            "throughput": [{name: {"embeddings_per_s": result.embeddings_per_s, "wall_s": result.wall_s,
                                   "latency_p50_s": percentile(result.latencies_s, 50),
                                   "latency_p99_s": percentile(result.latencies_s, 99),
                                   "errors": result.errors[:5]} for name, result in results.items()}
                           for results in rounds],
            "chat": [{"itl_alone_p50_s": percentile(r["alone"], 50), "itl_alone_p99_s": percentile(r["alone"], 99),
                      "itl_loaded_p50_s": percentile(r["loaded"], 50), "itl_loaded_p99_s": percentile(r["loaded"], 99),
                      "load_embeddings_per_s": r["load"].embeddings_per_s} for r in chat_rounds]})
    if args.write_docs:
        body = (f"Command: `{report.command_line()}`\n\nMeasured {machine_line()}. {noise_note()}\n\n"
                f"{args.num_sentences} sentences of {min(lengths)}-{max(lengths)} tokens (median "
                f"{statistics.median(lengths):.0f}), batches of {args.batch_size}, {args.concurrency} concurrent clients, "
                f"OpenAI /v1/embeddings, {args.threads} threads each; llama-server --embedding --parallel "
                f"{args.llama_parallel}. Model: `{model_path.rsplit('/', 1)[-1]}`.\n\n{text}")
        # One section per model file, so that the F32 and the Q8_0 runs stand side by side.
        report.update_docs_section(args.write_docs, f"{SECTION} ({model_path.rsplit('/', 1)[-1]})", body)
        print(f"updated {args.write_docs}", file=sys.stderr)
    return 0


def tables(args: argparse.Namespace, rounds: list[dict[str, ThroughputRun]], chat_rounds: list[dict],
           lengths: list[int]) -> str:
    lines = ["| round | server | embeddings/s | request p50 ms | request p99 ms | errors | embeddings/s vs llama-server |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for index, results in enumerate(rounds, 1):
        llama = results.get("llama.cpp")
        for name, result in results.items():
            versus = ratio(result.embeddings_per_s, llama.embeddings_per_s) if llama and name != "llama.cpp" else None
            if versus is not None:
                ratios.append(versus)
            lines.append(f"| {index} | {name} | {result.embeddings_per_s:.1f} | {_ms(percentile(result.latencies_s, 50))} "
                         f"| {_ms(percentile(result.latencies_s, 99))} | {len(result.errors)} | "
                         f"{'-' if versus is None else f'{versus:.2f}x'} |")
    text = "\n".join(lines)
    if ratios:
        text += f"\n\nMedian embeddings/s ratio, tokios / llama-server: {statistics.median(ratios):.2f}x ({len(ratios)} rounds)."
    if chat_rounds:
        chat_lines = ["| round | inter-token p50 ms, alone | p99 alone | p50 beside the embeddings | p99 beside | "
                      "p99 ratio | embeddings/s meanwhile |", "|---|---|---|---|---|---|---|"]
        p99_ratios = []
        for index, result in enumerate(chat_rounds, 1):
            p99_ratio = ratio(percentile(result["loaded"], 99), percentile(result["alone"], 99))
            p99_ratios.append(p99_ratio)
            chat_lines.append(f"| {index} | {_ms(percentile(result['alone'], 50))} | {_ms(percentile(result['alone'], 99))} "
                              f"| {_ms(percentile(result['loaded'], 50))} | {_ms(percentile(result['loaded'], 99))} "
                              f"| {p99_ratio:.2f}x | {result['load'].embeddings_per_s:.1f} |")
        text += (f"\n\n{args.chat_streams} chat streams of {args.chat_tokens} greedy tokens on the chat model, alone and "
                 f"beside {args.concurrency} embedding clients on the embedding model, same server:\n\n"
                 + "\n".join(chat_lines)
                 + f"\n\nMedian inter-token p99 ratio (beside / alone): {statistics.median(p99_ratios):.2f}x.")
    return text
