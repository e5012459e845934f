"""How a model's layers share the paged KV cache: KV groups (vLLM's hybrid allocator is the anchor).

Pure Python. A group is a set of layers with the same attention window that share one block
table per request. Every group has the same number of layers, so a block id means the same
amount of memory whichever group holds it, and all groups draw from one block pool: layer j of
each group writes into tensor pair j, at the slots of its own group's blocks.

A model whose layers all attend fully is one group of every layer (the cache as it always was).
Gemma 3's 270M (18 layers: 15 sliding over 512 tokens, 3 full) is 6 groups of 3 layers: one full
group and five sliding ones. A sliding group never reads more than its window back, so the
KV manager frees its blocks once they fall out of the window: a long request then holds blocks
for all positions in 1 group and for at most a window in the other 5.

A layer that reads an earlier layer's K/V (Gemma 4's last layers, `kv_source_layers`) stores
none: it belongs to no group and maps to its source's group and tensor pair, so blocks, bytes
and the cache tensors count only the layers that store K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # tokens each query sees back (its own position included); None: all
    layers: tuple[int, ...]

    def first_needed_position(self, position: int) -> int:
        """The earliest position whose K/V a query at `position` reads."""
        return 0 if self.window is None else max(0, position - self.window + 1)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]  # of the layers that store K/V
    layer_to_group: tuple[int, ...]  # every layer's group (a reading layer: its source's)
    layer_to_tensor: tuple[int, ...]  # index of the (key, value) tensor pair the layer uses

    @property
    def num_tensor_pairs(self) -> int:
        return len(self.groups[0].layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def has_windows(self) -> bool:
        return any(window is not None for window in self.windows)

    @classmethod
    def for_windows(cls, layer_windows: tuple[int | None, ...],
                    kv_source_layers: tuple[int, ...] | None = None) -> "KVCacheLayout":
        """Groups from each layer's window (None: full). Full-attention groups come first, so
        group 0 always covers every position when the model has a full layer. kv_source_layers:
        per layer, the layer whose K/V it reads (itself when it stores its own); None: each its own."""
        return _layout(tuple(layer_windows), None if kv_source_layers is None else tuple(kv_source_layers))

    @classmethod
    def for_config(cls, config) -> "KVCacheLayout":
        """config: a ModelConfig."""
        return cls.for_windows(config.layer_windows or (None,) * config.num_layers, config.kv_source_layers)


@lru_cache(maxsize=32)
def _layout(layer_windows: tuple[int | None, ...], kv_source_layers: tuple[int, ...] | None) -> KVCacheLayout:
    sources = kv_source_layers or tuple(range(len(layer_windows)))
    for layer, source in enumerate(sources):
        if source != layer and (source > layer or sources[source] != source
                                or layer_windows[source] != layer_windows[layer]):
            raise ValueError(f"layer {layer} reads the K/V of layer {source}, which is not an earlier layer "
                             "storing its own with the same window")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if sources[layer] == layer:
            by_window.setdefault(window, []).append(layer)
    group_size = math.gcd(*(len(layers) for layers in by_window.values()))
    ordered = sorted(by_window.items(), key=lambda item: (item[0] is not None, item[0] or 0))
    groups = []
    for window, layers in ordered:
        groups.extend(KVCacheGroup(window, tuple(layers[i:i + group_size])) for i in range(0, len(layers), group_size))
    layer_to_group = [0] * len(layer_windows)
    layer_to_tensor = [0] * len(layer_windows)
    for group_index, group in enumerate(groups):
        for position, layer in enumerate(group.layers):
            layer_to_group[layer] = group_index
            layer_to_tensor[layer] = position
    for layer, source in enumerate(sources):
        layer_to_group[layer], layer_to_tensor[layer] = layer_to_group[source], layer_to_tensor[source]
    return KVCacheLayout(tuple(groups), tuple(layer_to_group), tuple(layer_to_tensor))
