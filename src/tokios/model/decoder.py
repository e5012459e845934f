"""What every decoder model file shares (model/llama.py, model/gemma3.py): choosing the ops
(C++ kernels for quantized weights on the CPU, PyTorch otherwise), the fused all-layer decode
step and when it applies, and the accounting of linear weights for logs and tools.

A model sets self.layers (each with qkv, o_proj, gate_up, down) and self.lm_head, then calls
init_ops(); its forward() tries fused_decode() first.
"""

from __future__ import annotations

import torch

from tokios.model.attention import AttentionMetadata
from tokios.model.kernels import load_extension
from tokios.model.linear import summarize_linears
from tokios.model.ops import CpuKernelOps, TorchOps, fused_decode_inputs


class DecoderModel:
    def init_ops(self, config, rotary, weight_format: str, device: torch.device) -> None:
        extension = load_extension() if weight_format in ("int4", "int8", "stored") and device.type == "cpu" else None
        self.ops = CpuKernelOps(config, rotary, extension) if extension is not None else TorchOps(config, rotary)
        # The C++ decode attention makes one-query rows cheap (the runner lays short prompt
        # chunks out so); the fused all-layer step serves steps of only such rows, when every
        # layer's products are on the quantized kernels (a dense tensor in a "stored" file is not).
        self.has_decode_attention_kernel = extension is not None
        self.can_fuse_decode = extension is not None and all(
            getattr(linear, "linear", None) is not None for linear in self.layer_linears())
        # num_layers -> (fused decoder, the cache list it was built over)
        self._fused_by_num_layers: dict[int | None, tuple[object, list]] = {}

    def fused_decode(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                     kv_caches: list, num_layers: int | None) -> torch.Tensor | None:
        """Hidden states after every layer (before the final norm) when this is a decode-only step
        the fused C++ step can run (every layer in one call, no Python between ops); else None."""
        if not (self.can_fuse_decode and metadata.num_decode_tokens == hidden.shape[0]):
            return None
        fused, fused_caches = self._fused_by_num_layers.get(num_layers, (None, None))
        if fused is None or fused_caches is not kv_caches:
            fused = self.ops.fused_decoder(self, kv_caches, num_layers)
            self._fused_by_num_layers[num_layers] = (fused, kv_caches)
        return fused.forward(hidden, positions, *fused_decode_inputs(metadata))

    def layer_linears(self) -> list:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]

    def weight_bytes(self) -> int:
        return sum(lin.num_bytes() for lin in [self.lm_head] + self.layer_linears())

    def weight_summary(self) -> str:
        return summarize_linears([self.lm_head] + self.layer_linears())
