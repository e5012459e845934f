"""The model runner: the only layer that builds tensors.

Each step it turns a SchedulerOutput into one flattened batch (decodes first, then
multi-token spans), fills AttentionMetadata once for all layers, runs the model, computes
logits only at the positions that are sampled (plus every prompt position of a request that
asked for prompt logprobs), samples, and returns token ids as Python ints: one host sync per
step. A request carrying proposed tokens (speculative decoding) is verified in the same batch:
one decode row per token, logits at every one of them, the rejection sampler on top. Rows of
requests under a grammar (tokios.structured) get their token mask, filled in a worker thread
while the forward runs and applied to their logits before sampling. A prompt chunk the
scheduler gave a LayerSlice runs first, in a forward of its own through those layers only; its
hidden states wait here until its last layer, when its rows join the step's output. It also owns
the KV cache tensors and each request's sampling state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokios.config import ModelConfig
from tokios.errors import InvalidRequestError, TokiosError
from tokios.kv_cache.layout import KVCacheLayout
from tokios.kv_cache.manager import split_cache_key
from tokios.model.attention import AttentionMetadata, MultiTokenSpan, allocate_kv_caches, distinct_cache_pairs
from tokios.model.protocol import Model
from tokios.request import Request
from tokios.sampler import ops
from tokios.sampler.metadata import SamplingMetadata
from tokios.sampler.sampler import Sampler, SamplerOutput
from tokios.sampler.state import RequestSamplingState, SamplingStateStore
from tokios.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from tokios.speculative.rejection_sampler import RejectionSampler, VerifyLayout, resolve_token_ids
from tokios.structured.bitmask import GrammarBitmask

# (token id, logprob, rank) of the sampled token, then the top alternatives as (token id, logprob).
SampleLogprobs = tuple[int, float, int | None, list[tuple[int, float]]]
# Per prompt position after the first: (token id, logprob, top alternatives).
PromptLogprobs = list[tuple[int, float, list[tuple[int, float]]]]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Sequences whose row had nothing to sample this step (see row_failure): each fails alone.
    failed: dict[str, TokiosError] = field(default_factory=dict)
    # Pooled prompt hidden states, once a pooling request's whole prompt is computed.
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    # Seconds the step's layer slices took (their own forwards): the step cost model tells
    # what they cost from what the decodes beside them cost.
    layer_slice_seconds: float = 0.0


@dataclass
class PendingSample:
    """A step's plain sampling, before the step's one host sync. `values` joins that sync; the
    rest turns the synced ints into RunnerOutput entries (_finish_sample)."""

    values: torch.Tensor  # [2 * num_requests] long: sampled token ids, then row validity (0 / 1)
    result: SamplerOutput
    metadata: SamplingMetadata
    requests: list[Request]
    logits: torch.Tensor  # [num_requests, vocab] float32, for row_failure

    @property
    def num_values(self) -> int:
        return 2 * len(self.requests)


@dataclass
class VerifyLogprobs:
    """Per verify row, under the raw distribution: its candidate's logprob, rank and the top
    alternatives, and its proposal's logprob and rank (a row emits one or the other)."""

    candidate_logprobs: torch.Tensor  # [num_rows] float32
    candidate_ranks: torch.Tensor  # [num_rows] long
    top_ids: torch.Tensor  # [num_rows, K] long
    top_logprobs: torch.Tensor  # [num_rows, K] float32
    proposal_logprobs: torch.Tensor  # [num_rows] float32
    proposal_ranks: torch.Tensor  # [num_rows] long


@dataclass
class PendingVerify:
    """A step's speculative verification, before the step's one host sync (see PendingSample)."""

    # [num_proposed + 2 * num_rows] long: is_accepted per proposal row, candidate token id per
    # row, row validity per row.
    values: torch.Tensor
    requests: list[Request]
    proposed: list[list[int]]  # per request, the tokens it proposed
    layout: VerifyLayout
    logprobs: VerifyLogprobs | None  # None when no request asked for logprobs
    logits: torch.Tensor  # [num_rows, vocab] float32, for row_failure


