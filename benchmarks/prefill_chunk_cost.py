"""What a long prompt's chunk adds to a step that also decodes other streams, by chunk size and by
the chunk's context: the engine's own steps, timed (`EngineCore.step`, median of --steps).

--streams requests decode (prompts of --stream-prompt tokens); a long prompt is prefilled in large
chunks up to each --contexts length, then, with the scheduler's floor forced to each --chunks
value and a budget too small for more, every step carries the streams' decodes and exactly that
many of its tokens. Chunk 0 is the same streams' decode-only step at that moment (the long
prompt set aside). This is what sets the streams' inter-token latency while a long prompt is
prefilled under a step budget (`tokios bench fairness`).

    python benchmarks/prefill_chunk_cost.py --contexts 1500,4500 --chunks 0,1,2,4,8,16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import tokios.scheduler.scheduler as scheduler_module
from tokios.engine import LLM
from tokios.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or directory (default: the default model)")
    parser.add_argument("--contexts", default="1500,4500")
    parser.add_argument("--chunks", default="0,1,2,4,8,16")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt", type=int, default=400)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kv-cache-dtype", default="bfloat16")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(model=args.model, max_step_ms=0.001, kv_cache_memory="2GiB", kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=max(contexts) + 1024)
    core = llm.core
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(length)]

    core.add_requests([core.make_requests(f"stream{i}", prompt(args.stream_prompt),
                                          SamplingParams(max_tokens=len(contexts) * 2000, ignore_eos=True))[0]
                       for i in range(args.streams)])
    for _ in range(20):
        core.step()

    def median_step_ms() -> float:
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            core.step()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{args.streams} streams decoding; a step's median ms with a chunk of N tokens of a long prompt "
          f"at that context (N = 0: the decode-only step)")
    print("| long prompt's context | " + " | ".join(f"chunk {n}" for n in chunks) + " |")
    print("|---|" + "---|" * len(chunks))
    for context in contexts:
        request_id = f"long{context}"
        core.add_requests(core.make_requests(request_id, prompt(context + 1000), SamplingParams(max_tokens=1)))
        long_prompt = core.scheduler.requests[request_id]
        scheduler_module.MIN_PREFILL_CHUNK = 64
        while long_prompt.num_computed_tokens < context:
            core.step()
        figures = []
        for chunk in chunks:
            if chunk == 0:
                core.scheduler.running.remove(long_prompt)
                figures.append(median_step_ms())
                core.scheduler.running.append(long_prompt)
            else:
                scheduler_module.MIN_PREFILL_CHUNK = chunk
                figures.append(median_step_ms())
        print(f"| {context:,} | " + " | ".join(f"{ms:.1f}" for ms in figures) + " |", flush=True)
        core.abort([request_id])


if __name__ == "__main__":
    main()
