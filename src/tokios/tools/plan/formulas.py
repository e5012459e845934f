"""The arithmetic of serving a transformer: bytes and FLOPs from shapes, and the bounds they set.

Owns pure functions (no I/O, no torch) shared by tools/plan/capacity.py (capacity by formula) and
tools/roofline/ (measured utilization): KV bytes per token, weight bytes, FLOPs of a prefill
and of a decode step, bytes a decode step reads, the decode ridge batch size, KV capacity, and
the speculative-decoding expectation. Units: bytes, FLOPs, seconds. Two formulas belong to the
engine's layers and are only applied here: KV bytes per token (kv_cache/dtypes.py) and the
speculative speed-up (speculative/speedup.py).

Conventions (why): a multiply-add is 2 FLOPs. Logits are computed for the last position of each
request only (as vLLM and llama.cpp do), so prefill pays the output projection once. A decode
step reads every layer matrix and the output projection in full, but only one row of the token
embedding per request (negligible), unless the embedding is tied to the output projection.

A mixture of experts keeps every expert resident (`weight_bytes`) but a token multiplies by its
k of n (FLOPs count the active parameters), and a step reads each expert that any of its tokens
chose once (the kernel groups rows by expert): `weight_bytes_read` counts the dense part and the
expected share of the experts a step of B tokens reads, `num_experts_read`, which assumes uniform
routing.
"""

from __future__ import annotations

import math

from tokios.kv_cache import dtypes
from tokios.model.shape import ModelShape
# The speculator's own formula, under the names the plan reports it by.
from tokios.speculative.speedup import expected_speedup as speculative_speedup  # noqa: F401
from tokios.speculative.speedup import expected_tokens_per_verify  # noqa: F401

KIB = 2**10
GIB = 2**30


def kv_bytes_per_token(model: ModelShape, kv_bytes_per_element: float, *, tp: int = 1) -> float:
    """2 (K and V) x layers x KV heads x head dim x bytes. With tensor parallelism wider than
    the KV heads, each device keeps a copy of a head, so the replica holds `tp` heads."""
    return dtypes.kv_bytes_per_token(model.num_layers, max(model.num_kv_heads, tp), model.head_dim,
                                     kv_bytes_per_element)


def kv_bytes_per_sequence(model: ModelShape, kv_bytes_per_element: float, context_len: int, *,
                          tp: int = 1) -> float:
    """K and V bytes one sequence of context_len tokens keeps: a sliding-window layer holds at most
    its window (Gemma 3: 5 of every 6 layers keep 512 tokens), the others every token."""
    windows = model.layer_windows or (None,) * model.num_layers
    per_layer_token = kv_bytes_per_token(model, kv_bytes_per_element, tp=tp) / model.num_layers
    return per_layer_token * sum(context_len if window is None else min(context_len, window) for window in windows)


def weight_bytes(model: ModelShape, weight_bits: float | None) -> float:
    """All weight bytes. None means 'as in the file' (exact when the model came from a file)."""
    if weight_bits is None:
        if model.file_weight_bytes is not None:
            return float(model.file_weight_bytes)
        weight_bits = model.file_weight_bits or 16
    return model.num_params * weight_bits / 8


def expert_weight_bytes(model: ModelShape, weight_bits: float | None) -> float:
    """Bytes of every routed expert of a mixture of experts (0 for a dense model): resident, though
    a step reads only the experts its tokens chose."""
    if not model.is_moe:
        return 0.0
    if weight_bits is None:
        if model.file_expert_bytes is not None:
            return float(model.file_expert_bytes)
        weight_bits = model.file_weight_bits or 16
    return model.num_routed_expert_params * weight_bits / 8


def step_weight_bytes(model: ModelShape, weight_bits: float | None, num_tokens: float = 1) -> float:
    """Weight bytes a step of `num_tokens` tokens reads: layer matrices and the output projection,
    of a mixture of experts the experts those tokens chose (weight_bytes_read)."""
    if weight_bits is None and model.file_step_weight_bytes is not None:
        one_token = float(model.file_step_weight_bytes)
    else:
        one_token = model.num_step_params * (weight_bits or model.file_weight_bits or 16) / 8
    return weight_bytes_read(model, one_token, expert_weight_bytes(model, weight_bits), num_tokens)


def num_experts_read(model: ModelShape, num_tokens: float) -> float:
    """Expected number of distinct routed experts, per layer, that `num_tokens` tokens choose
    together, each its k of n: n (1 - (1 - k/n)^B). Assumes uniform routing, each token's experts
    drawn independently and evenly: a router that favours some experts reads fewer, so this is an
    upper estimate for batches. k at B = 1; it approaches n as B grows (Qwen3-30B-A3B, 8 of 128:
    8, 52, 82 and 112 at B = 1, 8, 16 and 32; Mixtral, 2 of 8: 7.9 at B = 16). 0 for a dense model."""
    if not model.is_moe or num_tokens <= 0:
        return 0.0
    num_experts = model.num_experts
    return num_experts * (1 - (1 - model.num_experts_per_token / num_experts) ** num_tokens)


