"""Batched sampling operations on logits, one function per step of the chain.

Each function works on a [num_rows, vocab] float32 tensor with per-row parameters given as
[num_rows] tensors, so requests with different settings share one kernel launch per step.
Functions return a new tensor unless their name ends in an underscore (in place). Device-agnostic:
everything stays on the logits' device. Used by tokios.sampler.sampler (and, for the draw, by the
speculative rejection sampler); knows nothing about requests.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
# Penalties and temperature divide logits by request-chosen numbers; a quotient past float32's
# range would become inf (and inf - inf = nan in the softmax). Every such result saturates at
# the largest finite float32 instead, which is the nearest value float32 can hold, so an extreme
# but valid setting means "this token wins" rather than a crashed step.
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny
# On CPU a full sort of a 49k vocab costs tens of ms per row batch while topk(64) costs ~1 ms,
# and top-p nuclei of real LM distributions are usually small: start from this many candidates
# and widen only when some row's nucleus is not inside them.
CPU_INITIAL_NUM_TOP_P_CANDIDATES = 64
TOP_P_CANDIDATE_GROWTH = 8


def apply_repetition_penalty(logits: torch.Tensor, seen_mask: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF/vLLM repetition penalty: for tokens seen in prompt or output, divide positive logits and
    multiply negative ones by the penalty. seen_mask: [rows, vocab] bool; penalty: [rows].
    A penalty below float32's smallest normal (a denormal request value rounds to 0) or above its
    largest is clamped into range, and the results saturate at +-FLOAT32_MAX (never inf or nan)."""
    penalty = penalty.clamp(min=FLOAT32_TINY, max=FLOAT32_MAX).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
    return torch.where(seen_mask, penalized, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor, output_token_counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI penalties over generated tokens: logit -= frequency * count + presence * (count > 0).
    output_token_counts: [rows, vocab] int; frequency, presence: [rows]."""
    counts = output_token_counts.to(logits.dtype)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def suppress_tokens_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Make logits[rows[i], token_ids[i]] = -inf (min_tokens holding back EOS / stop tokens)."""
    logits.index_put_((rows, token_ids), torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))
    return logits


