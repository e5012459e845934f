"""The mixtures of experts beyond test_families.py's parity: that the tiny models really route
(rows choose different experts, so parity covers the routing), that the parity test sees a
wrong routing rule or a missing shared expert, llama.cpp's merged gate_up_exps tensor, quantized
expert tensors kept in their blocks, and the variants refused by name.

The tiny models are test_families.py's (one converted model per family and test session).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from converted import converted_model
from reference import engine_prompt_logits, reference_logits
from test_families import FAMILIES, LOGITS_RTOL, MOE_FAMILIES, NUM_TOKENS, prompt_ids
from tokios.sampling_params import SamplingParams

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The quantized file as stored against its float32 run (test below): the log-probabilities
# before they part, and the top-two gap where they may part.
MOE_QUANTIZED_MAX_DRIFT_NATS = 1.0
MOE_QUANTIZED_NEAR_TIE_NATS = 2.0


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_the_rows_of_a_prompt_choose_different_experts(name, tmp_path_factory):
    """transformers' own router on the tiny model's prompt: every layer uses every one of its 8
    experts for some row and many different pairs (measured: 8 of 8 experts and 21 to 28 of the
    28 pairs in every layer of the four families), so the parity test compares routed outputs."""
    tiny = converted_model(FAMILIES[name], tmp_path_factory)
    config = tiny.reference.config
    with torch.no_grad():
        router_logits = tiny.reference(torch.tensor([prompt_ids(tiny)]), output_router_logits=True).router_logits
    assert len(router_logits) == config.num_hidden_layers
    for layer, logits in enumerate(router_logits):
        top_k = getattr(config, "num_experts_per_tok", None) or config.top_k_experts  # Gemma 4's name
        chosen = logits.reshape(-1, logits.shape[-1]).topk(top_k, dim=-1).indices.sort(-1).values
        pairs = {tuple(row) for row in chosen.tolist()}
        assert set(chosen.flatten().tolist()) == set(range(logits.shape[-1])), f"layer {layer}: {sorted(pairs)}"
        assert len(pairs) >= 15, f"layer {layer} routes the prompt's rows to only {len(pairs)} expert pairs"


def _logit_difference(llm, tiny) -> tuple[float, float]:
    ids = prompt_ids(tiny)
    ours, theirs = engine_prompt_logits(llm, ids).double(), reference_logits(tiny.reference, ids).double()
    return (ours - theirs).abs().max().item(), (theirs.max() - theirs.min()).item()


@pytest.mark.parametrize("name, key, value", [("qwen3moe", "norm_topk_prob", False), ("olmoe", "norm_topk_prob", True),
                                              ("qwen2moe", "shared_expert_intermediate_size", 0)])
def test_the_parity_test_sees_a_wrong_routing_rule_or_no_shared_expert(name, key, value, tmp_path_factory, tmp_path):
    """The tiny model's directory with its config changed (the top 2 weights renormalised where
    the model does not, or not where it does; Qwen2-MoE without its shared expert) runs, and its
    logits leave test_families.py's tolerance far behind: measured, the largest differences are
    12.4, 10.3 and 30.4 where 0.044, 0.047 and 0.047 are allowed (the models themselves: 1e-4
    to 4e-4)."""
    from tokios.engine import LLM

    tiny = converted_model(FAMILIES[name], tmp_path_factory)
    directory = shutil.copytree(tiny.hf_directory, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(directory), dtype="float32", kv_cache_memory="16MiB")
    try:
        difference, spread = _logit_difference(llm, tiny)
    finally:
        llm.close()
    assert difference > 10 * LOGITS_RTOL * spread, (difference, spread)


def _merge_gate_up_exps(source, destination) -> None:
    """`source` with every layer's ffn_gate_exps and ffn_up_exps written as one ffn_gate_up_exps
    [num_experts, 2 * intermediate, hidden], as convert_hf_to_gguf.py --fuse-gate-up-exps does
    (conversion/base.py: torch.cat([gate, up], dim=1)). The pinned converter refuses the option
    for these four architectures (their gguf tensor lists lack FFN_GATE_UP_EXP; it is written for
    Qwen3-Next, Qwen3.5-MoE and others), so the file is written here with gguf's own writer."""
    from gguf import GGUFWriter

    from tokios.gguf_file import GGUFFile
    from tokios.model.blocks.requantize import copy_metadata
    from tokios.model.quant import dequantize

    reader = GGUFFile(str(source))
    writer = GGUFWriter(str(destination), reader.architecture)
    copy_metadata(reader, writer)

    def read(name: str) -> np.ndarray:
        info = reader.tensors[name]
        return dequantize(reader.raw_bytes(name), info.ggml_type, info.shape, name).numpy()

    for name in reader.tensors:
        if name.endswith("ffn_up_exps.weight"):
            continue
        if name.endswith("ffn_gate_exps.weight"):
            gate_up = np.concatenate([read(name), read(name.replace("ffn_gate_exps", "ffn_up_exps"))], axis=1)
            writer.add_tensor(name.replace("ffn_gate_exps", "ffn_gate_up_exps"), gate_up)
        else:
            writer.add_tensor(name, read(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_merged_gate_up_exps_tensor_loads_as_the_separate_tensors(tmp_path_factory, tmp_path):
    """A layer's gate and up experts as one ffn_gate_up_exps tensor (each expert's gate rows, then
    its up rows) load exactly as the separate tensors do, as float32 and, quantized, still in
    their blocks (the packed rows split per expert)."""
    from tokios.gguf_file import GGUFFile
    from tokios.model.blocks.requantize import mostly_q4_k_m, requantize_gguf
    from tokios.model.loader import read_model_file
    from tokios.model.quant import PackedWeight

    tiny = converted_model(FAMILIES["qwen3moe"], tmp_path_factory)
    merged = tmp_path / "merged.f32.gguf"
    _merge_gate_up_exps(tiny.gguf_path, merged)
    assert "blk.0.ffn_gate_up_exps.weight" in GGUFFile(str(merged)).tensors
    assert "blk.0.ffn_gate_exps.weight" not in GGUFFile(str(merged)).tensors
    separate_q = requantize_gguf(str(tiny.gguf_path), str(tmp_path / "separate.q.gguf"), mostly_q4_k_m)
    merged_q = requantize_gguf(str(merged), str(tmp_path / "merged.q.gguf"), mostly_q4_k_m)
    assert merged_q["blk.0.ffn_gate_up_exps.weight"] == separate_q["blk.0.ffn_gate_exps.weight"]
    for separate_path, merged_path in ((tiny.gguf_path, merged),
                                       (tmp_path / "separate.q.gguf", tmp_path / "merged.q.gguf")):
        _, separate, _ = read_model_file(str(separate_path))
        _, fused, _ = read_model_file(str(merged_path))
        assert sorted(fused) == sorted(separate)
        for weight_name, weight in separate.items():
            if isinstance(weight, PackedWeight):
                assert fused[weight_name].shape == weight.shape and fused[weight_name].ggml_type == weight.ggml_type
                assert torch.equal(fused[weight_name].raw, weight.raw), weight_name
            else:
                assert torch.equal(fused[weight_name], weight), weight_name
    assert isinstance(fused["model.layers.1.mlp.experts.up_proj.weight"], PackedWeight)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_a_quantized_file_keeps_its_experts_in_their_blocks_and_generates(name, tmp_path_factory):
    """The converted file requantized as llama.cpp's Q4_K_M chooses (rows of 64 and 32: Q5_0 and
    Q8_0 experts, the router float32): every layer's experts load as 3-D PackedWeights of the
    file's bytes that dequantize to the gguf package's reading, and the file runs as stored (its
    experts on the packed kernel, activations in 8-bit blocks as llama.cpp takes them) beside
    its float32 run on the first prompt (40 tokens) under test_families.py's near-tie rule with
    room for routing: the 8-bit activations move the router's weights too, and a flipped expert
    moves the logits by whole nats. Longer prompts flip whole expert choices (test_families.py).
    Measured (Zen 4): Qwen3-MoE parts at token 8 (top two 0.07 nats apart), Qwen2-MoE at 2
    (0.71), Mixtral at 2 (0.13), OLMoE at its first token (1.65: its experts' outputs differ by
    1.0% of their largest from float32's, as the dense products' 0.6%; the kernel itself equals
    its dequantized reference, test_moe_kernels.py)."""
    from gguf import quants

    from test_engine_invariance import assert_parts_only_at_near_ties
    from tokios.engine import LLM
    from tokios.gguf_file import GGUFFile
    from tokios.model.blocks.requantize import mostly_q4_k_m, requantize_gguf
    from tokios.model.loader import read_model_file
    from tokios.model.quant import PackedWeight

    tiny = converted_model(FAMILIES[name], tmp_path_factory)
    path = tiny.gguf_path.with_name(f"{name}.experts.q4_k_m.gguf")
    written = requantize_gguf(str(tiny.gguf_path), str(path), mostly_q4_k_m)
    assert written["blk.0.ffn_gate_inp.weight"].name == "F32"
    gguf = GGUFFile(str(path))
    config, weights, _ = read_model_file(str(path))
    for layer in range(config.num_layers):
        for projection, tensor in zip(EXPERT_PROJECTIONS, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            weight = weights[f"model.layers.{layer}.mlp.experts.{projection}.weight"]
            # Gemma 4's converter writes gate and up as one merged tensor, each expert's gate rows first.
            merged = f"blk.{layer}.ffn_gate_up_exps.weight"
            info = gguf.tensors[merged if projection != "down_proj" and merged in gguf.tensors
                                else f"blk.{layer}.{tensor}.weight"]
            expected = quants.dequantize(gguf.raw_bytes(info.name), info.ggml_type).reshape(info.shape)
            if info.name == merged:
                half = info.shape[1] // 2
                expected = expected[:, :half] if projection == "gate_proj" else expected[:, half:]
            assert isinstance(weight, PackedWeight) and weight.shape == expected.shape
            assert weight.ggml_type.name in ("Q5_0", "Q8_0") and weight.ggml_type == info.ggml_type
            assert np.array_equal(weight.dequantize().numpy(), expected)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for dtype in ("float32", "auto"):
        llm = LLM(model=str(path), dtype=dtype, kv_cache_memory="64MiB")
        try:
            outputs[dtype] = [output.outputs[0] for output in llm.generate([prompt_ids(tiny)[:40]], params)]
            llm.check_invariants()
        finally:
            llm.close()
    assert_parts_only_at_near_ties(outputs["auto"], outputs["float32"], f"{name} as stored",
                                   near_tie_nats=MOE_QUANTIZED_NEAR_TIE_NATS, max_drift_nats=MOE_QUANTIZED_MAX_DRIFT_NATS)


@pytest.mark.parametrize("name, key, value", [("qwen3moe", "mlp_only_layers", [1]),
                                              ("qwen2moe", "decoder_sparse_step", 2),
                                              ("olmoe", "clip_qkv", 8.0)])
def test_a_variant_llama_cpp_does_not_run_is_refused_by_name(name, key, value, tmp_path_factory, tmp_path):
    from tokios.engine import LLM
    from tokios.errors import UnsupportedError

    directory = shutil.copytree(converted_model(FAMILIES[name], tmp_path_factory).hf_directory, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match=f"{key} .* is not supported"):
        LLM(model=str(directory), dtype="float32", kv_cache_memory="16MiB")


def test_tensor_parallel_refuses_a_mixture_of_experts_before_any_rank_starts(tmp_path_factory):
    from tokios.distributed.plan import ParallelPlan
    from tokios.errors import UnsupportedError
    from tokios.gguf_file import GGUFFile
    from tokios.model.loader import model_config_from_gguf

    config = model_config_from_gguf(GGUFFile(str(converted_model(FAMILIES["qwen2moe"], tmp_path_factory).gguf_path)))
    ParallelPlan(tensor_parallel_size=1, pipeline_parallel_size=2).check(config)
    with pytest.raises(UnsupportedError, match="tensor_parallel_size 2 with a mixture of experts"):
        ParallelPlan(tensor_parallel_size=2, pipeline_parallel_size=1).check(config)


def test_gemma4s_shape_counts_the_dense_mlp_beside_its_experts(tmp_path_factory):
    """What `tokios plan` reads: the tiny Gemma 4 MoE's feed-forward parameters from its file
    (everything but attention, which the shape counts at its widest head for every layer) are
    transformers' dense MLP, router and experts: all experts resident, a token's k of n active."""
    import dataclasses

    from tokios.model.shape import read_model_shape

    tiny = converted_model(FAMILIES["gemma4moe"], tmp_path_factory)
    shape = read_model_shape(str(tiny.gguf_path))
    attention_only = dataclasses.replace(shape, num_experts=0, intermediate_size=0)
    config = tiny.reference.config
    layers = tiny.reference.model.layers
    dense_and_router = sum(module.weight.numel() for layer in layers
                           for module in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj,
                                          layer.router.proj))
    experts = sum(layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel() for layer in layers)
    assert shape.has_mlp_beside_experts
    assert shape.num_layer_linear_params - attention_only.num_layer_linear_params == dense_and_router + experts
    assert (shape.num_active_layer_linear_params - attention_only.num_layer_linear_params
            == dense_and_router + experts * config.top_k_experts // config.num_experts)
