"""LLM: offline, synchronous generation over the engine core (vLLM-shaped API).

    llm = LLM()                       # the default model
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

    # speculative decoding (docs/speculative.md)
    llm = LLM(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
"""

from __future__ import annotations

import itertools
from typing import Sequence

from tokios.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig, parse_size
from tokios.engine.core import EngineCore, EngineStats
from tokios.engine.output_processor import OutputProcessor, sequence_ids
from tokios.errors import InvalidRequestError
from tokios.outputs import RequestOutput
from tokios.sampling_params import SamplingParams
from tokios.speculative.config import SpeculativeConfig

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 kv_cache_memory: str | int = "512MiB", block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 num_threads: int | None = None, seed: int = 0,
                 speculative_config: SpeculativeConfig | None = None, kv_cache_dtype: str = "auto",
                 chat_template: str | None = None, max_step_ms: float | str | None = None,
                 kv_cache_disk: str | None = None, kv_cache_disk_size: str | int = "4GiB",
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 parallel_config: ParallelConfig | None = None, prefill_layer_slices: bool = True):
        if parallel_config is not None and (tensor_parallel_size, pipeline_parallel_size) != (1, 1) and \
                (tensor_parallel_size, pipeline_parallel_size) != (parallel_config.tensor_parallel_size,
                                                                   parallel_config.pipeline_parallel_size):
            raise InvalidRequestError("give the parallel sizes either as tensor_parallel_size / "
                                      "pipeline_parallel_size or in parallel_config, not both differently",
                                      param="parallel_config")
        # max_step_ms defaults to None here, unlike the server: a batch run has no one waiting
        # on a stream, so prefill chunks are cut by the token budget alone (SchedulerConfig).
        self.engine_config = EngineConfig(
            load=LoadConfig(model=model, dtype=dtype, device=device, num_threads=num_threads,
                            chat_template=chat_template),
            cache=CacheConfig(block_size=block_size,
                              kv_cache_memory_bytes=parse_size(kv_cache_memory, field_name="kv_cache_memory"),
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                              kv_cache_disk=kv_cache_disk,
                              kv_cache_disk_bytes=parse_size(kv_cache_disk_size, field_name="kv_cache_disk_size")),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, max_step_ms=max_step_ms,
                                      prefill_layer_slices=prefill_layer_slices),
            speculative=speculative_config or SpeculativeConfig(),
            parallel=parallel_config or ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                       pipeline_parallel_size=pipeline_parallel_size),
            seed=seed)
        self.core = EngineCore(self.engine_config)
        self.tokenizer = self.core.tokenizer
        self.model_config = self.core.model_config
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
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

    def kv_bytes_per_token(self) -> int:
        return self.core.kv_bytes_per_token
