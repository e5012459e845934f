"""The model runner: the only layer that builds tensors.

Each step it turns a SchedulerOutput into one flattened batch (decodes first, then
multi-token spans), fills AttentionMetadata once for all layers, runs the model, computes
logits only at the positions that are sampled (plus every prompt position of a request that
asked for prompt logprobs), samples, and returns token ids as Python ints: one host sync per
step. It also owns the KV cache tensors and each request's sampling state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokios.config import ModelConfig
from tokios.model.attention import AttentionMetadata, MultiTokenSpan
from tokios.request import Request
from tokios.sampler.metadata import SamplingMetadata
from tokios.sampler.sampler import Sampler
from tokios.sampler.state import RequestSamplingState, SamplingStateStore
from tokios.scheduler.scheduler import ScheduledRequest, SchedulerOutput

# (token id, logprob, rank) of the sampled token, then the top alternatives as (token id, logprob).
SampleLogprobs = tuple[int, float, int | None, list[tuple[int, float]]]
# Per prompt position after the first: (token id, logprob, top alternatives).
PromptLogprobs = list[tuple[int, float, list[tuple[int, float]]]]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, seed: int = 0):
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        shape = (num_slots, model_config.num_kv_heads, model_config.head_dim)
        # One (key, value) pair per layer: [num_slots, kv_heads, head_dim].
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device))
                          for _ in range(model_config.num_layers)]
        self.state_store = SamplingStateStore(model_config.vocab_size, device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.request_to_state: dict[str, RequestSamplingState] = {}

    # ---- per-request state ------------------------------------------------------------------
    def _state(self, request: Request) -> RequestSamplingState:
        state = self.request_to_state.get(request.request_id)
        if state is None:
            suppressed = request.eos_token_ids | request.stop_token_ids
            state = self.state_store.add(request.sampling_params, request.prompt_token_ids, suppressed)
            self.request_to_state[request.request_id] = state
        return state

    def drop_request(self, request_id: str) -> None:
        state = self.request_to_state.pop(request_id, None)
        if state is not None:
            self.state_store.remove(state)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        src = torch.tensor([s * bs + i for s, _ in copies for i in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + i for _, d in copies for i in range(bs)], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
            value_cache.index_copy_(0, dst, value_cache.index_select(0, src))

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.drop_request(request_id)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        if scheduler_output.is_empty:
            return RunnerOutput()
        # Decodes (one query token) first: attention batches them; the rest are spans.
        batch = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, metadata, sample_rows, prompt_rows = self._prepare(batch)
        hidden = self.model.forward(input_ids, positions, metadata, self.kv_caches)
        output = RunnerOutput()
        sampling = [s for s in batch if s.samples_this_step]
        if sampling:
            self._sample(sampling, hidden[sample_rows], output)
        for scheduled, rows in prompt_rows:
            self._prompt_logprobs(scheduled, hidden[rows], output)
        return output

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        token_chunks, position_chunks, slot_chunks = [], [], []
        decode_slots: list[np.ndarray] = []
        spans: list[MultiTokenSpan] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[ScheduledRequest, list[int]]] = []
        row = 0
        for scheduled in batch:
            request = scheduled.request
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens
            block_table = np.asarray(scheduled.block_ids, dtype=np.int64)
            # Cache slot of every context position [0, end) of this request.
            context_slots = (block_table[:, None] * bs + np.arange(bs)).reshape(-1)[:end]
            token_chunks.append(request.all_token_ids[start:end])
            position_chunks.append(np.arange(start, end))
            slot_chunks.append(context_slots[start:end])
            if scheduled.num_new_tokens == 1:
                decode_slots.append(context_slots)
            else:
                mask = None
                if start > 0:
                    key_positions = torch.arange(end, device=self.device)
                    query_positions = torch.arange(start, end, device=self.device)
                    mask = key_positions[None, :] <= query_positions[:, None]
                spans.append(MultiTokenSpan(row, scheduled.num_new_tokens, end,
                                            torch.from_numpy(context_slots).to(self.device), mask))
            if scheduled.samples_this_step:
                sample_rows.append(row + scheduled.num_new_tokens - 1)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens:
                last_prompt_row = min(end, request.num_prompt_tokens - 1)
                if last_prompt_row > start:
                    prompt_rows.append((scheduled, list(range(row, row + last_prompt_row - start))))
            row += scheduled.num_new_tokens

        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate(position_chunks)).to(self.device)
        slot_mapping = torch.from_numpy(np.concatenate(slot_chunks)).to(self.device)
        metadata = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=len(decode_slots), spans=spans)
        if decode_slots:
            max_len = max(len(s) for s in decode_slots)
            padded = np.zeros((len(decode_slots), max_len), dtype=np.int64)
            valid = np.zeros((len(decode_slots), max_len), dtype=bool)
            for i, slots in enumerate(decode_slots):
                padded[i, :len(slots)] = slots
                valid[i, :len(slots)] = True
            metadata.decode_slot_indices = torch.from_numpy(padded).to(self.device)
            metadata.decode_mask = torch.from_numpy(valid).to(self.device)[:, None, None, :]
            metadata.decode_context_lens = torch.tensor([len(s) for s in decode_slots], device=self.device)
        return input_ids, positions, metadata, sample_rows, prompt_rows

    def _sample(self, sampling: list[ScheduledRequest], hidden: torch.Tensor, output: RunnerOutput) -> None:
        requests = [s.request for s in sampling]
        states = [self._state(r) for r in requests]
        logits = self.model.compute_logits(hidden)  # [num_sampling, vocab] float32
        metadata = SamplingMetadata.from_states(self.state_store, states, [r.output_token_ids for r in requests])
        result = self.sampler(logits, metadata)
        token_ids = result.sampled_token_ids.tolist()  # the step's one host sync
        wants_logprobs = metadata.max_num_logprobs is not None
        if wants_logprobs:
            sampled_logprobs = result.sampled_logprobs.tolist()
            ranks = result.sampled_token_ranks.tolist() if result.sampled_token_ranks is not None else None
            top_ids = result.top_logprob_ids.tolist()
            top_values = result.top_logprobs.tolist()
        for i, request in enumerate(requests):
            output.sampled_token_ids[request.request_id] = [token_ids[i]]
            num_top = request.sampling_params.logprobs
            if wants_logprobs and num_top is not None:
                top = list(zip(top_ids[i][:num_top], top_values[i][:num_top]))
                output.logprobs[request.request_id] = [
                    (token_ids[i], sampled_logprobs[i], ranks[i] if ranks else None, top)]

    def _prompt_logprobs(self, scheduled: ScheduledRequest, hidden: torch.Tensor, output: RunnerOutput) -> None:
        request = scheduled.request
        start = request.num_computed_tokens
        logprobs = torch.log_softmax(self.model.compute_logits(hidden, is_prompt=True), dim=-1)
        next_ids = request.all_token_ids[start + 1:start + 1 + hidden.shape[0]]
        chosen = logprobs.gather(1, torch.tensor(next_ids, device=self.device)[:, None]).squeeze(1).tolist()
        num_top = request.sampling_params.prompt_logprobs
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in next_ids]
        output.prompt_logprobs.setdefault(request.request_id, []).extend(zip(next_ids, chosen, tops))
