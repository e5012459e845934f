"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, with
no value) in both attention paths, against the definition in float64: each head's
softmax([q.k_j * scale for the context, sink])[:-1] @ V, as transformers' GptOssAttention
computes it. The torch path (attention.paged_attention, decode rows and prompt spans, causal
and windowed) and the C++ decode attention (model/kernels decode_attention: the sink enters
where the segments' maxima and sums merge), within one segment and across 512-key segments;
sinks far above and far below the scores too, where the sink takes almost all or none of the
weight."""

from __future__ import annotations

import pytest
import torch

from tokios.model.attention import AttentionMetadata, MultiTokenSpan, paged_attention
from tokios.model.kernels import load_extension

extension = load_extension()
needs_extension = pytest.mark.skipif(extension is None, reason="C++ kernel could not be built on this machine")


def reference(queries, keys, values, masks, sinks, scale):
    """queries [rows, heads, d]; keys, values [rows, L, kv_heads, d]; masks [rows, L] bool."""
    num_heads, num_kv_heads = queries.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(queries.shape, dtype=torch.float64)
    for row in range(queries.shape[0]):
        visible = masks[row]
        for head in range(num_heads):
            k = keys[row, visible, head // group].double()
            v = values[row, visible, head // group].double()
            scores = k @ queries[row, head].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].double().view(1)])
            weights = torch.softmax(scores, dim=0)[:len(k)]
            out[row, head] = weights @ v
    return out


def make_case(context_lens, num_heads=8, num_kv_heads=2, head_dim=16, seed=0):
    torch.manual_seed(seed)
    max_len = max(context_lens)
    num_slots = sum(context_lens) + 8
    key_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    value_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    slots = torch.randperm(num_slots)
    table = torch.zeros(len(context_lens), max_len, dtype=torch.long)
    start = 0
    for row, length in enumerate(context_lens):
        table[row, :length] = slots[start:start + length]
        start += length
    query = torch.randn(len(context_lens), num_heads, head_dim) * 2
    return key_cache, value_cache, table, torch.tensor(context_lens), query


SINK_CASES = {"mixed": lambda h: torch.linspace(-3, 3, h), "dominant": lambda h: torch.full((h,), 40.0),
              "negligible": lambda h: torch.full((h,), -60.0)}


@pytest.mark.parametrize("sinks_kind", sorted(SINK_CASES))
def test_torch_decode_rows_with_sinks(sinks_kind):
    key_cache, value_cache, table, lens, query = make_case([5, 37, 12])
    sinks = SINK_CASES[sinks_kind](query.shape[1])
    scale = 0.25
    metadata = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), num_decode_tokens=3,
                                 decode_slot_indices=table, decode_context_lens=lens)
    ours = paged_attention(query, key_cache, value_cache, metadata, scale, sinks)
    masks = torch.arange(table.shape[1])[None, :] < lens[:, None]
    expected = reference(query, key_cache[table], value_cache[table], masks, sinks, scale)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
    if sinks_kind != "negligible":
        without = paged_attention(query, key_cache, value_cache, metadata, scale)
        assert (without - ours).abs().max() > 1e-2, "the sinks changed nothing"


@pytest.mark.parametrize("window", [None, 6])
def test_torch_prompt_span_with_sinks(window):
    """A prompt from position 0 (plainly causal: the mask is built for the sink key) and a
    sliding window's mask."""
    length, num_heads = 20, 4
    key_cache, value_cache, table, _, _ = make_case([length], num_heads=num_heads)
    query = torch.randn(length, num_heads, 16)
    slots = table[0]
    positions = torch.arange(length)
    causal = positions[None, :] <= positions[:, None]
    mask = None if window is None else causal & (positions[:, None] - positions[None, :] < window)
    sinks = torch.linspace(-2, 2, num_heads)
    metadata = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0,
                                 spans=[MultiTokenSpan(0, length, length, slots, mask)])
    ours = paged_attention(query, key_cache, value_cache, metadata, 0.25, sinks)
    masks = causal if mask is None else mask
    keys, values = key_cache[slots].expand(length, -1, -1, -1), value_cache[slots].expand(length, -1, -1, -1)
    expected = reference(query, keys, values, masks, sinks, 0.25)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)


@needs_extension
@pytest.mark.parametrize("head_dim", [16, 24])  # the vector path; the portable loops
@pytest.mark.parametrize("sinks_kind", sorted(SINK_CASES))
def test_kernel_decode_attention_with_sinks(head_dim, sinks_kind):
    """Rows of one segment and of three (context 1,100 crosses the 512-key segments twice)."""
    num_heads, num_kv_heads = 8, 2
    key_cache, value_cache, table, lens, query = make_case([5, 1100, 37], num_heads, num_kv_heads, head_dim, seed=1)
    sinks = SINK_CASES[sinks_kind](num_heads).contiguous()
    qkv = torch.cat([query.reshape(len(lens), -1), torch.zeros(len(lens), 2 * num_kv_heads * head_dim)], dim=1)
    scale = head_dim ** -0.5
    ours = extension.decode_attention(qkv, key_cache, value_cache, table, lens, num_heads, num_kv_heads, head_dim,
                                      scale, sinks)
    masks = torch.arange(table.shape[1])[None, :] < lens[:, None]
    expected = reference(query, key_cache[table], value_cache[table], masks, sinks, scale)
    torch.testing.assert_close(ours.view_as(query).double(), expected, rtol=2e-5, atol=2e-5)
    without = extension.decode_attention(qkv, key_cache, value_cache, table, lens, num_heads, num_kv_heads,
                                         head_dim, scale)
    assert torch.equal(without, extension.decode_attention(qkv, key_cache, value_cache, table, lens, num_heads,
                                                           num_kv_heads, head_dim, scale, None))
    if sinks_kind != "negligible":
        assert (without - ours).abs().max() > 1e-2, "the sinks changed nothing"


@needs_extension
def test_kernel_sinks_must_be_one_float_per_head():
    key_cache, value_cache, table, lens, query = make_case([4])
    qkv = torch.cat([query.reshape(1, -1), torch.zeros(1, 64)], dim=1)
    with pytest.raises(RuntimeError, match="sinks must be"):
        extension.decode_attention(qkv, key_cache, value_cache, table, lens, 8, 2, 16, 0.25, torch.zeros(4))
