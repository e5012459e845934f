"""Model: what the runner and the engine ask of a model, whatever computes it.

Two kinds implement it, each by subclassing Model: DecoderModel (model/decoder.py: the layers run
in this process, over a KV cache the runner allocates) and DistributedModel
(tokios.distributed: the layers and their cache live in a parallel group's rank processes; this
process keeps the output head). What only one kind has is an attribute here with the default
"not here", so callers read a flag instead of probing for a method.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from tokios.errors import TokiosError
from tokios.model.attention import AttentionMetadata


class Model(Protocol):
    # The model holds its own KV cache (a parallel group's ranks do): the runner allocates none,
    # and copies blocks through copy_blocks().
    holds_kv_cache: bool = False
    # The C++ decode attention serves one-query rows; the runner lays short prompt chunks out as
    # such rows when it does.
    has_decode_attention_kernel: bool = False
    # A decode-only forward runs every layer in one fused call; the runner splits a mixed batch
    # into its decode rows and its spans to keep the decodes on it.
    can_fuse_decode: bool = False
    # forward_layer_slice() runs a prompt chunk through some layers a step (the scheduler's
    # layer slices).
    supports_layer_slices: bool = False
    # close() stopped what the model ran outside this process; it cannot run again.
    is_closed: bool = False

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden].
        num_layers: only the model's first layers, then the final norm (speculative self-draft)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [rows, hidden] -> logits [rows, vocab] float32."""

    @abstractmethod
    def weight_summary(self) -> str:
        """One line on the weights' formats and sizes, for the log."""

    def forward_layer_slice(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                            kv_caches: list, start: int, stop: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk through layers [start, stop) only (when supports_layer_slices)."""
        raise NotImplementedError(f"{type(self).__name__} does not run layer slices")

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of KV blocks, (source, destination) block ids (when holds_kv_cache)."""
        raise NotImplementedError(f"{type(self).__name__} holds no KV cache: the runner copies its blocks")

    def watch(self, on_failure: Callable[[TokiosError], None]) -> None:
        """Call on_failure from another thread if a part of the model running outside this
        process is lost between steps. A model all in this process has nothing to watch."""

    def close(self) -> None:
        """Stop what the model runs outside this process. A model all in this process has
        nothing to stop and stays usable."""
