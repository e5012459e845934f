"""The sparse Mixture-of-Experts feed-forward that every MoE architecture shares (Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, gpt-oss): the router's choice of experts (`route`), the experts'
gated feed-forward computed for the chosen experts only, optional shared experts, and
`SparseMoE`, which a decoder layer calls in place of its MLP (hidden [rows, hidden] ->
[rows, hidden]).

An architecture states only what differs: a `Routing` (how router logits become k experts and
their weights) and an `ExpertActivation` (how an expert combines its gate and up projections).
Those are the knobs of llama.cpp's build_moe_ffn (gating function, n_expert_used, norm_w,
w_scale, exp_probs_b, the ffn op type) with the semantics of transformers' modeling files.

Expert weights come as a GGUF file stores them, dequantized. llama.cpp's converter stacks the
per-expert matrices into one 3-D tensor per projection: `blk.N.ffn_gate_exps` and
`blk.N.ffn_up_exps` have GGML ne = {hidden, intermediate, num_experts} and `blk.N.ffn_down_exps`
ne = {intermediate, hidden, num_experts}; read as torch tensors (dimensions reversed) they are
gate, up [num_experts, intermediate, hidden] and down [num_experts, hidden, intermediate], each
expert's slice an ordinary [out_features, in_features] linear weight. gpt-oss adds per-expert
biases (`ffn_{gate,up,down}_exps.bias`: [num_experts, intermediate] / [num_experts, hidden]) and
a router bias (`ffn_gate_inp.bias`). Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp`
with its sigmoid gate `ffn_gate_inp_shexp` (ne = {hidden}).

Torch only, on whatever device the weights are: this is the reference path and the path for
float weights on a GPU; the CPU kernels of model/kernels take its place for packed blocks.
`make_sparse_moe` is the one place a model file gets its MoE layer from (it chooses the
implementation for the weights and device); `routing_of` reads the routing from the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.quant import as_dense

SCORINGS = ("softmax", "sigmoid", "top_k_softmax")
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


@dataclass(frozen=True)
class Routing:
    """How router logits [rows, num_experts] become k experts per row and their weights.

    scoring: "softmax" over all experts, then the top k of those probabilities (Qwen2/3-MoE,
      Mixtral, OLMoE; llama.cpp's gating func SOFTMAX); "sigmoid" of each logit, then the top k
      (DeepSeek-V3 style; SIGMOID); "top_k_softmax": the top k of the logits, then a softmax over
      those k only (gpt-oss; SOFTMAX_WEIGHT).
    normalize_top_k: divide the k weights by their sum (transformers' norm_topk_prob, always on
      for Mixtral; llama.cpp's norm_w).
    scale: multiplies the final weights (routed_scaling_factor; llama.cpp's w_scale).
    """

    num_experts: int
    num_experts_per_token: int
    scoring: str = "softmax"
    normalize_top_k: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ModelLoadError(f"num_experts must be >= 1, got {self.num_experts}", param="num_experts")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_token must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.num_experts_per_token}", param="num_experts_per_token")
        if self.scoring not in SCORINGS:
            raise UnsupportedError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}", param="scoring")
        if not self.scale > 0:
            raise ModelLoadError(f"scale must be > 0, got {self.scale}", param="scale")


def route(router_logits: torch.Tensor, routing: Routing,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [rows, num_experts] -> (expert_ids [rows, k] int64, weights [rows, k] float32),
    the k experts in descending score order.

    Equal scores are ordered by expert id, the lower first, on every device: torch.topk documents
    no order among ties, so the choice is a stable descending sort (torch documents that it keeps
    equal elements in their original order), at the cost of sorting all num_experts scores.

    selection_bias [num_experts] (DeepSeek-V3's score correction bias, llama.cpp's exp_probs_b) is
    added to the scores for choosing only; the weights are the unbiased scores."""
    logits = router_logits.float()
    if routing.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif routing.scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = logits
    selection = scores if selection_bias is None else scores + selection_bias.float()
    order = torch.sort(selection, dim=-1, descending=True, stable=True).indices
    expert_ids = order[:, :routing.num_experts_per_token].contiguous()
    weights = scores.gather(1, expert_ids)
    if routing.scoring == "top_k_softmax":
        weights = torch.softmax(weights, dim=-1)
    if routing.normalize_top_k:
        # Sigmoid scores can all underflow to 0; the floor keeps such a row finite (0 weights).
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return expert_ids, weights


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up projections into the down projection's input.

    kind: "silu": silu(gate) * up (SwiGLU: Qwen, Mixtral, OLMoE); "gelu_tanh": gelu(gate, tanh
      approximation) * up (GeGLU); "swiglu_oai": gpt-oss's clamped SwiGLU, gate clamped above at
      `limit`, up clamped to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1).
    alpha, limit: swiglu_oai's (gpt-oss config swiglu_alpha, swiglu_limit).
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise UnsupportedError(f"activation must be one of {ACTIVATIONS}, got {self.kind!r}", param="activation")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        if self.kind == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


@dataclass(frozen=True, eq=False)
class SharedExpert:
    """An expert every row passes through (Qwen2-MoE): gate, up [intermediate, hidden], down
    [hidden, intermediate]; output_gate [hidden] (or [1, hidden]), when given, scales its output
    by sigmoid(hidden . output_gate) per row. It uses the routed experts' activation."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    output_gate: torch.Tensor | None = None


class SparseMoE(nn.Module):
    """hidden [rows, hidden] -> [rows, hidden]: route each row to k experts, run each chosen expert
    once over all the rows that chose it, add the results weighted, plus the shared expert.

    router_weight [num_experts, hidden] (`ffn_gate_inp`), router_bias [num_experts];
    gate, up [num_experts, intermediate, hidden], down [num_experts, hidden, intermediate]
    (module docstring); gate_bias, up_bias [num_experts, intermediate], down_bias
    [num_experts, hidden]. All on one device and in one float dtype; the output has hidden's dtype.
    """

    def __init__(self, routing: Routing, router_weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, *, activation: ExpertActivation = ExpertActivation(),
                 router_bias: torch.Tensor | None = None, selection_bias: torch.Tensor | None = None,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, shared_expert: SharedExpert | None = None,
                 expert_scale: torch.Tensor | None = None):
        num_experts = routing.num_experts
        if gate.dim() != 3 or gate.shape[0] != num_experts:
            raise ModelLoadError(f"expert gate weight must be [num_experts={num_experts}, intermediate, hidden], "
                                 f"got {list(gate.shape)}", param="ffn_gate_exps")
        _, intermediate, hidden = gate.shape
        shared_gate = shared_up = shared_down = shared_output_gate = shared_intermediate = None
        if shared_expert is not None:
            shared_gate, shared_up, shared_down = shared_expert.gate, shared_expert.up, shared_expert.down
            shared_intermediate = shared_gate.shape[0]
            if shared_expert.output_gate is not None:
                shared_output_gate = shared_expert.output_gate.reshape(1, -1)
        # buffer name -> (tensor or None, the GGUF tensor it comes from, its shape)
        buffers = {
            "router_weight": (router_weight, "ffn_gate_inp", (num_experts, hidden)),
            "router_bias": (router_bias, "ffn_gate_inp.bias", (num_experts,)),
            "selection_bias": (selection_bias, "exp_probs_b", (num_experts,)),
            "expert_scale": (expert_scale, "ffn_down_exps.scale", (num_experts,)),
            "gate": (gate, "ffn_gate_exps", (num_experts, intermediate, hidden)),
            "up": (up, "ffn_up_exps", (num_experts, intermediate, hidden)),
            "down": (down, "ffn_down_exps", (num_experts, hidden, intermediate)),
            "gate_bias": (gate_bias, "ffn_gate_exps.bias", (num_experts, intermediate)),
            "up_bias": (up_bias, "ffn_up_exps.bias", (num_experts, intermediate)),
            "down_bias": (down_bias, "ffn_down_exps.bias", (num_experts, hidden)),
            "shared_gate": (shared_gate, "ffn_gate_shexp", (shared_intermediate, hidden)),
            "shared_up": (shared_up, "ffn_up_shexp", (shared_intermediate, hidden)),
            "shared_down": (shared_down, "ffn_down_shexp", (hidden, shared_intermediate)),
            "shared_output_gate": (shared_output_gate, "ffn_gate_inp_shexp", (1, hidden)),
        }
        super().__init__()
        self.routing = routing
        self.activation = activation
        for buffer_name, (tensor, gguf_name, shape) in buffers.items():
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ModelLoadError(f"{gguf_name} must be {list(shape)}, got {list(tensor.shape)}", param=gguf_name)
            self.register_buffer(buffer_name, tensor)

    def forward(self, hidden: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """router_input: what the router reads, where it is not `hidden` (Gemma 4's router reads
        the residual normed without weights, its experts the residual normed with them)."""
        x = hidden.to(self.gate.dtype)
        router_x = x if router_input is None else router_input.to(self.gate.dtype)
        router_logits = F.linear(router_x, self.router_weight, self.router_bias)  # [rows, num_experts]
        expert_ids, weights = route(router_logits, self.routing, self.selection_bias)
        if self.expert_scale is not None:  # Gemma 4's per-expert output scale (llama.cpp's down_exps_s)
            weights = weights * self.expert_scale.float()[expert_ids]
        output = self.run_experts(x, expert_ids, weights)
        if self.shared_gate is not None:
            shared = F.linear(self.activation(F.linear(x, self.shared_gate), F.linear(x, self.shared_up)),
                              self.shared_down)
            if self.shared_output_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_output_gate))
            output = output + shared
        return output.to(hidden.dtype)

    def run_experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden], expert_ids and weights [rows, k] (route's) -> the weighted sum of each
        row's k expert outputs [rows, hidden].

        The (row, slot) pairs are sorted by expert id so that each chosen expert multiplies all
        its rows in one product: its weights are read once per call, and an expert no row chose
        is never read. The expert counts come to the host once (to slice the groups)."""
        num_rows, k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)  # pair p = row * k + slot
        pair_order = torch.argsort(flat_ids, stable=True)  # [rows * k], pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.routing.num_experts).tolist()
        grouped = x[pair_order // k]  # [rows * k, hidden]: pair p's row is p // k; groups contiguous
        grouped_output = torch.empty_like(grouped)
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            rows = grouped[start:end]
            gate = F.linear(rows, self.gate[expert_id], None if self.gate_bias is None else self.gate_bias[expert_id])
            up = F.linear(rows, self.up[expert_id], None if self.up_bias is None else self.up_bias[expert_id])
            grouped_output[start:end] = F.linear(self.activation(gate, up), self.down[expert_id],
                                                 None if self.down_bias is None else self.down_bias[expert_id])
            start = end
        pair_output = torch.empty_like(grouped_output)
        pair_output[pair_order] = grouped_output
        # Summing each row's k slots in slot order (not an index_add_ over groups) keeps the sum's
        # order fixed: CUDA's index_add_ accumulates with atomics, in no fixed order.
        pair_output = pair_output.view(num_rows, k, x.shape[1]) * weights.to(pair_output.dtype).unsqueeze(-1)
        return pair_output.sum(dim=1)

    def linears(self) -> list:
        """What a decoder layer's feed-forward multiplies by, for the weight accounting (itself)."""
        return [self]

    def num_bytes(self) -> int:
        """Bytes of every weight it holds: all experts (a step reads its rows' experts only),
        the router and the shared expert."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.buffers())


def routing_of(config: ModelConfig) -> Routing:
    """The routing that config's mixture of experts declares (model/loader.py resolves each
    architecture's rule where the file is silent)."""
    return Routing(config.num_experts, config.num_experts_per_token, config.expert_scoring,
                   config.expert_normalize_top_k, config.expert_weights_scale)


def make_sparse_moe(config: ModelConfig, weights: dict, prefix: str, routing: Routing, activation: ExpertActivation,
                    weight_format: str, device: torch.device, dtype: torch.dtype):
    """The MoE feed-forward of the layer at `prefix` ("model.layers.7"), its weights popped from
    `weights` (model/expert_weights.py's names): the router `mlp.gate.weight`, the stacked experts
    `mlp.experts.{gate,up,down}_proj.weight` (dense tensors, or 3-D PackedWeights in the file's
    blocks) with their biases `.bias` where the file has them (gpt-oss, also `mlp.gate.bias`),
    and where config has one the shared expert `mlp.shared_expert.*` with its gate
    `mlp.shared_expert_gate.weight`. Returns the layer to call, hidden [rows, hidden] -> [rows, hidden].

    On the CPU with the quantized kernels (the weights still in the file's kernel block types, or
    --dtype int4 / int8 converting them), the packed PackedSparseMoE (model/kernels/experts.py),
    which reads only the chosen experts' blocks; otherwise the torch SparseMoE on dense weights
    in `dtype` (the activation dtype of weight_format) on `device`."""
    from tokios.model.kernels import precise_activations
    from tokios.model.kernels.experts import PackedSparseMoE, can_pack_experts

    def pop(name: str):
        return weights.pop(f"{prefix}.{name}")

    def dense(weight):
        return None if weight is None else as_dense(weight).to(device=device, dtype=dtype)

    router_weight = pop("mlp.gate.weight")
    gate, up, down = (pop(f"mlp.experts.{projection}.weight") for projection in ("gate_proj", "up_proj", "down_proj"))
    # gpt-oss's biases (the router's and each expert's), Gemma 4's per-expert output scale
    biases = {name: weights.pop(f"{prefix}.{tensor}", None)
              for name, tensor in (("router_bias", "mlp.gate.bias"), ("gate_bias", "mlp.experts.gate_proj.bias"),
                                   ("up_bias", "mlp.experts.up_proj.bias"), ("down_bias", "mlp.experts.down_proj.bias"),
                                   ("expert_scale", "mlp.experts.down_proj.scale"))}
    shared = None
    if config.shared_expert_intermediate_size:
        shared = [pop(f"mlp.shared_expert.{projection}.weight") for projection in ("gate_proj", "up_proj", "down_proj")]
        shared.append(weights.pop(f"{prefix}.mlp.shared_expert_gate.weight", None))
    if can_pack_experts([gate, up, down, *(shared or [])[:3]], weight_format, device):
        return PackedSparseMoE(routing, router_weight, gate, up, down, activation=activation,
                               shared_expert=None if shared is None else SharedExpert(*shared),
                               weight_format=weight_format, precise=precise_activations(weight_format), **biases)
    shared_expert = None if shared is None else SharedExpert(*(dense(w) for w in shared))
    return SparseMoE(routing, dense(router_weight), dense(gate), dense(up), dense(down), activation=activation,
                     shared_expert=shared_expert, **{name: dense(bias) for name, bias in biases.items()})