def weight_bytes_read(model: ModelShape, one_token_bytes: float, expert_bytes: float, num_tokens: float) -> float:
    """Weight bytes a step of `num_tokens` tokens reads, given what a one-token step reads
    (`one_token_bytes`: the dense part and k of n experts) and all routed experts' bytes: the
    dense part once, and each expert the tokens chose once (num_experts_read). A dense model's
    step reads the same bytes whatever its tokens."""
    if not model.is_moe:
        return one_token_bytes
    num_experts = model.num_experts
    dense = one_token_bytes - expert_bytes * model.num_experts_per_token / num_experts
    return dense + expert_bytes * num_experts_read(model, num_tokens) / num_experts


def linear_flops_per_token(model: ModelShape) -> float:
    """FLOPs of the layer matrices for one token (no attention scores, no output projection); of a
    mixture of experts, the token's k experts (and the router and shared expert) only."""
    return 2 * model.num_active_layer_linear_params


def logits_flops(model: ModelShape) -> float:
    return 2 * model.hidden_size * model.vocab_size


def attention_flops(model: ModelShape, num_queries: int, context_len: float, *, causal: bool) -> float:
    """QK^T and AV over `context_len` keys for `num_queries` queries, all layers and heads.
    A causal prefill of n tokens sees n^2/2 (query, key) pairs rather than n^2."""
    pairs = num_queries * context_len / 2 if causal else num_queries * context_len
    return 4 * model.num_layers * model.num_heads * model.head_dim * pairs


def prefill_flops(model: ModelShape, prompt_len: int) -> float:
    return (linear_flops_per_token(model) * prompt_len
            + attention_flops(model, prompt_len, prompt_len, causal=True)
            + logits_flops(model))


def decode_step_flops(model: ModelShape, batch_size: int, context_len: float) -> float:
    """One decode step: each of `batch_size` requests adds one token after `context_len`."""
    per_token = (linear_flops_per_token(model) + logits_flops(model)
                 + attention_flops(model, 1, context_len, causal=False))
    return batch_size * per_token


def decode_step_bytes(step_weights: float, kv_per_token: float, batch_size: int,
                      context_len: float) -> float:
    """Bytes one decode step reads: its weights once (shared by the batch; a mixture of experts'
    batch reads more experts than one token, step_weight_bytes at batch_size tokens) and each
    request's KV."""
    return step_weights + batch_size * kv_per_token * context_len


def prefill_bytes(step_weights: float, kv_per_token: float, prompt_len: int) -> float:
    """Bytes a prefill moves at least: its weights once (of a mixture of experts, those its
    prompt's tokens chose: step_weight_bytes at prompt_len tokens), and the KV it writes."""
    return step_weights + kv_per_token * prompt_len


def decode_step_seconds(flops: float, num_bytes: float, peak_flops: float, bandwidth: float) -> float:
    """Roofline time of a step: whichever of compute and memory traffic takes longer."""
    return max(flops / peak_flops, num_bytes / bandwidth)


def decode_ridge_batch_size(model: ModelShape, step_weights: float, kv_per_token: float,
                            context_len: float, peak_flops: float, bandwidth: float, *,
                            expert_weights: float = 0.0) -> float:
    """Smallest batch at which a decode step's compute time reaches its memory time.

    Solves B * f / P = (W + B * k * C) / BW for B. Each request's KV read grows with the batch
    as fast as its FLOPs do, so when that read alone outpaces compute the step never turns
    compute-bound: the answer is then infinity. `step_weights` is what a one-token step reads;
    a mixture of experts (`expert_weights`: all routed experts' bytes) reads W(B), more experts
    the larger the batch (weight_bytes_read), and B is found by bisection.
    """
    flops_per_request = decode_step_flops(model, 1, context_len)
    kv_bytes_per_request = kv_per_token * context_len
    margin = flops_per_request / peak_flops - kv_bytes_per_request / bandwidth
    if margin <= 0:
        return math.inf
    if not model.is_moe or not expert_weights:
        return (step_weights / bandwidth) / margin

    def gap(batch_size: float) -> float:
        return batch_size * margin - weight_bytes_read(model, step_weights, expert_weights, batch_size) / bandwidth

    # gap is a line less a rising, bounded, concave W(B) / BW: convex, negative at 0 and not
    # negative once the line covers every weight, so it crosses zero once in between.
    low, high = 0.0, (step_weights + expert_weights) / bandwidth / margin
    for _ in range(200):
        middle = (low + high) / 2
        if gap(middle) < 0:
            low = middle
        else:
            high = middle
    return high


def kv_capacity_tokens(free_bytes: float, kv_per_token: float) -> int:
    """Tokens of KV cache that fit in `free_bytes` (0 when nothing is free)."""
    return max(0, int(free_bytes // kv_per_token))
