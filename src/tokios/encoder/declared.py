"""What a model file declares about the vectors and scores it is made for.

A trained embedding model's authors fix how its hidden states become a vector: the pooling
(mean, the CLS token, the last token), dense layers after it, L2 normalisation, the prompts put
before a query or a document, the longest input it was trained on, and which shorter (Matryoshka)
sizes keep their meaning. A sentence-transformers directory says so in modules.json,
1_Pooling/config.json, N_Dense/, N_Normalize, sentence_bert_config.json and
config_sentence_transformers.json; a GGUF written by llama.cpp's converter keeps the pooling
(`<arch>.pooling_type`) and the dense layers' sizes, and llama.cpp normalises by default.
Read here once, at load; encoder/heads.py and the server apply it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from tokios.errors import ModelLoadError, UnsupportedError

MEAN, CLS, LAST, RANK = "mean", "cls", "last", "rank"
# llama.cpp's enum llama_pooling_type (gguf PoolingType): 0 none, 1 mean, 2 cls, 3 last, 4 rank.
GGUF_POOLING = {1: MEAN, 2: CLS, 3: LAST, 4: RANK}


@dataclass(frozen=True)
class DenseModule:
    """One sentence-transformers Dense module: y = activation(x W^T + b)."""

    weight_name: str  # the weight's name among the model's tensors
    bias_name: str | None
    in_features: int
    out_features: int
    activation: str = "identity"  # "identity" or "tanh"


@dataclass(frozen=True)
class EmbeddingDeclaration:
    pooling: str  # MEAN, CLS, LAST, or RANK for a cross-encoder
    normalize: bool = True
    dense: tuple[DenseModule, ...] = ()
    # Prompt name -> text put before the input ("query", "document", ...), and the one used
    # when a request names none.
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # The longest input the model was trained on (sentence-transformers' max_seq_length), when
    # shorter than its position table.
    max_seq_length: int | None = None
    # Sizes a vector may be cut to and stay meaningful (Matryoshka training); empty: only its own.
    matryoshka_dimensions: tuple[int, ...] = ()
    # What a cross-encoder's one logit goes through to become its score: sentence-transformers'
    # CrossEncoder activation as the directory declares it, else its default for one label.
    score_activation: str = "sigmoid"

    @property
    def is_rerank(self) -> bool:
        return self.pooling == RANK


_ST_POOLING_MODES = (("pooling_mode_cls_token", CLS), ("pooling_mode_mean_tokens", MEAN),
                     ("pooling_mode_lasttoken", LAST))
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
_ST_SCORE_ACTIVATIONS = {**_ST_ACTIVATIONS, "torch.nn.modules.activation.Sigmoid": "sigmoid"}


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def sentence_transformers_modules(directory: str) -> list[dict] | None:
    path = os.path.join(directory, "modules.json")
    return _read_json(path) if os.path.isfile(path) else None


def declaration_from_directory(directory: str, *, default_pooling: str,
                               is_cross_encoder: bool = False) -> EmbeddingDeclaration:
    """The declaration of a Hugging Face directory: its sentence-transformers modules when it has
    them, else `default_pooling` (the architecture's) with normalisation."""
    config = _read_json(os.path.join(directory, "config.json"))
    matryoshka = tuple(int(size) for size in config.get("matryoshka_dimensions") or ())
    if is_cross_encoder:
        # sentence-transformers' CrossEncoder keeps its activation here (older versions: the second key).
        activation = ((config.get("sentence_transformers") or {}).get("activation_fn")
                      or config.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid")
        if activation not in _ST_SCORE_ACTIVATIONS:
            raise UnsupportedError(f"{directory}/config.json: cross-encoder activation {activation!r} is not supported "
                                   f"(supported: {', '.join(_ST_SCORE_ACTIVATIONS)})")
        return EmbeddingDeclaration(pooling=RANK, normalize=False, score_activation=_ST_SCORE_ACTIVATIONS[activation])
    modules = sentence_transformers_modules(directory)
    if modules is None:
        return EmbeddingDeclaration(pooling=default_pooling, matryoshka_dimensions=matryoshka)
    pooling, normalize, dense = default_pooling, False, []
    for module in sorted(modules, key=lambda module: module.get("idx", 0)):
        kind, path = module["type"].rsplit(".", 1)[-1], os.path.join(directory, module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _st_pooling(_read_json(os.path.join(path, "config.json")), path)
        elif kind == "Dense":
            dense.append(_st_dense(path, module.get("path", ""), len(dense)))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedError(f"{directory}: sentence-transformers module {module['type']!r} is not supported "
                                   "(supported: Transformer, Pooling, Dense, Normalize)")
    st_config_path = os.path.join(directory, "config_sentence_transformers.json")
    st_config = _read_json(st_config_path) if os.path.isfile(st_config_path) else {}
    prompts = {name: text for name, text in (st_config.get("prompts") or {}).items()}
    default_prompt_name = st_config.get("default_prompt_name") or None
    bert_config_path = os.path.join(directory, "sentence_bert_config.json")
    max_seq_length = (_read_json(bert_config_path).get("max_seq_length")
                      if os.path.isfile(bert_config_path) else None)
    return EmbeddingDeclaration(pooling=pooling, normalize=normalize, dense=tuple(dense), prompts=prompts,
                                default_prompt_name=default_prompt_name, max_seq_length=max_seq_length,
                                matryoshka_dimensions=matryoshka)


def _st_pooling(config: Mapping[str, Any], path: str) -> str:
    if config.get("include_prompt") is False:
        raise UnsupportedError(f"{path}/config.json: include_prompt false (pooling that skips the prompt) is not supported")
    if config.get("pooling_mode") in (MEAN, CLS, "lasttoken"):
        return LAST if config["pooling_mode"] == "lasttoken" else config["pooling_mode"]
    chosen = [pooling for key, pooling in _ST_POOLING_MODES if config.get(key)]
    others = [key for key, value in config.items() if key.startswith("pooling_mode") and value
              and key not in dict(_ST_POOLING_MODES)]
    if len(chosen) != 1 or others:
        raise UnsupportedError(f"{path}/config.json: pooling {sorted(key for key, value in config.items() if value is True)} "
                               "is not supported (one of mean, cls, lasttoken)")
    return chosen[0]


def _st_dense(path: str, relative: str, index: int) -> DenseModule:
    config = _read_json(os.path.join(path, "config.json"))
    activation = _ST_ACTIVATIONS.get(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if activation is None:
        raise UnsupportedError(f"{path}/config.json: activation {config.get('activation_function')!r} is not "
                               f"supported (supported: {', '.join(_ST_ACTIVATIONS)})")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise ModelLoadError(f"{path}: a Dense module without its model.safetensors (a pytorch_model.bin is not read: "
                             "re-save the model with sentence-transformers to write safetensors)")
    bias = f"dense.{index}.linear.bias" if config.get("bias", True) else None
    return DenseModule(weight_name=f"dense.{index}.linear.weight", bias_name=bias,
                       in_features=int(config["in_features"]), out_features=int(config["out_features"]),
                       activation=activation)


def declaration_from_gguf(metadata: Mapping[str, Any], architecture: str, tensor_names: set[str], *,
                          default_pooling: str) -> EmbeddingDeclaration:
    """The declaration a GGUF carries: its pooling type (or the architecture's default), its
    dense layers (llama.cpp's dense_2 / dense_3); normalised, as
    llama.cpp's server normalises embeddings by default."""
    pooling_value = metadata.get(f"{architecture}.pooling_type")
    if pooling_value is not None and int(pooling_value) not in GGUF_POOLING:
        raise UnsupportedError(f"{architecture}.pooling_type {pooling_value} is not supported "
                               "(1 mean, 2 cls, 3 last, 4 rank)")
    pooling = GGUF_POOLING[int(pooling_value)] if pooling_value is not None else default_pooling
    if "cls.output.weight" in tensor_names:
        pooling = RANK
    dense = []
    for name in ("dense_2", "dense_3"):
        if f"{name}.weight" in tensor_names:
            dense.append(DenseModule(weight_name=f"{name}.weight",
                                     bias_name=f"{name}.bias" if f"{name}.bias" in tensor_names else None,
                                     in_features=int(metadata[f"{architecture}.{name}_feat_in"]),
                                     out_features=int(metadata[f"{architecture}.{name}_feat_out"])))
    return EmbeddingDeclaration(pooling=pooling, normalize=pooling != RANK, dense=tuple(dense))
