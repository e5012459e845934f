"""The heads that turn an encoder's packed hidden states into what a request asks for.

EmbeddingHead: pooling (mean over the input's tokens, its first token, or its last), then the
declared dense layers, then L2 normalisation (encoder/declared.py says which). ClassifierHead:
a cross-encoder's score of a (query, document) pair: the first token's state, through the
pooler layer where the model has one (BERT's dense + tanh), then the classifier.
`truncate_dimensions` cuts a vector to a Matryoshka size and normalises it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokios.encoder.batch import EncoderBatch
from tokios.encoder.declared import CLS, LAST, MEAN, EmbeddingDeclaration


def pool(hidden: torch.Tensor, batch: EncoderBatch, pooling: str) -> torch.Tensor:
    """hidden [num_tokens, hidden] -> [num_inputs, hidden]."""
    if pooling == CLS:
        return hidden[batch.starts]
    if pooling == LAST:
        return hidden[batch.ends]
    if pooling == MEAN:
        # Each input's sum as a difference of running sums (float64, so no input's sum loses digits
        # to the ones before it): index_add_ over the packed rows ran serially, 60 ms for 2,400 rows.
        running = F.pad(hidden.double().cumsum(0), (0, 0, 1, 0))
        sums = running[batch.ends + 1] - running[batch.starts]
        lengths = torch.tensor(batch.seq_lens, device=hidden.device, dtype=torch.float64)
        return (sums / lengths[:, None]).to(hidden.dtype)
    raise ValueError(f"pooling must be mean, cls or last, got {pooling!r}")


class EmbeddingHead:
    def __init__(self, declaration: EmbeddingDeclaration, weights: dict[str, torch.Tensor], device: torch.device):
        self.pooling = declaration.pooling
        self.normalize = declaration.normalize
        self.dense = []
        for module in declaration.dense:
            weight = weights.pop(module.weight_name).float().to(device)
            if tuple(weight.shape) != (module.out_features, module.in_features):
                raise ValueError(f"{module.weight_name}: shape {tuple(weight.shape)}, declared "
                                 f"({module.out_features}, {module.in_features})")
            bias = weights.pop(module.bias_name).float().to(device) if module.bias_name else None
            self.dense.append((weight, bias, module.activation))
        self.dimensions = declaration.dense[-1].out_features if declaration.dense else None

    def __call__(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        """-> [num_inputs, dimensions] float32."""
        vectors = pool(hidden.float(), batch, self.pooling)
        for weight, bias, activation in self.dense:
            vectors = F.linear(vectors, weight, bias)
            if activation == "tanh":
                vectors = torch.tanh(vectors)
        return F.normalize(vectors, dim=-1) if self.normalize else vectors


class ClassifierHead:
    """pooler (optional) -> classifier: [num_inputs, num_labels] float32 logits."""

    def __init__(self, pooler: tuple[torch.Tensor, torch.Tensor | None] | None,
                 classifier: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
        self.pooler = None if pooler is None else tuple(None if t is None else t.float().to(device) for t in pooler)
        self.weight, self.bias = (None if t is None else t.float().to(device) for t in classifier)
        self.num_labels = int(self.weight.shape[0])

    def __call__(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        first = hidden.float()[batch.starts]
        if self.pooler is not None:
            first = torch.tanh(F.linear(first, *self.pooler))
        return F.linear(first, self.weight, self.bias)


def truncate_dimensions(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """The first `dimensions` of each vector, normalised again when the model normalises."""
    cut = vectors[:, :dimensions]
    return F.normalize(cut, dim=-1) if normalize else cut