def row_failure(logits_row: torch.Tensor) -> TokiosError:
    """Why a row had nothing to sample: the model's own logits were not finite (an engine fault,
    500), or the request's settings removed every token (its own doing, 400)."""
    # -inf is what a grammar's mask writes; nan or +inf only a faulty forward.
    if bool(torch.isnan(logits_row).any() or torch.isposinf(logits_row).any()):
        return TokiosError("The model produced non-finite logits for this request; it was stopped so that "
                           "the other requests could continue.", code="non_finite_logits")
    return InvalidRequestError("The sampling parameters leave no token that can be sampled (every token is "
                               "suppressed, e.g. by min_tokens with stop_token_ids covering the vocabulary, or "
                               "by min_tokens asking for more than the grammar lets the output hold).",
                               param=None, code="no_token_to_sample")


def copy_cache_blocks(kv_caches: list, copies: list[tuple[int, int]], block_size: int, device) -> None:
    """Copy-on-write of KV blocks: each (source, destination) block id, in every layer's cache.
    Copies are of block ids in the one pool; each group's blocks live in the same tensors."""
    bs = block_size
    src = torch.tensor([s * bs + i for s, _ in copies for i in range(bs)], device=device)
    dst = torch.tensor([d * bs + i for _, d in copies for i in range(bs)], device=device)
    for key_cache, value_cache in distinct_cache_pairs(kv_caches):
        key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
        value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


