"""LLM: offline, synchronous generation over the engine core (vLLM-shaped API).

    llm = LLM()                       # the default model
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

    # any engine flag, by its dest: speculative decoding (docs/speculative.md), tensor parallel
    llm = LLM(speculative_method="ngram", num_speculative_tokens=4, tensor_parallel_size=3)
"""

from __future__ import annotations

import itertools
from typing import Sequence

from tokios import sampling_defaults
from tokios.config import EngineConfig
from tokios.engine.core import EngineCore, EngineStats
from tokios.engine.output_processor import OutputProcessor, sequence_ids
from tokios.errors import InvalidRequestError
from tokios.outputs import RequestOutput
from tokios.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, *, max_step_ms: float | str | None = None, **options):
        """options: EngineConfig.from_options's (config.py), named as the engine flags' dests
        (engine_flags.py): dtype, device, num_threads, kv_cache_memory ("512MiB"),
        kv_cache_dtype, block_size, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
        max_model_len, tensor_parallel_size, speculative_method, ..., seed; or a whole
        speculative_config / parallel_config, for the settings that have no flag."""
        # max_step_ms defaults to None here, unlike the commands: a batch run has no one waiting
        # on a stream, so prefill chunks are cut by the token budget alone (SchedulerConfig).
        self.engine_config = EngineConfig.from_options(model=model, max_step_ms=max_step_ms, **options)
        self.core = EngineCore(self.engine_config)
        self.tokenizer = self.core.tokenizer
        self.model_config = self.core.model_config
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params gets: the model's recommended sampling
        (tokios/sampling_defaults.py), the set `tokios serve` gives a request that sets none."""
        return SamplingParams(**sampling_defaults.for_model(self.core.model_path).apply({}))

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params_list)} sampling params",
                                      param="sampling_params")
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_ids.append(self._add(prompt, params))
            finished: dict[str, RequestOutput] = {}
            while self.core.has_unfinished:
                outputs, stopped = self.output_processor.process(self.core.step())
                self.core.abort(stopped)
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                failures = self.output_processor.take_failures()
                if failures:
                    raise failures[0][1]
        except BaseException:
            # Leave the engine as it was before the call: every request of this call aborted.
            self._abort_all(request_ids)
            raise
        return [finished[request_id] for request_id in request_ids]

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.output_processor.requests.get(request_id)
            if state is not None:
                self.core.abort(sequence_ids(request_id, state.params.n))
                self.output_processor.remove_request(request_id)
            else:
                self.core.abort([request_id])

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, sampling_params)

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        sequences = self.core.make_requests(request_id, token_ids, params)
        self.output_processor.add_request(request_id, text, token_ids, params)
        self.core.add_requests(sequences)
        return request_id

    def close(self) -> None:
        """Write the prefix cache to its disk tier (--kv-cache-disk), so the next start is warm, and
        stop a parallel group's ranks."""
        try:
            self.core.save_prefix_cache()
        finally:
            self.core.close()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def weight_bytes(self) -> int:
        return self.core.model.weight_bytes()

    def weight_bytes_read(self) -> int | None:
        """The weight bytes the model's quantized kernels have read so far, every step's (a
        mixture of experts: its chosen experts' only); None where some product runs off them."""
        return self.core.weight_bytes_read()

    def kv_bytes_per_token(self) -> int:
        return self.core.kv_bytes_per_token
