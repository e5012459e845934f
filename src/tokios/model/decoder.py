"""What every decoder model file shares (model/llama.py, model/gemma3.py): choosing the ops
(C++ kernels for quantized weights on the CPU, PyTorch otherwise), the fused all-layer decode
step and when it applies, and the accounting of linear weights for logs and tools.

A model sets self.layers (each with qkv, o_proj and its feed-forward: gate_up and down, or a
`feed_forward` with linears(), model/mlp.py), self.layer_indices (the
model's layer number of each) and self.lm_head, then calls init_ops(); it defines embed() and
layer_loop(), and forward() / run_layers() here try fused_decode() first. A ModelPart builds only
some of it: a pipeline stage's layers, with or without the embedding and the output head
(tokios.distributed).
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from tokios.model.attention import AttentionMetadata
from tokios.model.kernels import load_extension
from tokios.model.linear import summarize_linears
from tokios.model.ops import CpuKernelOps, TorchOps, fused_decode_inputs
from tokios.model.protocol import Model


def layer_number(name: str) -> int | None:
    """The layer of a weight in Hugging Face names ("model.layers.7.mlp.up_proj.weight": 7), or
    None for the model-wide ones."""
    return int(name.split(".", 3)[2]) if name.startswith("model.layers.") else None


@dataclass(frozen=True)
class ModelPart:
    """Which pieces of a model one process builds: `layers` (the model's layer numbers, a
    pipeline stage's range), the embedding table (the first stage) and the output head (where
    logits are computed). The final norm is small and always built."""

    layers: range
    embed: bool = True
    head: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> "ModelPart":
        return cls(range(num_layers))

    def needs(self, name: str, tied_head: bool) -> bool:
        """Whether this part reads the weight `name` (Hugging Face names) from the file;
        tied_head: the output head is the embedding table."""
        layer = layer_number(name)
        if layer is not None:
            return layer in self.layers
        if name == "model.embed_tokens.weight":
            return self.embed or (self.head and tied_head)
        if name == "lm_head.weight":
            return self.head
        return True  # the final norm, RoPE factors


def make_ops(config, rotary, weight_format: str, device: torch.device) -> TorchOps:
    """The C++ kernel ops for quantized or stored weights on the CPU (where the kernels build), else torch's."""
    extension = load_extension() if weight_format in ("int4", "int8", "stored") and device.type == "cpu" else None
    return CpuKernelOps(config, rotary, extension) if extension is not None else TorchOps(config, rotary)


def _feed_forward_linears(layer) -> list:
    # Gemma's layers keep their MLP as gate_up and down (Gemma 4's MoE variant its experts beside
    # it, as moe); the others hold a feed_forward.
    feed_forward = getattr(layer, "feed_forward", None)
    linears = feed_forward.linears() if feed_forward is not None else [layer.gate_up, layer.down]
    experts = getattr(layer, "moe", None)
    return linears + (experts.linears() if experts is not None else [])


class DecoderModel(Model):
    # The runner may run a prompt chunk through some layers a step (forward_layer_slice).
    supports_layer_slices = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden].
        num_layers: run only the model's first layers, then the final norm (speculative self-draft)."""
        hidden = self.run_layers(self.embed(input_ids), positions, metadata, kv_caches, num_layers)
        return self.ops.rms_norm(hidden, self.norm)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   kv_caches: list, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states through this part's layers (those numbered below num_layers, when given),
        before the final norm. kv_caches: one (key, value) pair per layer of this part."""
        count = self.num_local_layers(num_layers)
        if count == 0:
            return hidden
        fused = self.fused_decode(hidden, positions, metadata, kv_caches, count)
        if fused is not None:
            return fused
        return self.layer_loop(hidden, positions, metadata, kv_caches, count)

    def forward_layer_slice(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                            kv_caches: list, start: int, stop: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk through layers [start, stop) of the whole model only (the scheduler's
        layer slices). hidden: the chunk's states from the slice before (None when start is 0:
        the chunk's embeddings). Returns the states after layer stop - 1, final-normed when that
        is the last layer. Always the per-op path: the fused step runs every layer."""
        if start == 0:
            hidden = self.embed(input_ids)
        hidden = self.layer_loop(hidden, positions, metadata, kv_caches, stop, start)
        return self.ops.rms_norm(hidden, self.norm) if stop == len(self.layers) else hidden

    def num_local_layers(self, num_layers: int | None) -> int:
        """How many of this part's layers have a model layer number below num_layers (None: all)."""
        if num_layers is None:
            return len(self.layers)
        indices = self.layer_indices
        return max(0, min(num_layers, indices.stop) - indices.start) if len(indices) else 0

    def init_ops(self, config, rotary, weight_format: str, device: torch.device, ops=None) -> None:
        """After the layers are built. ops: make_ops' choice, when the layers took theirs from it."""
        self.ops = ops if ops is not None else make_ops(config, rotary, weight_format, device)
        # The C++ decode attention makes one-query rows cheap (the runner lays short prompt
        # chunks out so); the fused all-layer step serves steps of only such rows, when every
        # layer's products are on the quantized kernels (a dense tensor in a "stored" file is
        # not; a mixture of experts' packed experts are).
        self.has_decode_attention_kernel = isinstance(self.ops, CpuKernelOps)
        # A layer's products are on the kernels: a packed linear (.linear), or a packed sparse
        # MoE (.kernel, model/kernels/experts.py).
        self.can_fuse_decode = self.has_decode_attention_kernel and all(
            getattr(linear, "linear", None) is not None or getattr(linear, "kernel", None) is not None
            for linear in self.layer_linears())
        # num_layers -> (fused decoder, the cache list it was built over)
        self._fused_by_num_layers: dict[int | None, tuple[object, list]] = {}

    def fused_decode(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                     kv_caches: list, num_layers: int | None) -> torch.Tensor | None:
        """Hidden states after every layer (before the final norm) when this is a decode-only step
        the fused C++ step can run (every layer in one call, no Python between ops); else None."""
        if not (self.can_fuse_decode and metadata.num_decode_tokens == hidden.shape[0]):
            return None
        if num_layers == len(self.layers):
            num_layers = None  # one fused step for "every layer", however it was asked for
        fused, fused_caches = self._fused_by_num_layers.get(num_layers, (None, None))
        if fused is None or fused_caches is not kv_caches:
            fused = self.ops.fused_decoder(self, kv_caches, num_layers)
            self._fused_by_num_layers[num_layers] = (fused, kv_caches)
        return fused.forward(hidden, positions, *fused_decode_inputs(metadata))

    def layer_linears(self) -> list:
        """Every layer's products; a sparse MoE counts as one (its num_bytes() is every expert's)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, *_feed_forward_linears(layer))]

    def all_linears(self) -> list:
        return ([self.lm_head] if self.lm_head is not None else []) + self.layer_linears()

    def weight_bytes(self) -> int:
        return sum(lin.num_bytes() for lin in self.all_linears())

    def weight_bytes_read(self) -> int | None:
        """The weight bytes the kernels have counted reading, summed over every product (a
        sparse MoE counts the experts it chose); None when some product does not count (torch)."""
        counts = [getattr(lin, "weight_bytes_read", None) for lin in self.all_linears()]
        return None if any(count is None for count in counts) else sum(counts)

    def weight_summary(self) -> str:
        return summarize_linears(self.all_linears())