def add_logit_bias_(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """logits[rows[i], token_ids[i]] += values[i]; pairs are unique (one dict per request)."""
    logits.index_put_((rows, token_ids), values, accumulate=True)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, may_overflow: bool = True) -> torch.Tensor:
    """Divide each row by its temperature ([rows], all > 0; greedy rows carry 1.0). -inf (a
    suppressed token) stays -inf, also under a temperature too large for float32 (clamped, since
    -inf / inf would be nan). With `may_overflow`, quotients past float32's range saturate at
    FLOAT32_MAX; a caller that knows its logits are far below FLOAT32_MAX * 1e-5 (the smallest
    sampled temperature) may skip that pass over the vocabulary."""
    quotient = logits / temperature.clamp(max=FLOAT32_MAX).unsqueeze(1)
    return quotient.clamp_(max=FLOAT32_MAX) if may_overflow else quotient


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties with the k-th are kept too); top_k [rows] long,
    rows without top-k hold vocab_size. Costs one topk(max_top_k), not a full sort."""
    vocab_size = logits.shape[-1]
    max_top_k = min(max_top_k, vocab_size)
    top_values = logits.topk(max_top_k, dim=-1).values  # [rows, max_top_k], descending
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)
    threshold = top_values.gather(1, kth_index)
    # A row whose k exceeds the candidates (k disabled) keeps everything.
    threshold = threshold.masked_fill((top_k > max_top_k).unsqueeze(1), NEG_INF)
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, initial_num_candidates: int | None = None) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability sums to >= top_p
    (a token is kept when the mass of the tokens ranked above it is < top_p). top_p: [rows] in
    (0, 1]; rows holding 1.0 keep everything. Ties with the last kept logit are kept too.

    `initial_num_candidates` < vocab searches the top candidates first and widens when a row's
    nucleus reaches past them (a host sync per widening: use it on CPU only). None = full width.
    """
    vocab_size = logits.shape[-1]
    log_normalizer = logits.logsumexp(dim=-1, keepdim=True)  # [rows, 1]
    num_candidates = vocab_size if initial_num_candidates is None else min(initial_num_candidates, vocab_size)
    is_disabled = top_p >= 1.0
    while True:
        candidate_logits = logits.topk(num_candidates, dim=-1).values  # [rows, candidates], descending
        candidate_probs = (candidate_logits - log_normalizer).exp()
        mass_before = candidate_probs.cumsum(dim=-1) - candidate_probs
        keep = mass_before < top_p.unsqueeze(1)
        if num_candidates == vocab_size:
            break
        # Resolved: the cut falls inside the candidates, or nothing beyond them has mass.
        is_resolved = ~keep[:, -1] | is_disabled | (candidate_logits[:, -1] == NEG_INF)
        if bool(is_resolved.all()):
            break
        num_candidates = min(vocab_size, num_candidates * TOP_P_CANDIDATE_GROWTH)
    num_kept = keep.sum(dim=-1, keepdim=True).clamp(min=1)  # keep is a prefix: mass_before grows
    threshold = candidate_logits.gather(1, num_kept - 1)
    threshold = threshold.masked_fill(is_disabled.unsqueeze(1), NEG_INF)
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * (max prob). In logit space: logit >= max_logit + log(min_p),
    so no softmax is needed; min_p [rows], 0 keeps everything (log 0 = -inf)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_truncation(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    initial_num_candidates: int | None = None,
) -> torch.Tensor:
    """top-k, then top-p on the top-k distribution, then min-p, in one masking pass.

    Same result as apply_top_k -> apply_top_p -> apply_min_p (a test holds it to that), but each of
    the three cuts is a per-row logit threshold found from one topk of candidates, so the
    [rows, vocab] tensor is read by one topk, one logsumexp and one masked_fill instead of three
    rounds. `initial_num_candidates` as in apply_top_p (None on accelerators: no host sync).
    """
    num_rows, vocab_size = logits.shape
    num_candidates = vocab_size if initial_num_candidates is None else min(initial_num_candidates, vocab_size)
    if top_k is not None:
        num_candidates = max(num_candidates, min(max_top_k, vocab_size))
    log_normalizer = logits.logsumexp(dim=-1, keepdim=True) if top_p is not None else None
    while True:
        candidates = logits.topk(num_candidates, dim=-1).values  # [rows, candidates], descending
        threshold = torch.full((num_rows, 1), NEG_INF, dtype=logits.dtype, device=logits.device)
        if top_k is not None:
            kth = candidates.gather(1, (top_k.clamp(max=num_candidates) - 1).unsqueeze(1))
            # Rows without top-k carry vocab_size > num_candidates, unless all candidates are in.
            threshold = kth.masked_fill((top_k > num_candidates).unsqueeze(1), NEG_INF)
        if top_p is None:
            break
        in_top_k = candidates >= threshold
        # The top-p distribution is the top-k one: renormalise over the top-k candidates when the
        # row has top-k, over the whole row otherwise.
        row_log_normalizer = log_normalizer
        if top_k is not None:
            top_k_log_normalizer = candidates.masked_fill(~in_top_k, NEG_INF).logsumexp(dim=-1, keepdim=True)
            row_log_normalizer = torch.where(threshold > NEG_INF, top_k_log_normalizer, log_normalizer)
        probs = (candidates - row_log_normalizer).exp() * in_top_k
        mass_before = probs.cumsum(dim=-1) - probs
        keep = (mass_before < top_p.unsqueeze(1)) & in_top_k
        is_disabled = top_p >= 1.0
        if num_candidates == vocab_size:
            break
        is_resolved = ~keep[:, -1] | is_disabled | (candidates[:, -1] == NEG_INF)
        if top_k is not None:
            is_resolved |= top_k <= num_candidates
        if bool(is_resolved.all()):
            break
        num_candidates = min(vocab_size, num_candidates * TOP_P_CANDIDATE_GROWTH)
    if top_p is not None:
        num_kept = keep.sum(dim=-1, keepdim=True).clamp(min=1)
        top_p_threshold = candidates.gather(1, num_kept - 1).masked_fill(is_disabled.unsqueeze(1), NEG_INF)
        threshold = torch.maximum(threshold, top_p_threshold)
    if min_p is not None:
        threshold = torch.maximum(threshold, candidates[:, :1] + min_p.log().unsqueeze(1))
    return logits.masked_fill(logits < threshold, NEG_INF)