def split_at_decode_rows(metadata: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A mixed batch's metadata as two: its decode rows [0, num_decode_tokens), and its spans
    renumbered from row 0 (every KV group's metadata split the same way)."""
    num_decode = metadata.num_decode_tokens

    def split(group: AttentionMetadata) -> tuple[AttentionMetadata, AttentionMetadata]:
        decodes = AttentionMetadata(slot_mapping=group.slot_mapping[:num_decode], num_decode_tokens=num_decode,
                                    decode_slot_indices=group.decode_slot_indices,
                                    decode_context_lens=group.decode_context_lens)
        spans = AttentionMetadata(slot_mapping=group.slot_mapping[num_decode:], num_decode_tokens=0,
                                  spans=[replace(span, query_start=span.query_start - num_decode)
                                         for span in group.spans])
        return decodes, spans

    if not metadata.groups:
        return split(metadata)
    pairs = [split(group) for group in metadata.groups]
    decodes, spans = pairs[0]
    decodes.groups, spans.groups = [d for d, _ in pairs], [s for _, s in pairs]
    decodes.layer_to_group = spans.layer_to_group = metadata.layer_to_group
    return decodes, spans


@dataclass
class Batch:
    input_ids: torch.Tensor  # [num_rows] long
    positions: torch.Tensor  # [num_rows] long
    metadata: AttentionMetadata
    entry_rows: list[list[int]]  # per entry (input order): its rows of the batch


class ModelRunner:
    def __init__(self, model: Model, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, seed: int = 0):
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.device = device
        self.layout = KVCacheLayout.for_config(model_config)
        # One (key, value) pair per layer: [num_slots, kv_heads, head_dim]; none here when the
        # model's ranks hold the cache (tokios.distributed).
        self.kv_caches = ([] if model.holds_kv_cache
                          else allocate_kv_caches(model_config, num_blocks * block_size, kv_dtype, device))
        self.state_store = SamplingStateStore(model_config.vocab_size, device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.rejection_sampler = RejectionSampler(self.sampler.shared_generator)
        self.request_to_state: dict[str, RequestSamplingState] = {}
        # request id -> the running sum (mean pooling) of its prompt's hidden states so far.
        self._pooled: dict[str, torch.Tensor] = {}
        self.grammar_bitmask = GrammarBitmask(model_config.vocab_size, device)
        # Where evicted cached blocks' bytes go (the disk tier's write_async), or None.
        self.block_sink = None
        # request id -> its prompt chunk's hidden states after the layers done so far (layer slices).
        self._slice_hidden: dict[str, torch.Tensor] = {}

    # ---- per-request state ------------------------------------------------------------------
    def _state(self, request: Request) -> RequestSamplingState:
        state = self.request_to_state.get(request.request_id)
        if state is None:
            suppressed = request.eos_token_ids | request.stop_token_ids
            state = self.state_store.add(request.sampling_params, request.prompt_token_ids, suppressed)
            self.request_to_state[request.request_id] = state
        return state

    def drop_request(self, request_id: str) -> None:
        self._pooled.pop(request_id, None)
        self._slice_hidden.pop(request_id, None)
        state = self.request_to_state.pop(request_id, None)
        if state is not None:
            self.state_store.remove(state)

    # ---- the disk tier's bytes (kv_cache/disk_tier.py) ----------------------------------------
    def _group_layers(self, cache_key) -> tuple[int, ...]:
        group, _ = split_cache_key(cache_key)
        return self.layout.groups[group].layers

    def block_payloads(self, blocks: list[tuple[int, object]]) -> list[bytes]:
        """The bytes of each (block id, cache key): every layer of the key's KV group, keys then
        values, [block_size, kv_heads, head_dim] each, in the cache's dtype."""
        payloads = []
        bs = self.block_size
        for block_id, key in blocks:
            parts = []
            for layer in self._group_layers(key):
                key_cache, value_cache = self.kv_caches[layer]
                parts.append(key_cache[block_id * bs:(block_id + 1) * bs])
                parts.append(value_cache[block_id * bs:(block_id + 1) * bs])
            payloads.append(torch.stack(parts).cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return payloads

    def _load_blocks(self, loads: list[tuple[int, object, bytes]]) -> None:
        bs = self.block_size
        for block_id, key, payload in loads:
            layers = self._group_layers(key)
            reference = self.kv_caches[layers[0]][0]
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(reference.dtype)
            data = data.view(2 * len(layers), bs, *reference.shape[1:]).to(self.device)
            for index, layer in enumerate(layers):
                key_cache, value_cache = self.kv_caches[layer]
                key_cache[block_id * bs:(block_id + 1) * bs] = data[2 * index]
                value_cache[block_id * bs:(block_id + 1) * bs] = data[2 * index + 1]

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if self.model.holds_kv_cache:  # the ranks hold the cache (tokios.distributed)
            self.model.copy_blocks(copies)
        else:
            copy_cache_blocks(self.kv_caches, copies, self.block_size, self.device)

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.drop_request(request_id)
        # Evicted blocks leave for disk before anything overwrites them, then disk blocks come in.
        if scheduler_output.block_spills and self.block_sink is not None:
            for (_, key), payload in zip(scheduler_output.block_spills,
                                         self.block_payloads(scheduler_output.block_spills)):
                self.block_sink(key, payload)
        if scheduler_output.block_loads:
            self._load_blocks(scheduler_output.block_loads)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        for request_id in scheduler_output.preempted_request_ids:
            self._slice_hidden.pop(request_id, None)
        if scheduler_output.is_empty:
            return RunnerOutput()
        whole = [s for s in scheduler_output.scheduled if s.layer_slice is None]
        # Entries whose rows the step outputs: the whole ones, then chunks finishing their layers.
        scheduled = whole + [s for s in scheduler_output.scheduled if s.layer_slice is not None and s.computes_tokens]
        plain_entries = [s for s in scheduled if s.samples_this_step and not s.request.spec_token_ids]
        verify_entries = [s for s in scheduled if s.request.spec_token_ids]
        grammar_jobs = [(s.request.grammar, list(s.request.spec_token_ids)) for s in (*plain_entries, *verify_entries)
                        if s.request.grammar is not None]
        pending_masks = self.grammar_bitmask.start(grammar_jobs) if grammar_jobs else None
        # Layer slices first: a request admitted this step may share the blocks a chunk's last
        # slice completes, and reads every layer of them.
        slices_started = time.perf_counter()
        finished_slices = [h for s in scheduler_output.scheduled
                           if s.layer_slice is not None and (h := self._run_layer_slice(s)) is not None]
        layer_slice_seconds = 0.0
        if len(whole) < len(scheduler_output.scheduled):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # their kernels' time, not their launches'
            layer_slice_seconds = time.perf_counter() - slices_started
        # The step's rows: the whole entries' batch, then each finished chunk's rows after it.
        parts, entry_rows = [], []
        if whole:
            batch = self.build_batch([(s.request, s.num_new_tokens, s.block_tables) for s in whole])
            parts.append(self._forward(batch))
            entry_rows = list(batch.entry_rows)
        num_rows = parts[0].shape[0] if parts else 0
        for chunk_hidden in finished_slices:
            entry_rows.append(list(range(num_rows, num_rows + chunk_hidden.shape[0])))
            num_rows += chunk_hidden.shape[0]
        parts += finished_slices
        if not parts:
            return RunnerOutput(layer_slice_seconds=layer_slice_seconds)  # only slices, none a chunk's last
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        row_of = {id(s): rows for s, rows in zip(scheduled, entry_rows)}
        plain = [(s, row_of[id(s)][-1]) for s in plain_entries]
        verify = [(s, row_of[id(s)]) for s in verify_entries]
        bitmask = pending_masks.result() if pending_masks is not None else None
        output = RunnerOutput(layer_slice_seconds=layer_slice_seconds)
        num_plain_mask_rows = sum(s.request.grammar is not None for s, _ in plain)
        pending_plain = self._sample(plain, hidden, bitmask) if plain else None
        pending_verify = (self._verify(verify, hidden, bitmask[num_plain_mask_rows:] if bitmask is not None else None)
                          if verify else None)
        # The step's one host sync: every sampled / verified token id (and row validity) at once.
        parts = [pending.values for pending in (pending_plain, pending_verify) if pending is not None]
        flat = torch.cat(parts).tolist() if parts else []
        num_plain_values = pending_plain.num_values if pending_plain is not None else 0
        if pending_plain is not None:
            self._finish_sample(pending_plain, flat[:num_plain_values], output)
        if pending_verify is not None:
            self._finish_verify(pending_verify, flat[num_plain_values:], output)
        for s, rows in zip(scheduled, entry_rows):
            request = s.request
            start = request.num_computed_tokens
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens:
                last_prompt_row = min(start + s.num_new_tokens, request.num_prompt_tokens - 1)
                if last_prompt_row > start:
                    self._prompt_logprobs(s, hidden[rows[:last_prompt_row - start]], output)
            if request.sampling_params.pooling is not None and start < request.num_prompt_tokens:
                self._pool(request, hidden[rows[:min(s.num_new_tokens, request.num_prompt_tokens - start)]], output)
        return output

    def _run_layer_slice(self, scheduled: ScheduledRequest) -> torch.Tensor | None:
        """A prompt chunk through this step's layers (scheduler.LayerSlice); its states wait here
        for the next slice. Returns the chunk's final hidden states after its last layer, else None."""
        request, layer_slice = scheduled.request, scheduled.layer_slice
        previous = self._slice_hidden.pop(request.request_id, None)
        if layer_slice.start > 0 and previous is None:
            raise RuntimeError(f"request {request.request_id}: layer slice from layer {layer_slice.start} "
                               "without the states of the slice before it")
        batch = self.build_batch([(request, scheduled.num_new_tokens, scheduled.block_tables)])
        hidden = self.model.forward_layer_slice(batch.input_ids, batch.positions, batch.metadata, self.kv_caches,
                                                layer_slice.start, layer_slice.stop, previous)
        if layer_slice.is_last:
            return hidden
        self._slice_hidden[request.request_id] = hidden
        return None

    def _forward(self, batch: Batch) -> torch.Tensor:
        """The batch's final hidden states. A step with both decode rows and multi-token spans
        runs as two forwards when the model has the fused all-layer decode step: the decode rows
        through it, the spans through the per-op path. In one forward every decode row would
        take the per-op path, about 5x the fused step's time for 8 streams, so while a long
        prompt is prefilled every stream's inter-token latency would be 5x its own whatever chunk
        size the step budget chose (docs/benchmarks.md, Fairness). Rows belong to different
        requests, so the two forwards compute exactly what one would (each writes its own
        requests' cache slots; no row attends to another request's)."""
        metadata = batch.metadata
        num_decode = metadata.num_decode_tokens
        if not (self.model.can_fuse_decode and 0 < num_decode < batch.input_ids.shape[0]):
            return self.model.forward(batch.input_ids, batch.positions, metadata, self.kv_caches)
        decodes, spans = split_at_decode_rows(metadata)
        return torch.cat([
            self.model.forward(batch.input_ids[:num_decode], batch.positions[:num_decode], decodes, self.kv_caches),
            self.model.forward(batch.input_ids[num_decode:], batch.positions[num_decode:], spans, self.kv_caches)])

    def _pool(self, request, hidden: torch.Tensor, output: RunnerOutput) -> None:
        """Adds one chunk's prompt rows ([rows, hidden] final-normed states) to the request's pool;
        at the prompt's end, the pooled vector goes out. A preempted request starts again at 0."""
        start = request.num_computed_tokens
        rows = hidden.float()
        if request.sampling_params.pooling == "last":
            pooled = rows[-1]
        else:
            previous = self._pooled.get(request.request_id) if start > 0 else None
            pooled = rows.sum(dim=0) if previous is None else previous + rows.sum(dim=0)
        end = start + hidden.shape[0]
        if end < request.num_prompt_tokens:
            self._pooled[request.request_id] = pooled
            return
        self._pooled.pop(request.request_id, None)
        if request.sampling_params.pooling == "mean":
            pooled = pooled / request.num_prompt_tokens
        output.embeddings[request.request_id] = pooled.tolist()

    # A prompt chunk with at most this many (query x context) pairs is laid out as decode rows.
    # Rows against SDPA spans, int4 on 2 threads: 16 prompts of 158 tokens 1.40 against 1.70 s;
    # the same with 144 tokens of each cached, 147 against 217 ms. The C++ attention sums 16
    # scores at a time, so rows beat spans on long chunks too (AVX-512 EPYC, alternating in one
    # process): a 1,000-token prompt 0.97 against 1.08 s, Gemma 3 1.00 against 1.09 s, a
    # 4,000-token prompt 7.8 against 8.2 s. The bound keeps the rows' slot tables (8 bytes per pair) at 16 MiB: a
    # 512-token chunk up to 4,096 tokens of context.
    MAX_DECODE_ROW_PAIRS = 1 << 21

    def _prefill_as_decode_rows(self, request, num_new: int) -> bool:
        """Whether a prompt chunk runs as one decode row per token. Short chunks (a prompt whose
        prefix was cached, a chat turn's new message) then take the C++ decode attention, and a
        step of only such rows the fused all-layer step, instead of an SDPA call per layer and
        span, whose fixed cost was half of a step of 16 chunks of 14 tokens (cProfile). Long
        chunks keep SDPA, whose flash kernel wins once the query x context product is large."""
        if not self.model.has_decode_attention_kernel:
            return False
        return num_new * (request.num_computed_tokens + num_new) <= self.MAX_DECODE_ROW_PAIRS

    def build_batch(self, entries) -> Batch:
        """entries: (request, num_new_tokens, block_tables) each, block_tables one list of block
        ids per KV group (kv_cache/layout.py; NULL_BLOCK where a sliding group freed a block). A
        request's new tokens are (all_token_ids + spec_token_ids)[num_computed : num_computed +
        num_new_tokens]. Rows: decodes first (and short prompt chunks, _prefill_as_decode_rows),
        then multi-token spans. A verify (a request with spec_token_ids) is laid out as one
        DECODE row per token, row j attending to the first num_computed + j + 1 positions: it
        runs the very kernels plain decoding runs (the 8-bit decode kernels and the fused
        all-layer step), so verified tokens equal plain decoding bit for bit. Each KV group gets
        its own metadata: its slots, and for a sliding group only the positions in its window."""
        is_decode = [n == 1 or bool(request.spec_token_ids) or self._prefill_as_decode_rows(request, n)
                     for request, n, _ in entries]
        order = sorted(range(len(entries)), key=lambda i: not is_decode[i])
        token_chunks, position_chunks = [], []
        groups = self.layout.groups
        slot_chunks: list[list[np.ndarray]] = [[] for _ in groups]
        decode_slots: list[list[np.ndarray]] = [[] for _ in groups]
        spans: list[list[MultiTokenSpan]] = [[] for _ in groups]
        entry_rows: list[list[int]] = [[] for _ in entries]
        row = 0
        for index in order:
            request, num_new, block_tables = entries[index]
            start = request.num_computed_tokens
            end = start + num_new
            token_ids = request.all_token_ids[start:end]
            if request.spec_token_ids:
                token_ids = token_ids + request.spec_token_ids[:end - start - len(token_ids)]
            token_chunks.append(token_ids)
            position_chunks.append(np.arange(start, end))
            for g, group in enumerate(groups):
                context_slots = self._context_slots(block_tables[g], end)
                slot_chunks[g].append(context_slots[start:end])
                if is_decode[index]:
                    decode_slots[g].extend(context_slots[group.first_needed_position(position):position + 1]
                                           for position in range(start, end))
                else:
                    spans[g].append(self._span(group, row, start, end, context_slots))
            entry_rows[index] = list(range(row, row + num_new))
            row += num_new

        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate(position_chunks)).to(self.device)
        group_metadata = [self._group_metadata(slot_chunks[g], decode_slots[g], spans[g]) for g in range(len(groups))]
        metadata = group_metadata[0]
        if len(groups) > 1:
            metadata.groups = group_metadata
            metadata.layer_to_group = self.layout.layer_to_group
        return Batch(input_ids, positions, metadata, entry_rows)

    def _context_slots(self, block_ids, end: int) -> np.ndarray:
        """Cache slot of every position [0, end) (negative where the block was freed)."""
        bs = self.block_size
        block_table = np.asarray(block_ids, dtype=np.int64)
        return (block_table[:, None] * bs + np.arange(bs)).reshape(-1)[:end]

    def _span(self, group, row: int, start: int, end: int, context_slots: np.ndarray) -> MultiTokenSpan:
        first = group.first_needed_position(start)
        mask = None
        if start > 0 or (group.window is not None and end > group.window):
            key_positions = torch.arange(first, end, device=self.device)
            query_positions = torch.arange(start, end, device=self.device)
            mask = key_positions[None, :] <= query_positions[:, None]
            if group.window is not None:
                mask &= query_positions[:, None] - key_positions[None, :] < group.window
        return MultiTokenSpan(row, end - start, end - first, torch.from_numpy(context_slots[first:]).to(self.device),
                              mask)

    def _group_metadata(self, slot_chunks, decode_slots, spans) -> AttentionMetadata:
        slot_mapping = torch.from_numpy(np.concatenate(slot_chunks)).to(self.device)
        metadata = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=len(decode_slots), spans=spans)
        if decode_slots:
            max_len = max(len(s) for s in decode_slots)
            padded = np.zeros((len(decode_slots), max_len), dtype=np.int64)
            for i, slots in enumerate(decode_slots):
                padded[i, :len(slots)] = slots
            metadata.decode_slot_indices = torch.from_numpy(padded).to(self.device)
            metadata.decode_context_lens = torch.tensor([len(s) for s in decode_slots], device=self.device)
        return metadata

    def _sample(self, plain: list[tuple[ScheduledRequest, int]], hidden: torch.Tensor,
                bitmask: torch.Tensor | None) -> PendingSample:
        requests = [s.request for s, _ in plain]
        states = [self._state(r) for r in requests]
        logits = self.model.compute_logits(hidden[[row for _, row in plain]])  # [num_sampling, vocab] float32
        constrained_rows = [i for i, request in enumerate(requests) if request.grammar is not None]
        if constrained_rows:
            self.grammar_bitmask.apply(logits, constrained_rows, bitmask[:len(constrained_rows)])
        metadata = SamplingMetadata.from_states(self.state_store, states, [r.output_token_ids for r in requests])
        result = self.sampler(logits, metadata)
        values = torch.cat([result.sampled_token_ids, result.row_is_valid.long()])
        return PendingSample(values, result, metadata, requests, logits)

    def _finish_sample(self, pending: PendingSample, values: list[int], output: RunnerOutput) -> None:
        result, metadata, requests, logits = pending.result, pending.metadata, pending.requests, pending.logits
        token_ids, row_is_valid = values[:len(requests)], values[len(requests):]
        wants_logprobs = metadata.max_num_logprobs is not None
        if wants_logprobs:
            sampled_logprobs = result.sampled_logprobs.tolist()
            ranks = result.sampled_token_ranks.tolist() if result.sampled_token_ranks is not None else None
            top_ids = result.top_logprob_ids.tolist()
            top_values = result.top_logprobs.tolist()
        for i, request in enumerate(requests):
            if not row_is_valid[i]:
                output.failed[request.request_id] = row_failure(logits[i])
                continue
            output.sampled_token_ids[request.request_id] = [token_ids[i]]
            num_top = request.sampling_params.logprobs
            if wants_logprobs and num_top is not None:
                top = list(zip(top_ids[i][:num_top], top_values[i][:num_top]))
                output.logprobs[request.request_id] = [
                    (token_ids[i], sampled_logprobs[i], ranks[i] if ranks else None, top)]

    def _verify(self, verify: list[tuple[ScheduledRequest, list[int]]], hidden: torch.Tensor,
                bitmask: torch.Tensor | None) -> PendingVerify:
        """Score every verify row and apply the rejection rule (speculative/rejection_sampler.py).
        Row j of a request sees the output as it would be at that position: its proposals before
        j count for penalties and min_tokens (SamplingMetadata pending tokens). Logprobs, when
        asked, are read from each row's raw distribution for whichever token that row emits."""
        requests = [s.request for s, _ in verify]
        row_states, row_outputs, row_pending, rows = [], [], [], []
        for request, (_, request_rows) in zip(requests, verify):
            state = self._state(request)
            for j, row in enumerate(request_rows):
                row_states.append(state)
                row_outputs.append(request.output_token_ids)
                row_pending.append(request.spec_token_ids[:j])
                rows.append(row)
        logits = self.model.compute_logits(hidden[rows])  # [num_verify_rows, vocab] float32
        constrained_rows, first_row = [], 0
        for request in requests:
            num_rows = len(request.spec_token_ids) + 1
            if request.grammar is not None:
                constrained_rows.extend(range(first_row, first_row + num_rows))
            first_row += num_rows
        if constrained_rows:
            self.grammar_bitmask.apply(logits, constrained_rows, bitmask[:len(constrained_rows)])
        metadata = SamplingMetadata.from_states(self.state_store, row_states, row_outputs, row_pending)
        proposed = [r.spec_token_ids for r in requests]
        layout = VerifyLayout.of(proposed)
        result = self.rejection_sampler(logits, metadata, layout)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # A row emits its proposal if accepted, else its candidate: gather both, pick after sync.
            raw_logprobs = logits.float().log_softmax(dim=-1)
            proposal_per_row = result.candidate_token_ids.clone()  # the bonus row keeps its candidate
            proposal_per_row[layout.proposal_rows] = torch.tensor(layout.proposal_token_ids, dtype=torch.long,
                                                                  device=logits.device)
            candidate_logprobs, candidate_ranks, top_ids, top_logprobs = ops.gather_logprobs(
                raw_logprobs, result.candidate_token_ids, metadata.max_num_logprobs)
            proposal_logprobs, proposal_ranks, _, _ = ops.gather_logprobs(raw_logprobs, proposal_per_row, 1)
            logprobs = VerifyLogprobs(candidate_logprobs, candidate_ranks, top_ids, top_logprobs,
                                      proposal_logprobs, proposal_ranks)
        row_is_valid = (result.row_is_valid if result.row_is_valid is not None
                        else torch.ones(layout.num_rows, dtype=torch.bool, device=logits.device))
        flat = torch.cat([result.is_accepted.long(), result.candidate_token_ids, row_is_valid.long()])
        return PendingVerify(flat, requests, proposed, layout, logprobs, logits)

    def _finish_verify(self, pending: PendingVerify, flat: list[int], output: RunnerOutput) -> None:
        requests, proposed, layout, logprobs = pending.requests, pending.proposed, pending.layout, pending.logprobs
        num_proposed = len(layout.proposal_rows)
        candidates_end = num_proposed + layout.num_rows
        row_is_valid = flat[candidates_end:]
        token_ids = resolve_token_ids(proposed, [bool(x) for x in flat[:num_proposed]],
                                      flat[num_proposed:candidates_end])
        if logprobs is not None:
            candidate_logprobs = logprobs.candidate_logprobs.tolist()
            candidate_ranks = logprobs.candidate_ranks.tolist()
            proposal_logprobs, proposal_ranks = logprobs.proposal_logprobs.tolist(), logprobs.proposal_ranks.tolist()
            top_ids, top_values = logprobs.top_ids.tolist(), logprobs.top_logprobs.tolist()
        for request, new_token_ids, row, request_proposed in zip(requests, token_ids, layout.request_first_rows,
                                                                 proposed):
            request_rows = range(row, row + len(request_proposed) + 1)
            invalid_row = next((r for r in request_rows if not row_is_valid[r]), None)
            if invalid_row is not None:
                output.failed[request.request_id] = row_failure(pending.logits[invalid_row])
                continue
            output.sampled_token_ids[request.request_id] = new_token_ids
            num_top = request.sampling_params.logprobs
            if logprobs is not None and num_top is not None:
                entries = []
                for j, token_id in enumerate(new_token_ids):
                    is_proposal = j < len(new_token_ids) - 1  # the last emitted token is the candidate
                    chosen = (proposal_logprobs if is_proposal else candidate_logprobs)[row + j]
                    rank = (proposal_ranks if is_proposal else candidate_ranks)[row + j]
                    entries.append((token_id, chosen, rank, list(zip(top_ids[row + j][:num_top],
                                                                     top_values[row + j][:num_top]))))
                output.logprobs[request.request_id] = entries

    def _prompt_logprobs(self, scheduled: ScheduledRequest, hidden: torch.Tensor, output: RunnerOutput) -> None:
        request = scheduled.request
        start = request.num_computed_tokens
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        next_ids = request.all_token_ids[start + 1:start + 1 + hidden.shape[0]]
        chosen = logprobs.gather(1, torch.tensor(next_ids, device=self.device)[:, None]).squeeze(1).tolist()
        num_top = request.sampling_params.prompt_logprobs
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in next_ids]
        output.prompt_logprobs.setdefault(request.request_id, []).extend(zip(next_ids, chosen, tops))
