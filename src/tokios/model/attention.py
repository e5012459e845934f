"""Attention over the paged KV cache, and the metadata that drives it.

The KV cache of one layer is a pair of tensors [num_slots, num_kv_heads, head_dim], where
slot = block_id * block_size + offset (an int8 cache keeps each head's scale after its values:
head_dim + 4, kv_cache/dtypes.py). The runner (the only layer that builds tensors) fills
AttentionMetadata once per step; every layer reuses it. Nothing here imports the runner.

Batch layout, fixed by the runner: the requests with one query token (decodes) come first, as
rows [0, num_decode_tokens); requests with several query tokens (prefill chunks, speculative
verification) follow, one span each. Only this module looks at query lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokios.kv_cache.dtypes import INT8_SCALE_BYTES, slot_width


@dataclass
class MultiTokenSpan:
    """One request with query_len > 1: rows [query_start, query_start + query_len) of the batch."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step's writes (cached prefix + this chunk)
    slot_indices: torch.Tensor  # [context_len] long: cache slot of every context position
    # [query_len, context_len] bool (True = may attend), None when the span starts at position 0
    # and is plainly causal.
    attn_mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot written by each new token
    num_decode_tokens: int
    # [num_decode_tokens, max_context_len] long: cache slot of every context position of each
    # decode request, padded with slot 0 (masked out: positions past decode_context_lens).
    decode_slot_indices: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None  # [num_decode_tokens] long
    spans: list[MultiTokenSpan] = field(default_factory=list)
    # A model whose layers keep separate KV block tables (kv_cache/layout.py: sliding-window
    # layers) has one AttentionMetadata per KV group; this one is group 0's, and every layer
    # reads for_layer(its index). Empty: one group, this metadata serves every layer.
    groups: list["AttentionMetadata"] = field(default_factory=list)
    layer_to_group: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> "AttentionMetadata":
        return self.groups[self.layer_to_group[layer]] if self.groups else self


def kv_tensor_widths(config, dtype: torch.dtype) -> list[int]:
    """Elements per slot of each (key, value) tensor pair of `config` (a ModelConfig): the widest
    layer that uses the pair (kv_cache/layout.py), KV heads x slot width."""
    from tokios.kv_cache.layout import KVCacheLayout

    layout = KVCacheLayout.for_config(config)
    widths = [0] * layout.num_tensor_pairs
    for layer in config.kv_layers:
        num_kv_heads, head_dim = config.kv_shape_of(layer)
        tensor = layout.layer_to_tensor[layer]
        widths[tensor] = max(widths[tensor], num_kv_heads * slot_width(dtype, head_dim))
    return widths


