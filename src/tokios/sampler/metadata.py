"""SamplingMetadata: the tensors and flags the sampler needs for one step of a batch.

Built once per step by the model runner, from the requests in the batch, in one of two ways:

- `SamplingMetadata.from_states(store, states, output_token_ids)`: the runner keeps one
  RequestSamplingState per request (tokios.sampler.state) and the build costs O(batch + new tokens)
  on the host: per-request scalars go to the device in two packed copies, penalty counts are
  gathered from device tables that only see the tokens generated since the last step.
- `SamplingMetadata.build(params, prompt_token_ids, output_token_ids, generators, ...)`: stateless,
  recounts every token each call (O(total tokens)); for tests, tools and one-off callers.

Feature flags (greedy only? penalties? bias? truncation?) are decided here, once per step, so the
sampler's per-token work has no per-request branches. Talks to: state.py (reads), sampler.py and
ops.py (consume the fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokios.sampler.state import RequestSamplingState, SamplingStateStore
from tokios.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    num_requests: int
    vocab_size: int
    device: torch.device
    # Step flags. `is_plain_greedy`: every row is greedy and nothing edits the logits -> argmax.
    all_greedy: bool
    all_random: bool
    is_plain_greedy: bool
    # [num_requests] bool; only for a batch mixing greedy and random rows.
    is_greedy_row: torch.Tensor | None
    # [num_requests] float32; greedy rows hold 1.0. None when all rows are greedy.
    temperature: torch.Tensor | None
    # [num_requests] long; disabled rows hold vocab_size. None when no random row uses top-k.
    top_k: torch.Tensor | None
    max_top_k: int
    # [num_requests] float32; disabled rows hold 1.0. None when no random row uses top-p / min-p.
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    # Penalties; None when no row of the batch uses that penalty. [num_requests] float32 each.
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    # [num_requests, vocab] bool: token appeared in the prompt (repetition penalty only).
    prompt_token_mask: torch.Tensor | None
    # [num_requests, vocab] int32: times each token was generated so far.
    output_token_counts: torch.Tensor | None
    # min_tokens: logits[suppressed_rows[i], suppressed_token_ids[i]] = -inf. [num_suppressed] long.
    suppressed_rows: torch.Tensor | None
    suppressed_token_ids: torch.Tensor | None
    # logit_bias: logits[bias_rows[i], bias_token_ids[i]] += bias_values[i]. [num_biases].
    bias_rows: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    # One entry per row: the row's own generator (seeded, random rows) or None (shared draw).
    generators: list[torch.Generator | None]
    # Max `logprobs` asked by any row; None when no row asked (no top-logprob tensors then).
    max_num_logprobs: int | None

    @property
    def has_penalties(self) -> bool:
        return self.output_token_counts is not None

    @property
    def edits_logits(self) -> bool:
        """Whether steps 1-3 (penalties, min_tokens suppression, bias) change any logit."""
        return self.has_penalties or self.suppressed_rows is not None or self.bias_rows is not None

    @classmethod
    def from_states(
        cls,
        store: SamplingStateStore,
        states: list[RequestSamplingState],
        output_token_ids: list[list[int]],
        pending_token_ids: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """Metadata for a batch whose rows are `states`, in logits row order. `output_token_ids[i]`
        is row i's generated tokens so far (the list the engine keeps; only its new tail is read).
        `pending_token_ids[i]`: tokens row i sees after its output that are not part of it yet (a
        speculative verify row's proposals before its position): they count for penalties and
        min_tokens on that row only, and never enter the store's persistent counts."""
        if len(states) != len(output_token_ids):
            raise ValueError(f"got {len(states)} states but {len(output_token_ids)} output token lists")
        device = store.device
        vocab_size = store.vocab_size
        num_requests = len(states)
        params = [state.params for state in states]
        is_greedy = [p.is_greedy for p in params]
        all_greedy = all(is_greedy)
        all_random = not any(is_greedy)
        random_params = [p for p, greedy in zip(params, is_greedy) if not greedy]
        has_top_k = any(p.top_k > 0 for p in random_params)
        has_top_p = any(p.top_p < 1.0 for p in random_params)
        has_min_p = any(p.min_p > 0.0 for p in random_params)
        has_repetition = any(p.has_repetition_penalty for p in params)
        has_frequency_presence = any(p.has_frequency_presence_penalty for p in params)
        has_penalties = has_repetition or has_frequency_presence

        # All per-row floats travel in one host->device copy, all per-row ints in another; each
        # row is named where it is packed and read back by that name.
        float_rows: dict[str, list[float]] = {}
        if not all_greedy:
            float_rows["temperature"] = [1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy)]
        if has_top_p:
            float_rows["top_p"] = [1.0 if greedy else p.top_p for p, greedy in zip(params, is_greedy)]
        if has_min_p:
            float_rows["min_p"] = [0.0 if greedy else p.min_p for p, greedy in zip(params, is_greedy)]
        # A penalty nobody in the batch uses is skipped rather than applied as a no-op.
        if has_repetition:
            float_rows["repetition_penalty"] = [p.repetition_penalty for p in params]
        if has_frequency_presence:
            float_rows["frequency_penalty"] = [p.frequency_penalty for p in params]
            float_rows["presence_penalty"] = [p.presence_penalty for p in params]
        int_rows: dict[str, list[int]] = {}
        if has_top_k:
            int_rows["top_k"] = [p.top_k if p.top_k > 0 and not greedy else vocab_size
                                 for p, greedy in zip(params, is_greedy)]
        if not all_greedy and not all_random:
            int_rows["is_greedy_row"] = [int(greedy) for greedy in is_greedy]
        if has_penalties:
            int_rows["penalty_rows"] = [state.penalty_row for state in states]
        floats = _named_to_device(float_rows, torch.float32, device)
        ints = _named_to_device(int_rows, torch.long, device)

        temperature = floats.get("temperature")
        top_p = floats.get("top_p")
        min_p = floats.get("min_p")
        top_k = ints.get("top_k")
        max_top_k = max((p.top_k for p in random_params if p.top_k > 0), default=vocab_size)
        is_greedy_row = ints["is_greedy_row"].bool() if "is_greedy_row" in ints else None
        repetition_penalty = floats.get("repetition_penalty")
        frequency_penalty = floats.get("frequency_penalty")
        presence_penalty = floats.get("presence_penalty")

        prompt_token_mask = output_token_counts = None
        if has_penalties:
            penalty_rows = ints["penalty_rows"]
            store.fold_new_output_tokens(states, output_token_ids)
            output_token_counts = store.output_token_counts.index_select(0, penalty_rows)
            if pending_token_ids is not None and any(pending_token_ids):
                rows = [row for row, pending in enumerate(pending_token_ids) for _ in pending]
                index = torch.tensor([rows, [t for pending in pending_token_ids for t in pending]],
                                     dtype=torch.long).to(device)
                ones = torch.ones(len(rows), dtype=output_token_counts.dtype, device=device)
                output_token_counts.index_put_((index[0], index[1]), ones, accumulate=True)
            if has_repetition:
                prompt_token_mask = store.prompt_token_mask.index_select(0, penalty_rows)

        lengths = [len(output) + (len(pending_token_ids[i]) if pending_token_ids else 0)
                   for i, output in enumerate(output_token_ids)]
        suppressed = _flat_suppressions(states, lengths)
        suppressed_rows, suppressed_token_ids = _to_device(suppressed, torch.long, device) if suppressed[0] else (None, None)
        bias_rows = bias_token_ids = bias_values = None
        if any(state.logit_bias_token_ids for state in states):
            rows, token_ids, values = _flat_biases(states)
            bias_rows, bias_token_ids = _to_device([rows, token_ids], torch.long, device)
            (bias_values,) = _to_device([values], torch.float32, device)

        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_requests=num_requests,
            vocab_size=vocab_size,
            device=device,
            all_greedy=all_greedy,
            all_random=all_random,
            is_plain_greedy=all_greedy and not has_penalties and suppressed_rows is None and bias_rows is None,
            is_greedy_row=is_greedy_row,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            prompt_token_mask=prompt_token_mask,
            output_token_counts=output_token_counts,
            suppressed_rows=suppressed_rows,
            suppressed_token_ids=suppressed_token_ids,
            bias_rows=bias_rows,
            bias_token_ids=bias_token_ids,
            bias_values=bias_values,
            generators=[None if greedy else state.generator for state, greedy in zip(states, is_greedy)],
            max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        stop_suppression_token_ids: list[frozenset[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Stateless build: recounts all tokens. `generators[i]` must be the same object across the
        steps of request i (a fresh generator each step would repeat the same draw)."""
        lengths = {len(params), len(prompt_token_ids), len(output_token_ids), len(generators), len(stop_suppression_token_ids)}
        if len(lengths) != 1:
            raise ValueError("params, prompt_token_ids, output_token_ids, generators and stop_suppression_token_ids must have one entry per row")
        store = SamplingStateStore(vocab_size, device, initial_num_rows=1 + sum(p.has_penalties for p in params))
        states = []
        for row_params, prompt, generator, suppressed in zip(params, prompt_token_ids, generators, stop_suppression_token_ids):
            state = store.add(row_params, prompt, suppressed, generator=generator)
            # build() uses exactly the generators it is given; None means the shared draw.
            state.generator = generator
            states.append(state)
        return cls.from_states(store, states, output_token_ids)


def _named_to_device(rows: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Equal-length rows, each under its name, to the device in one copy."""
    return dict(zip(rows, _to_device(list(rows.values()), dtype, device)))


def _to_device(rows: list[list], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    if not rows:
        return []
    packed = torch.tensor(rows, dtype=dtype)
    if device.type != "cpu":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return list(packed.unbind(0))


def _flat_suppressions(states: list[RequestSamplingState], output_lengths: list[int]) -> list[list[int]]:
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (state, output_length) in enumerate(zip(states, output_lengths)):
        if output_length < state.params.min_tokens and state.sorted_stop_suppression_token_ids:
            rows.extend([row] * len(state.sorted_stop_suppression_token_ids))
            token_ids.extend(state.sorted_stop_suppression_token_ids)
    return [rows, token_ids]


def _flat_biases(states: list[RequestSamplingState]) -> tuple[list[int], list[int], list[float]]:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, state in enumerate(states):
        rows.extend([row] * len(state.logit_bias_token_ids))
        token_ids.extend(state.logit_bias_token_ids)
        values.extend(state.logit_bias_values)
    return rows, token_ids, values
