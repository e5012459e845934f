"""The KV cache's element formats: int8's per token-head quantization (model/attention.py) and
the byte arithmetic the engine and the planner share (kv_cache/dtypes.py)."""

from __future__ import annotations

import pytest
import torch

from tokios.kv_cache.dtypes import kv_bytes_per_element, slot_width
from tokios.model.attention import dequantize_kv, gather_kv, quantize_kv


def test_int8_round_trip_is_within_half_a_step_of_each_head():
    torch.manual_seed(0)
    values = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # heads of every magnitude
    rows = quantize_kv(values)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    step = values.abs().amax(dim=-1, keepdim=True) / 127
    assert ((dequantize_kv(rows, torch.float32) - values).abs() <= step / 2 * (1 + 1e-6)).all()
    # The largest value of each head is exact in magnitude: it is +-127 steps.
    assert (rows[..., :64].abs().amax(dim=-1) == 127).all()
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), step)


def test_a_zero_head_stays_zero_and_never_divides_by_zero():
    rows = quantize_kv(torch.zeros(2, 1, 16))
    assert torch.equal(dequantize_kv(rows, torch.float32), torch.zeros(2, 1, 16))


def test_gather_dequantizes_only_the_slots_it_reads():
    cache = quantize_kv(torch.randn(10, 2, 16))
    slots = torch.tensor([[7, 2], [0, 0]])
    gathered = gather_kv(cache, slots, torch.float32)
    assert gathered.shape == (2, 2, 2, 16)
    assert torch.equal(gathered[0, 0], dequantize_kv(cache[7], torch.float32))


@pytest.mark.parametrize(("name", "head_dim", "expected"), [
    ("int8", 64, 68 / 64), ("int8", 256, 260 / 256), ("bfloat16", 64, 2.0), ("bf16", 64, 2.0),
    ("torch.float32", 64, 4.0), ("fp16", 128, 2.0), ("fp8", 128, 1.0)])
def test_bytes_per_element_counts_the_int8_scale(name, head_dim, expected):
    assert kv_bytes_per_element(name, head_dim) == expected


def test_slot_width_and_unknown_names():
    assert slot_width(torch.int8, 64) == 68 and slot_width(torch.bfloat16, 64) == 64
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        kv_bytes_per_element("int4", 64)