def kv_block_bytes(config, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one block id holds: block_size slots of every tensor pair, keys and values."""
    return 2 * sum(kv_tensor_widths(config, dtype)) * torch.empty((), dtype=dtype).element_size() * block_size


def allocate_kv_caches(config, num_slots: int, dtype: torch.dtype, device: torch.device,
                       layers: range | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A (key, value) pair per layer of `config` (a ModelConfig), or per layer of `layers` (a
    pipeline stage's), num_slots slots each, zeroed. Layers in the same place of different KV
    groups (kv_cache/layout.py) share one pair: each group has its own block ids in the one block
    pool, so their slots never overlap. A pair is as wide as its widest layer, and each layer
    sees it as [num_slots, its KV heads, its slot width]; a layer that reads an earlier layer's
    K/V gets that layer's pair."""
    from tokios.kv_cache.layout import KVCacheLayout

    layout = KVCacheLayout.for_config(config)
    widths = kv_tensor_widths(config, dtype)
    layers = range(config.num_layers) if layers is None else layers
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    caches = []
    for layer in layers:
        source = config.kv_source_of(layer)
        tensor = layout.layer_to_tensor[source]
        num_kv_heads, head_dim = config.kv_shape_of(source)
        width = slot_width(dtype, head_dim)
        if tensor not in tensors:
            tensors[tensor] = (torch.zeros(num_slots, widths[tensor], dtype=dtype, device=device),
                               torch.zeros(num_slots, widths[tensor], dtype=dtype, device=device))
        key = (tensor, num_kv_heads, width)
        if key not in views:
            views[key] = tuple(t[:, :num_kv_heads * width].view(num_slots, num_kv_heads, width)
                               for t in tensors[tensor])
        caches.append(views[key])
    return caches


def distinct_cache_pairs(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each allocated (key, value) tensor pair once, whole: layers of different KV groups share
    pairs, each through its own view."""
    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor._base is None else tensor._base

    return list({id(whole(key)): (whole(key), whole(value)) for key, value in kv_caches}.values())


def quantize_kv(values: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] int8: round(x / scale) with scale = absmax / 127
    per head, then the float32 scale (kv_cache/dtypes.py). The C++ kernels' store_head does the
    same float32 arithmetic, so both write the same bytes."""
    values = values.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / 127.0
    quantized = torch.where(scale > 0, torch.round(values / scale), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([quantized, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 (quantize_kv's layout) -> [..., head_dim] of `dtype`."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].to(torch.float32) * scale).to(dtype)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # key/value: [num_tokens, num_kv_heads, head_dim]
    if key_cache.dtype == torch.int8:
        key, value = quantize_kv(key), quantize_kv(value)
    key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cached heads at `slots` (any index shape), as `dtype`: an int8 cache is widened after
    the gather, so only the context read is dequantized."""
    rows = cache[slots]
    return dequantize_kv(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)


def with_sink_key(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  sinks: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss: one learned logit per query head that joins the softmax's
    denominator and attends to nothing) as one more key, so that SDPA computes them: queries
    [..., heads, queries, head_dim] get one more dimension holding sink / scale, keys
    [..., kv_heads, keys, head_dim] a zero there and one more key (zeros, then 1) whose score is
    therefore the head's sink, with a zero value; mask [..., queries, keys] bool lets every
    query see it. One key for all the heads of a KV group, whatever each head's sink."""
    num_heads = query.shape[-3]
    sink_dimension = (sinks.to(query.dtype) / scale).view(num_heads, 1, 1).expand(*query.shape[:-1], 1)
    query = torch.cat([query, sink_dimension], dim=-1)
    keys = torch.cat([keys, keys.new_zeros(*keys.shape[:-1], 1)], dim=-1)
    sink_key = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    sink_key[..., -1] = 1.0
    keys = torch.cat([keys, sink_key], dim=-2)
    values = torch.cat([values, values.new_zeros(*values.shape[:-2], 1, values.shape[-1])], dim=-2)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return query, keys, values, mask


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    The new tokens' K/V must already be written (write_kv), so every request attends to its
    cached prefix and to itself through the same gather. sinks [num_heads] float32: attention
    sinks (with_sink_key), or None.
    """
    output = torch.empty_like(query)
    # A bfloat16 cache under float32 activations is widened, not the query narrowed.
    compute_dtype = query.dtype if key_cache.dtype == torch.int8 else torch.promote_types(query.dtype, key_cache.dtype)
    num_decode = metadata.num_decode_tokens
    if num_decode:
        # Decode: gather only each request's own slots (not a whole padded cache copy per
        # request), then one batched SDPA over [num_decode, heads, 1, max_context_len].
        keys = gather_kv(key_cache, metadata.decode_slot_indices, compute_dtype).transpose(1, 2)  # [D, kv_heads, L, head_dim]
        values = gather_kv(value_cache, metadata.decode_slot_indices, compute_dtype).transpose(1, 2)
        decode_query = query[:num_decode].unsqueeze(2).to(compute_dtype)  # [D, heads, 1, head_dim]
        # Padding mask [D, 1, 1, L], derived here: the C++ decode path needs only the lengths.
        positions = torch.arange(keys.shape[2], device=keys.device)
        padding_mask = (positions[None, :] < metadata.decode_context_lens[:, None])[:, None, None, :]
        if sinks is not None:
            decode_query, keys, values, padding_mask = with_sink_key(decode_query, keys, values, padding_mask,
                                                                     sinks, scale)
        attended = F.scaled_dot_product_attention(decode_query, keys, values, attn_mask=padding_mask,
                                                  scale=scale, enable_gqa=True)
        output[:num_decode] = attended.squeeze(2).to(output.dtype)
    for span in metadata.spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        # 4-D [1, heads, length, head_dim]: PyTorch's CPU SDPA only takes its fused (flash) kernel
        # for 4-D inputs; 3-D ones fall back to the math path, measured 2.6x slower on a
        # 512-token prefill (53 ms vs 20 ms per layer, one thread).
        # [1, kv_heads, context_len, head_dim]
        keys = gather_kv(key_cache, span.slot_indices, compute_dtype).transpose(0, 1).unsqueeze(0)
        values = gather_kv(value_cache, span.slot_indices, compute_dtype).transpose(0, 1).unsqueeze(0)
        span_query = query[rows].transpose(0, 1).unsqueeze(0).to(compute_dtype)  # [1, heads, query_len, head_dim]
        mask = span.attn_mask
        if sinks is not None:
            if mask is None:  # plainly causal from position 0: query_len == context_len
                mask = torch.ones(span.query_len, span.context_len, dtype=torch.bool, device=query.device).tril()
            span_query, keys, values, mask = with_sink_key(span_query, keys, values, mask, sinks, scale)
        attended = F.scaled_dot_product_attention(span_query, keys, values, attn_mask=mask,
                                                  is_causal=mask is None, scale=scale, enable_gqa=True)
        output[rows] = attended.squeeze(0).transpose(0, 1).to(output.dtype)
    return output
