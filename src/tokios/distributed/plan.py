"""Who holds what in a tensor x pipeline parallel group, and the weights each rank keeps.

Ranks are numbered stage-major: rank = stage * tensor_parallel_size + tp_rank. Pipeline stages
take contiguous layer ranges, as even as the layer count allows (earlier stages take the extra
layer). Tensor parallel splits attention by heads and the feed-forward by its inner features:
q/k/v and gate/up by output features (each rank's own heads or slice), o_proj and down by input
features, whose partial products one all-reduce sums. KV heads split with the query heads that
use them; with fewer KV heads than ranks, each rank keeps the one KV head its query heads read
(replicated). Packed GGUF weights split on their block boundaries, so each shard runs on the
same quantized kernels as the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gguf import GGML_QUANT_SIZES

from tokios.config import ModelConfig
from tokios.errors import InvalidRequestError, UnsupportedError
from tokios.model.decoder import ModelPart, layer_number
from tokios.model.quant import PackedWeight, select_rows


@dataclass(frozen=True)
class ParallelPlan:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @classmethod
    def of(cls, group) -> "ParallelPlan":
        """The plan of a ParallelConfig (config.py)."""
        return cls(group.tensor_parallel_size, group.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_parallel_size + tp_rank

    @property
    def output_rank(self) -> int:
        """The rank whose hidden states go back to the front: the last stage's first TP rank."""
        return self.rank_of(self.pipeline_parallel_size - 1, 0)

    def stage_layers(self, stage: int, num_layers: int) -> range:
        base, extra = divmod(num_layers, self.pipeline_parallel_size)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def part_of(self, rank: int, num_layers: int) -> ModelPart:
        stage = self.stage_of(rank)
        return ModelPart(self.stage_layers(stage, num_layers), embed=stage == 0, head=False)

    def check(self, config: ModelConfig) -> None:
        """An InvalidRequestError naming the size when this model cannot be split so (an
        UnsupportedError for tensor parallel over a mixture of experts)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp > 1 and config.num_experts:
            raise UnsupportedError(f"tensor_parallel_size {tp} with a mixture of experts ({config.num_experts} "
                                   "experts) is not supported: its experts are not split across ranks "
                                   "(pipeline parallel is)", param="tensor_parallel_size")
        if pp > config.num_layers:
            raise InvalidRequestError(f"pipeline_parallel_size {pp} is more than the model's {config.num_layers} "
                                      "layers", param="pipeline_parallel_size")
        problems = []
        if config.num_heads % tp:
            problems.append(f"{config.num_heads} attention heads")
        if config.num_kv_heads % tp and tp % config.num_kv_heads:
            problems.append(f"{config.num_kv_heads} KV heads (they must divide by the size, or the size by them)")
        if config.intermediate_size % tp:
            problems.append(f"a feed-forward of {config.intermediate_size} features")
        if problems:
            raise InvalidRequestError(f"tensor_parallel_size {tp} does not divide {config.name or 'the model'}'s "
                                      f"{' and '.join(problems)}", param="tensor_parallel_size")

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes one tensor-parallel rank computes with: its share of query and KV heads."""
        tp = self.tensor_parallel_size
        return replace(config, num_heads=config.num_heads // tp, num_kv_heads=max(1, config.num_kv_heads // tp))

    def shard_weights(self, weights: dict, config: ModelConfig, rank: int, weight_format: str = "stored") -> dict:
        """The weights (Hugging Face names, as the loader gives them) rank `rank` keeps: its
        stage's layers, each split for its tensor-parallel rank; embedding, final norm and head
        as they are (the model part decides which it builds). A packed tensor whose split would
        cut its blocks is dequantized first when the weights are converted anyway (weight_format
        other than "stored"); run as stored, that is an error naming it."""
        part = self.part_of(rank, config.num_layers)
        tp, tp_rank = self.tensor_parallel_size, self.tp_rank_of(rank)
        head_dim = config.head_dim
        q_rows = _slice_of(config.num_heads // tp * head_dim, tp_rank)
        if config.num_kv_heads >= tp:
            kv_rows = _slice_of(config.num_kv_heads // tp * head_dim, tp_rank)
        else:  # replicated: the KV head that this rank's query heads read
            kv_head = tp_rank * config.num_kv_heads // tp
            kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        ffn_rows = _slice_of(config.intermediate_size // tp, tp_rank)
        split_rows = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
                      "mlp.gate_proj": ffn_rows, "mlp.up_proj": ffn_rows}
        split_columns = {"self_attn.o_proj.weight": q_rows, "mlp.down_proj.weight": ffn_rows}
        kept = {}
        for name, weight in weights.items():
            layer = layer_number(name)
            if layer is None:
                kept[name] = weight
                continue
            if layer not in part.layers:
                continue
            local = name.split(".", 3)[3]
            if tp > 1:
                module = local.rsplit(".", 1)[0]
                if module in split_rows:
                    weight = select_rows(weight, split_rows[module])
                elif local in split_columns:
                    weight = _columns(weight, split_columns[local], name, weight_format)
            kept[name] = weight
        return kept


def _slice_of(size: int, index: int) -> slice:
    return slice(index * size, (index + 1) * size)


def _columns(weight, columns: slice, name: str, weight_format: str):
    if not isinstance(weight, PackedWeight):
        return weight[:, columns].contiguous()
    block, block_bytes = GGML_QUANT_SIZES[weight.ggml_type]
    if columns.start % block or columns.stop % block:
        if weight_format != "stored":
            return weight.dequantize()[:, columns].contiguous()
        raise UnsupportedError(f"{name} ({weight.ggml_type.name}) cannot be split at input feature {columns.start} "
                               f"as stored: its blocks hold {block} weights; choose a tensor_parallel_size that keeps "
                               "each share whole blocks, or convert the weights with --dtype int8, int4, bfloat16 "
                               "or float32")
    raw = weight.raw[:, columns.start // block * block_bytes:columns.stop // block * block_bytes].contiguous()
    return PackedWeight(raw, weight.ggml_type, (weight.shape[0], columns.stop - columns.start), weight.name,
                        weight.num_tensors)
