"""The systems the offline benchmarks time, behind one small interface.

Each system takes prompts as token ids (all three read the same GGUF and the same vocabulary, so
the same ids mean the same text) and is timed from outside with perf_counter, the same way for
all: time to first token of a prompt, the first-to-last token time of a greedy decode that ignores
EOS, and the wall time of a batch of prompts. Systems:
- tokios: tokios.engine.LLM (and its RequestMetrics for the decode span when it fills them);
- llama.cpp: llama-cpp-python's Llama with n_threads=2 (its own prompt-prefix reuse stays on, as
  in real use; the callers vary prompt starts where a measurement must not hit a cache);
- transformers: AutoModelForCausalLM on the GGUF (dequantized), bf16 by default.
Used by offline.py and prefix.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DecodeTiming:
    num_tokens: int
    first_to_last_s: float  # from the first generated token to the last

    @property
    def tokens_per_s(self) -> float:
        return (self.num_tokens - 1) / self.first_to_last_s if self.first_to_last_s > 0 else float("nan")


@dataclass(frozen=True)
class BatchTiming:
    num_input_tokens: int
    num_output_tokens: int
    wall_s: float


class TokiosSystem:
    def __init__(self, model_path: str, *, dtype: str = "auto", **engine_options):
        """engine_options: LLM's (the engine flags of the benchmark's command line)."""
        from tokios.engine import LLM

        started = time.perf_counter()
        self.llm = LLM(model=model_path, dtype=dtype, **engine_options)
        self.load_s = time.perf_counter() - started
        # What auto became on the device the engine chose (config.AUTO_DTYPE_BY_DEVICE).
        self.name = f"tokios ({dtype if dtype != 'auto' else 'auto=' + self.llm.core.weight_format})"

    def _params(self, max_tokens: int):
        from tokios.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def first_token_s(self, prompt_ids: list[int]) -> float:
        started = time.perf_counter()
        self.llm.generate([prompt_ids], self._params(1), use_tqdm=False)
        return time.perf_counter() - started

    def decode(self, prompt_ids: list[int], num_tokens: int) -> DecodeTiming:
        started = time.perf_counter()
        output = self.llm.generate([prompt_ids], self._params(num_tokens), use_tqdm=False)[0]
        wall_s = time.perf_counter() - started
        generated = len(output.outputs[0].token_ids)
        metrics = output.metrics
        last = metrics and (metrics.last_token_time or metrics.finished_time)
        if metrics and metrics.first_token_time and last:
            return DecodeTiming(generated, last - metrics.first_token_time)
        # Without engine metrics: the whole call less the time to the first token (one more run).
        return DecodeTiming(generated, wall_s - self.first_token_s(prompt_ids))

    def batch(self, prompts_ids: list[list[int]], max_tokens: int) -> BatchTiming:
        started = time.perf_counter()
        outputs = self.llm.generate(prompts_ids, self._params(max_tokens), use_tqdm=False)
        wall_s = time.perf_counter() - started
        return BatchTiming(sum(len(p) for p in prompts_ids),
                           sum(len(o.outputs[0].token_ids) for o in outputs), wall_s)


class LlamaCppSystem:
    def __init__(self, model_path: str, *, num_threads: int = 2, n_ctx: int = 4096, n_batch: int = 512):
        from tokios.tools.bench.peers import require_llama_cpp

        llama_cpp = require_llama_cpp()
        started = time.perf_counter()
        self.llama = llama_cpp.Llama(model_path=model_path, n_threads=num_threads, n_threads_batch=num_threads,
                                     n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, verbose=False, seed=0)
        self.load_s = time.perf_counter() - started
        self.name = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {num_threads} threads)"

    def _tokens(self, prompt_ids: list[int]):
        # temp=0 is greedy; repeat_penalty=1 switches the penalty off (as in tokios' greedy).
        return self.llama.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)

    def first_token_s(self, prompt_ids: list[int]) -> float:
        started = time.perf_counter()
        tokens = self._tokens(prompt_ids)
        next(tokens)
        elapsed = time.perf_counter() - started
        tokens.close()
        return elapsed

    def decode(self, prompt_ids: list[int], num_tokens: int) -> DecodeTiming:
        times = []
        tokens = self._tokens(prompt_ids)
        for _ in tokens:  # generate() never stops at EOS by itself: EOS is ignored here
            times.append(time.perf_counter())
            if len(times) == num_tokens:
                break
        tokens.close()
        return DecodeTiming(len(times), times[-1] - times[0])

    def batch(self, prompts_ids: list[list[int]], max_tokens: int) -> BatchTiming:
        """One prompt after another: the binding has no batched generate."""
        started = time.perf_counter()
        num_output = 0
        for prompt_ids in prompts_ids:
            tokens = self._tokens(prompt_ids)
            for num_output_here, _ in enumerate(tokens, start=1):
                if num_output_here == max_tokens:
                    break
            tokens.close()
            num_output += num_output_here
        return BatchTiming(sum(len(p) for p in prompts_ids), num_output, time.perf_counter() - started)


class TransformersSystem:
    def __init__(self, model_path: str, *, dtype: str = "bfloat16"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        started = time.perf_counter()
        path = Path(model_path)
        if path.is_dir():  # a Hugging Face directory
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=getattr(torch, dtype))
        self.model.eval()
        self.load_s = time.perf_counter() - started
        import transformers

        self.name = f"transformers {transformers.__version__} ({dtype})"

    def first_token_s(self, prompt_ids: list[int]) -> float:
        torch = self.torch
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt_ids])).logits[:, -1]
            int(logits.argmax())
        return time.perf_counter() - started

    def decode(self, prompt_ids: list[int], num_tokens: int) -> DecodeTiming:
        torch = self.torch
        streamer = _TimingStreamer()
        with torch.inference_mode():
            self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                do_sample=False, streamer=streamer, pad_token_id=0)
        return DecodeTiming(len(streamer.token_times), streamer.token_times[-1] - streamer.token_times[0])


class _TimingStreamer:
    """transformers streamer that records when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.token_times: list[float] = []
        self._has_seen_prompt = False

    def put(self, value) -> None:
        if not self._has_seen_prompt:
            self._has_seen_prompt = True
            return
        self.token_times.append(time.perf_counter())

    def end(self) -> None:
        pass
