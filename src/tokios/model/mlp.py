"""A decoder layer's feed-forward as one callable, normed hidden [rows, hidden] -> [rows, hidden]:
the dense gated MLP (`GatedMLP`) or, in a mixture-of-experts model, the sparse MoE that
model/moe.py's make_sparse_moe builds. `make_feed_forward` chooses between them from the config,
so that a model file's layer loop calls `layer.feed_forward(x)` whichever it is.

Both answer `linears()` (what they multiply by, for the weight accounting in model/decoder.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from tokios.config import ModelConfig
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.linear import make_linear
from tokios.model.moe import ExpertActivation, make_sparse_moe, routing_of
from tokios.model.quant import concat_rows


class GatedMLP:
    """down(glu(gate_up(x))): gate and up as one fused projection [2 * intermediate, hidden]
    (one product a step), `glu` the model's ops' silu_mul (the C++ kernel's where it runs, so the
    per-op path computes what the fused decode step does)."""

    def __init__(self, gate_up, down, glu: Callable[[torch.Tensor], torch.Tensor]):
        self.gate_up = gate_up
        self.down = down
        self.glu = glu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.glu(self.gate_up(x)))

    def linears(self) -> list:
        return [self.gate_up, self.down]


def make_feed_forward(config: ModelConfig, weights: dict, prefix: str, weight_format: str, device: torch.device,
                      precise: bool, ops, expert_activation: ExpertActivation = ExpertActivation("silu")):
    """The feed-forward of the layer at `prefix`, its weights popped from `weights` (Hugging Face
    names): the sparse MoE (its experts combining gate and up by expert_activation) when the
    config has experts, else the gated MLP with SiLU."""
    if config.num_experts:
        return make_sparse_moe(config, weights, prefix, routing_of(config), expert_activation, weight_format,
                               device, ACTIVATION_DTYPE[weight_format])
    gate_up = concat_rows([weights.pop(f"{prefix}.mlp.gate_proj.weight"), weights.pop(f"{prefix}.mlp.up_proj.weight")])
    return GatedMLP(make_linear(gate_up, None, weight_format, device, precise),
                    make_linear(weights.pop(f"{prefix}.mlp.down_proj.weight"), None, weight_format, device, precise,
                                exact_sums=True),
                    ops.silu_mul)
