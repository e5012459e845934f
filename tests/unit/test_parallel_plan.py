"""tokios.distributed.plan: rank layout, stage ranges, size checks and weight shards, on small
random tensors (packed ones written with the project's own block quantizer).

The shard identities that make tensor parallel exact: the q/k/v, gate/up shards (and q/k/v
biases, Qwen2) of all ranks stacked are the whole tensor's rows, and the o_proj/down shards side
by side are its columns, so the partial products sum to the whole product. A packed GGUF tensor
splits on block boundaries to the same numbers its dequantized columns hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tokios.config import ModelConfig
from tokios.distributed.messages import Step, decode, encode
from tokios.distributed.plan import ParallelPlan
from tokios.errors import InvalidRequestError, UnsupportedError
from tokios.model.attention import AttentionMetadata
from tokios.model.blocks import quantize
from tokios.model.quant import PackedWeight

CONFIG = ModelConfig(architecture="qwen2", num_layers=5, hidden_size=64, intermediate_size=128, num_heads=4,
                     num_kv_heads=2, head_dim=32, vocab_size=100, max_model_len=64, attention_bias=True)


def layer_weights(config: ModelConfig, layers: int, packed_type: T | None = None) -> dict:
    generator = torch.Generator().manual_seed(0)
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"self_attn.q_proj.weight": (config.num_heads * head_dim, hidden),
              "self_attn.k_proj.weight": (config.num_kv_heads * head_dim, hidden),
              "self_attn.v_proj.weight": (config.num_kv_heads * head_dim, hidden),
              "self_attn.o_proj.weight": (hidden, config.num_heads * head_dim),
              "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
              "mlp.down_proj.weight": (hidden, inner),
              "self_attn.q_proj.bias": (config.num_heads * head_dim,),
              "self_attn.k_proj.bias": (config.num_kv_heads * head_dim,),
              "self_attn.v_proj.bias": (config.num_kv_heads * head_dim,),
              "input_layernorm.weight": (hidden,)}
    weights = {"model.embed_tokens.weight": torch.randn(config.vocab_size, hidden, generator=generator),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        for name, shape in shapes.items():
            tensor = torch.randn(*shape, generator=generator)
            if packed_type is not None and name.endswith("proj.weight"):
                raw = torch.from_numpy(quantize(tensor.numpy().astype(np.float32), packed_type)).reshape(shape[0], -1)
                tensor = PackedWeight(raw, packed_type, shape, name)
            weights[f"model.layers.{i}.{name}"] = tensor
    return weights


def dense(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, PackedWeight) else weight


def test_ranks_are_stage_major_and_stages_take_contiguous_layers():
    plan = ParallelPlan(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [(plan.stage_of(r), plan.tp_rank_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.output_rank == 2
    assert [list(ParallelPlan(1, 3).stage_layers(s, 8)) for s in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert plan.part_of(0, 8).embed and not plan.part_of(2, 8).embed
    assert not any(plan.part_of(r, 8).head for r in range(4))  # the head stays with the front


def test_sizes_that_do_not_divide_are_refused_with_the_reason():
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 3 does not divide .*4 attention heads"):
        ParallelPlan(3, 1).check(CONFIG)
    with pytest.raises(InvalidRequestError, match="more than the model's 5 layers"):
        ParallelPlan(1, 6).check(CONFIG)
    ParallelPlan(4, 1).check(CONFIG)  # 2 KV heads, 4 ranks: replicated


@pytest.mark.parametrize("tp", [2, 4], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("packed_type", [None, T.Q8_0, T.Q4_1], ids=["dense", "Q8_0", "Q4_1"])
def test_shards_rebuild_the_whole_tensors(tp, packed_type):
    weights = layer_weights(CONFIG, layers=1, packed_type=packed_type)
    plan = ParallelPlan(tensor_parallel_size=tp)
    shards = [plan.shard_weights(dict(weights), CONFIG, rank) for rank in range(tp)]
    prefix = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        assert torch.equal(torch.cat([dense(s[prefix + name]) for s in shards]), dense(weights[prefix + name])), name
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([dense(s[prefix + name]) for s in shards], dim=1),
                           dense(weights[prefix + name])), name
    head_dim, kv = CONFIG.head_dim, CONFIG.num_kv_heads
    for name in ("self_attn.k_proj.weight", "self_attn.v_proj.bias"):
        whole = dense(weights[prefix + name])
        for rank, shard in enumerate(shards):
            # the KV heads this rank's query heads read (GQA: query head h reads KV head h // 2)
            first_query_head = rank * CONFIG.num_heads // tp
            first_kv_head = first_query_head // (CONFIG.num_heads // kv)
            expected = whole[first_kv_head * head_dim:(first_kv_head + max(1, kv // tp)) * head_dim]
            assert torch.equal(dense(shard[prefix + name]), expected), (name, rank)
    assert plan.local_config(CONFIG).num_heads == CONFIG.num_heads // tp
    assert plan.local_config(CONFIG).num_kv_heads == max(1, kv // tp)


def test_partial_products_sum_to_the_whole_product():
    weights = layer_weights(CONFIG, layers=1)
    plan = ParallelPlan(tensor_parallel_size=2)
    shards = [plan.shard_weights(dict(weights), CONFIG, rank) for rank in range(2)]
    x = torch.randn(3, CONFIG.intermediate_size, dtype=torch.float64)
    name = "model.layers.0.mlp.down_proj.weight"
    parts = [x[:, r * 64:(r + 1) * 64] @ shards[r][name].double().T for r in range(2)]
    assert torch.allclose(parts[0] + parts[1], x @ weights[name].double().T)


def test_pipeline_ranks_keep_only_their_stage():
    weights = layer_weights(CONFIG, layers=5)
    plan = ParallelPlan(pipeline_parallel_size=2)
    kept = plan.shard_weights(dict(weights), CONFIG, rank=1)
    assert {int(name.split(".")[2]) for name in kept if name.startswith("model.layers.")} == {3, 4}
    part = plan.part_of(1, CONFIG.num_layers)
    assert part.needs("model.layers.3.mlp.up_proj.weight", tied_head=True)
    assert not part.needs("model.layers.2.mlp.up_proj.weight", tied_head=True)
    assert not part.needs("model.embed_tokens.weight", tied_head=True)
    assert plan.part_of(0, CONFIG.num_layers).needs("model.embed_tokens.weight", tied_head=False)


def test_a_split_that_cuts_blocks_is_an_error_as_stored_and_converted_otherwise():
    config = ModelConfig(architecture="llama", num_layers=1, hidden_size=64, intermediate_size=96, num_heads=2,
                         num_kv_heads=2, head_dim=32, vocab_size=100, max_model_len=64)
    weights = layer_weights(config, layers=1, packed_type=T.Q8_0)
    plan = ParallelPlan(tensor_parallel_size=2)  # down's 96 inputs: 48 per rank, not whole 32-weight blocks
    with pytest.raises(UnsupportedError, match="mlp.down_proj.weight \\(Q8_0\\) cannot be split at input feature 48"):
        plan.shard_weights(dict(weights), config, 1)
    converted = plan.shard_weights(dict(weights), config, 1, weight_format="int8")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(converted[name], weights[name].dequantize()[:, 48:])


def test_a_step_message_keeps_its_tensors_and_shared_metadata():
    metadata = AttentionMetadata(slot_mapping=torch.arange(3), num_decode_tokens=3,
                                 decode_slot_indices=torch.arange(12).view(3, 4),
                                 decode_context_lens=torch.tensor([4, 4, 4]))
    metadata.groups = [metadata, AttentionMetadata(slot_mapping=torch.arange(3) + 7, num_decode_tokens=3)]
    step = decode(encode(Step(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), metadata, None)))
    assert torch.equal(step.input_ids, torch.tensor([1, 2, 3]))
    assert step.metadata.groups[0] is step.metadata  # the cycle survives
    assert torch.equal(step.metadata.groups[1].slot_mapping, torch.arange(3) + 7)
    moved = step.on(torch.device("meta"))
    assert moved.metadata.groups[0] is moved.metadata and moved.input_ids.device.type == "meta"
    bf16 = torch.randn(2, 3).bfloat16()
    assert torch.equal(decode(encode(Step(bf16, bf16, None, 2))).input_ids, bf16)