def draw_uniforms(
    generators: list[torch.Generator | None],
    device: torch.device,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One U[0, 1) float64 per row: rows with a generator draw from it (so a seeded request's
    stream does not depend on its neighbours), the others from one shared draw."""
    uniforms = torch.rand(len(generators), dtype=torch.float64, device=device, generator=shared_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row : row + 1].uniform_(generator=generator)
    return uniforms


# Inverse-CDF block width: per-block sums locate the block, a cumsum inside one block finds the
# token, so no [rows, vocab] float64 cumsum is ever built (that alone costs ~5x a softmax on CPU).
CDF_BLOCK_SIZE = 256


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, return_validity: bool = False):
    """Exact inverse-CDF draw: the first token whose cumulative probability exceeds u * total.

    probs: [rows, vocab] (need not sum to 1); uniforms: [rows] in [0, 1). Returns [rows] long.
    Why not the exponential race (argmax probs / Exp(1)): it needs vocab random numbers per row,
    and on CPU generating them costs 15x a softmax; this needs one. Two levels, both accumulated in
    float64: block sums pick the block, a cumsum inside it picks the token. A zero-probability
    token (or block) can never be chosen: its CDF equals its predecessor's, never strictly above
    the target.

    Never indexes out of range, whatever the input: a row without positive finite mass (all
    zero, or nan from a broken upstream step) draws some in-range token, and with
    `return_validity` the call also returns [rows] bool, False for exactly those rows, so the
    caller can fail their requests instead of emitting the token. The check is free: it reads
    the block sums the draw computes anyway.
    """
    num_rows, vocab_size = probs.shape
    num_blocks = -(-vocab_size // CDF_BLOCK_SIZE)
    padding = num_blocks * CDF_BLOCK_SIZE - vocab_size
    if padding:
        probs = torch.nn.functional.pad(probs, (0, padding))
    blocks = probs.view(num_rows, num_blocks, CDF_BLOCK_SIZE)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [rows, blocks]
    total = block_cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, _just_below(total))
    block_ids = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)  # [rows, 1]
    block_cdf = torch.nn.functional.pad(block_cdf, (1, 0))  # column 0: mass before block 0
    mass_before = block_cdf.gather(1, block_ids)
    block_mass = block_cdf.gather(1, block_ids + 1) - mass_before
    rows = torch.arange(num_rows, device=probs.device)
    in_block_cdf = blocks[rows, block_ids.squeeze(1)].double().cumsum(dim=-1)  # [rows, block]
    in_block_total = in_block_cdf[:, -1:]
    # Rescale the residual from the block-sum scale to this cumsum's (they differ by rounding).
    in_block_target = (target - mass_before) / block_mass * in_block_total
    in_block_target = torch.minimum(in_block_target, _just_below(in_block_total))
    offsets = torch.searchsorted(in_block_cdf, in_block_target, right=True)
    token_ids = (block_ids * CDF_BLOCK_SIZE + offsets).squeeze(1).clamp_(max=vocab_size - 1)
    if return_validity:
        return token_ids, (total > 0).squeeze(1)  # nan > 0 is False
    return token_ids


def _just_below(values: torch.Tensor) -> torch.Tensor:
    # u * total can round up to total when u is within an ulp of 1; targets must stay below it.
    return torch.nextafter(values, torch.zeros_like(values))


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of log-probabilities [rows, vocab] and chosen token_ids [rows], return
    (chosen logprob [rows], chosen rank [rows] long, 1 = most likely, top ids [rows, num_top],
    top logprobs [rows, num_top]). Shared by sampled-token and prompt logprobs."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [rows, 1]
    # Counting in int32 skips a [rows, vocab] bool->int64 copy (2x faster on CPU).
    ranks = (logprobs > chosen).sum(dim=-1, dtype=torch.int32).long() + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top_logprobs
