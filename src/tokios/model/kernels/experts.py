"""A sparse mixture of experts on the CPU kernels: model/moe.py's SparseMoE for expert weights in
GGML blocks, computed by the C++ SparseExperts (cpu_kernels.cpp, experts.h).

The experts run as the file stores them (`--dtype auto` / stored: any kernel block type, gate, up
and down each in its own) or converted expert by expert (int4: Q4_1, int8: Q8_0), and only the
experts a step's rows chose are read: a one-token decode step reads k of n experts' bytes. The
router stays float32 (llama.cpp's quantizer never quantizes it either: it decides which bytes
are read at all). Routing, grouping and the sums happen in C++, so the per-op path and the
fused decode step give a row the same result, whatever else shares its step.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from tokios.errors import ModelLoadError
from tokios.model.kernels import (FORMAT_BY_TYPE, TYPE_BY_DTYPE, load_extension, make_quantized_linear,
                                  packed_groups, quantize_q4_1, quantize_q8_0)
from tokios.model.moe import ACTIVATIONS, SCORINGS, ExpertActivation, Routing, SharedExpert
from tokios.model.quant import PackedWeight, as_dense, concat_rows

ExpertWeight = "torch.Tensor | PackedWeight"


def can_pack_experts(weights: list, weight_format: str, device: torch.device) -> bool:
    """Whether expert tensors (3-D, dense or PackedWeight) run on the kernels: on the CPU with
    the kernel built, converted by --dtype int4 / int8, or stored in kernel block types."""
    if device.type != "cpu" or load_extension() is None:
        return False
    if weight_format in TYPE_BY_DTYPE:
        return True
    return weight_format == "stored" and all(isinstance(w, PackedWeight) and w.ggml_type in FORMAT_BY_TYPE
                                             for w in weights)


def _expert_blocks(weight: ExpertWeight, weight_format: str, name: str) -> PackedWeight:
    """[num_experts, out, in] in a kernel block type: as stored, or converted row by row."""
    target = TYPE_BY_DTYPE.get(weight_format)
    if isinstance(weight, PackedWeight) and (target is None or weight.ggml_type == target):
        return weight
    if target is None:
        raise ModelLoadError(f"{name}: experts stored as {getattr(weight, 'ggml_type', weight.dtype)} do not run "
                             "on the quantized kernels as stored (use --dtype int4 or int8)")
    dense = as_dense(weight).float()
    num_experts, out_features, in_features = dense.shape
    rows = dense.reshape(num_experts * out_features, in_features)
    raw = quantize_q4_1(rows) if weight_format == "int4" else quantize_q8_0(rows)
    return PackedWeight(raw, target, (num_experts, out_features, in_features), name)


def _float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else as_dense(tensor).float().contiguous().reshape(-1)


class PackedSparseMoE:
    """hidden [rows, hidden] -> [rows, hidden], as SparseMoE (same arguments and shapes), with the
    expert weights packed for the kernels. precise: 15-bit activations (--dtype int8)."""

    def __init__(self, routing: Routing, router_weight: torch.Tensor, gate: ExpertWeight, up: ExpertWeight,
                 down: ExpertWeight, *, activation: ExpertActivation = ExpertActivation(),
                 router_bias: torch.Tensor | None = None, selection_bias: torch.Tensor | None = None,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, shared_expert: SharedExpert | None = None,
                 expert_scale: torch.Tensor | None = None, weight_format: str = "stored", precise: bool = False):
        extension = load_extension()
        blocks = {name: _expert_blocks(weight, weight_format, f"ffn_{name}_exps")
                  for name, weight in (("gate", gate), ("up", up), ("down", down))}
        num_experts, intermediate, hidden = blocks["gate"].shape
        if blocks["up"].shape != (num_experts, intermediate, hidden) or blocks["down"].shape != (
                num_experts, hidden, intermediate):
            raise ModelLoadError(f"expert tensors disagree: gate {list(blocks['gate'].shape)}, up "
                                 f"{list(blocks['up'].shape)}, down {list(blocks['down'].shape)}")
        packed = {name: packed_groups(extension, w.raw, w.ggml_type, w.shape, w.name) for name, w in blocks.items()}
        shared = []
        if shared_expert is not None:
            shared = [make_quantized_linear(concat_rows([shared_expert.gate, shared_expert.up]), None, weight_format,
                                            precise_activations=precise),
                      make_quantized_linear(shared_expert.down, None, weight_format, precise_activations=precise)]
        self.routing = routing
        self.hidden_size = hidden
        self.kernel = extension.SparseExperts(
            as_dense(router_weight).float().contiguous(), _float(router_bias), _float(selection_bias),
            routing.num_experts_per_token, SCORINGS.index(routing.scoring), routing.normalize_top_k, routing.scale,
            packed["gate"], FORMAT_BY_TYPE[blocks["gate"].ggml_type], packed["up"],
            FORMAT_BY_TYPE[blocks["up"].ggml_type], packed["down"], FORMAT_BY_TYPE[blocks["down"].ggml_type],
            intermediate, _float(gate_bias), _float(up_bias), _float(down_bias), ACTIVATIONS.index(activation.kind),
            activation.alpha, activation.limit, precise, [linear.linear for linear in shared],
            None if shared_expert is None or shared_expert.output_gate is None else _float(shared_expert.output_gate),
            _float(expert_scale))
        # The tensors the kernel reads stay alive with it (it holds references), and with this.
        self._packed = packed
        self.expert_types = {name: w.ggml_type for name, w in blocks.items()}
        # The file tensors it holds by block type, for the start-up log (the router is float32).
        self.tensor_types = [T.F32, *self.expert_types.values()] + [
            t for linear in shared for t in linear.tensor_types]

    def __call__(self, hidden: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        router_x = None if router_input is None else router_input.float().contiguous()
        return self.kernel(hidden.float().contiguous(), router_x).to(hidden.dtype)

    def num_bytes(self) -> int:
        """All of its weights (every expert's), as held."""
        return self.kernel.num_bytes

    def linears(self) -> list:
        """What a decoder layer's feed-forward multiplies by, for the weight accounting (itself)."""
        return [self]

    @property
    def weight_bytes_read(self) -> int:
        """The weight bytes its calls so far have read (the chosen experts', router, shared expert)."""
        return self.kernel.weight_bytes_read
