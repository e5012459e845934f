"""A mixture of experts' weights under one set of names, whatever file they came from, so that
model/moe.py's `make_sparse_moe` reads one layout: per layer, the router
`model.layers.N.mlp.gate.weight` [num_experts, hidden] and the routed experts stacked,
`mlp.experts.{gate,up}_proj.weight` [num_experts, intermediate, hidden] and
`mlp.experts.down_proj.weight` [num_experts, hidden, intermediate] (Qwen2-MoE's shared expert
keeps its own names, `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`).

What arrives (model/loader.py names a GGUF file's tensors so beforehand):
- GGUF: stacked already; llama.cpp's converter with --fuse-gate-up-exps writes gate and up as one
  `ffn_gate_up_exps` [num_experts, 2 * intermediate, hidden], each expert's gate rows then its up
  rows (loader name `mlp.experts.gate_up_proj.weight`).
- Hugging Face checkpoints: one tensor per expert, `mlp.experts.7.gate_proj.weight` (what
  transformers 5.25's save_pretrained writes for Qwen2/3-MoE and OLMoE), Mixtral's
  `block_sparse_moe.experts.7.w1` (gate), `w2` (down), `w3` (up) with its router
  `block_sparse_moe.gate`; or transformers 5's fused in-memory layout, `mlp.experts.gate_up_proj`
  [num_experts, 2 * intermediate, hidden] and `mlp.experts.down_proj`, without `.weight`;
  gpt-oss's its own (`mlp.router`, gate and up interleaved, [E, in, out] matrices, biases);
  Gemma 4's outside `mlp.` (`router.proj`, `router.scale`, `router.per_expert_scale`,
  `experts.gate_up_proj`, `experts.down_proj`).
"""

from __future__ import annotations

import re

import torch

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError
from tokios.model.quant import select_expert_rows

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# model.layers.N.<module>.experts.E.<projection>.weight, one expert's matrix in a checkpoint
_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def gather_expert_weights(weights: dict, config: ModelConfig) -> dict:
    """`weights` (Hugging Face names) with every layer's experts stacked and split as the module
    docstring says; a dense model's come back unchanged. A layer missing one of its experts, or
    a fused tensor of another width, is an error naming the tensor."""
    if not config.num_experts:
        return weights
    weights = _gemma4_checkpoint_names(_gpt_oss_checkpoint_layout(weights, config), config)
    gathered: dict = {}
    # (layer prefix, projection) -> expert id -> [out, in]
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, weight in weights.items():
        match = _PER_EXPERT.match(name)
        if match is not None:
            prefix, module, expert_id, projection = match.groups()
            if module == "block_sparse_moe":
                projection = _MIXTRAL_PROJECTIONS.get(projection, projection)
            if projection not in PROJECTIONS:
                raise ModelLoadError(f"{name}: an expert projection {projection!r} of no supported architecture")
            per_expert.setdefault((prefix, projection), {})[int(expert_id)] = weight
        elif name.endswith((".mlp.experts.gate_up_proj.weight", ".mlp.experts.gate_up_proj")):
            prefix = name[:name.index(".mlp.experts.")]
            gate, up = _split_gate_up(name, weight, config)
            gathered[f"{prefix}.mlp.experts.gate_proj.weight"] = gate
            gathered[f"{prefix}.mlp.experts.up_proj.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            gathered[f"{name}.weight"] = weight
        elif name.endswith(".block_sparse_moe.gate.weight"):
            gathered[name.replace(".block_sparse_moe.", ".mlp.")] = weight
        else:
            gathered[name] = weight
    for (prefix, projection), expert_to_weight in per_expert.items():
        missing = sorted(set(range(config.num_experts)) - set(expert_to_weight))
        if missing or len(expert_to_weight) != config.num_experts:
            raise ModelLoadError(f"{prefix}: {projection} of experts {missing or sorted(expert_to_weight)} "
                                 f"missing or beyond the config's {config.num_experts} experts")
        gathered[f"{prefix}.mlp.experts.{projection}.weight"] = torch.stack(
            [expert_to_weight[expert_id] for expert_id in range(config.num_experts)])
    return gathered


def _split_gate_up(name: str, weight, config: ModelConfig) -> tuple:
    """[num_experts, 2 * intermediate, hidden] -> gate, up, each [num_experts, intermediate, hidden]."""
    expected = (config.num_experts, 2 * config.expert_intermediate_size, config.hidden_size)
    if tuple(weight.shape) != expected:
        raise ModelLoadError(f"{name} has shape {list(weight.shape)}; the config's experts make {list(expected)} "
                             "(each expert's gate rows, then its up rows)")
    intermediate = config.expert_intermediate_size
    return (select_expert_rows(weight, slice(0, intermediate)),
            select_expert_rows(weight, slice(intermediate, 2 * intermediate)))


def _gpt_oss_checkpoint_layout(weights: dict, config: ModelConfig) -> dict:
    """A gpt-oss Hugging Face checkpoint's feed-forward in the names and layout of a GGUF file
    (model/moe.py): router -> mlp.gate; experts.gate_up_proj [E, hidden, 2I] with gate and up
    interleaved along its last dimension (gate the even columns) -> gate_proj, up_proj
    [E, I, hidden]; down_proj [E, I, hidden] -> [E, hidden, I]; the biases likewise. Other
    architectures' weights, and those already so, pass unchanged."""
    if config.architecture != "gpt-oss":
        return weights
    renamed = {}
    for name, tensor in weights.items():
        if ".mlp.router." in name:
            renamed[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[:-len("gate_up_proj")]
            renamed[f"{prefix}gate_proj.weight"] = tensor[..., ::2].transpose(1, 2).contiguous()
            renamed[f"{prefix}up_proj.weight"] = tensor[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            prefix = name[:-len("gate_up_proj_bias")]
            renamed[f"{prefix}gate_proj.bias"] = tensor[..., ::2].contiguous()
            renamed[f"{prefix}up_proj.bias"] = tensor[..., 1::2].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            renamed[f"{name}.weight"] = tensor.transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.down_proj_bias"):
            renamed[name.replace("down_proj_bias", "down_proj.bias")] = tensor
        else:
            renamed[name] = tensor
    return renamed


# Gemma 4's checkpoint names -> the loader's (model/loader.py's names for its GGUF tensors).
_GEMMA4_RENAMES = ((".router.proj.weight", ".mlp.gate.weight"), (".router.scale", ".mlp.gate.scale"),
                   (".router.per_expert_scale", ".mlp.experts.down_proj.scale"),
                   (".experts.gate_up_proj", ".mlp.experts.gate_up_proj"), (".experts.down_proj", ".mlp.experts.down_proj"))


def _gemma4_checkpoint_names(weights: dict, config: ModelConfig) -> dict:
    """A Gemma 4 MoE checkpoint's router and experts under the names the other layouts use (its
    fused gate_up is then split as transformers 5's fused layout is)."""
    if config.architecture != "gemma4":
        return weights
    renamed = {}
    for name, tensor in weights.items():
        for ending, replacement in _GEMMA4_RENAMES:
            if name.endswith(ending) and ".mlp." not in name:
                name = name[:-len(ending)] + replacement
                break
        renamed[name] = tensor
    return renamed
