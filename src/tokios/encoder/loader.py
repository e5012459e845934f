"""Loading an encoder model: a GGUF written by llama.cpp's converter, or a Hugging Face /
sentence-transformers directory, into its architecture's class, its head (heads.py) and its
tokenizer, with what the file declares (declared.py).

`encoder_architecture(path)` tells, from the file's metadata alone, whether a path is an encoder
this package serves (and which); the server picks its engine by it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tokios.encoder import bert, gemma_embedding, nomic_bert
from tokios.encoder.declared import (CLS, MEAN, RANK, EmbeddingDeclaration, declaration_from_directory,
                                     declaration_from_gguf, sentence_transformers_modules)
from tokios.encoder.heads import ClassifierHead, EmbeddingHead
from tokios.errors import ModelLoadError, UnsupportedError

logger = logging.getLogger("tokios.engine")

@dataclass(frozen=True)
class EncoderArchitecture:
    name: str  # llama.cpp's architecture name
    module: ModuleType  # config_from_gguf, config_from_hf, hf_name_to_gguf, Model
    default_pooling: str  # when the file declares none (llama.cpp's default for the architecture)


ARCHITECTURES: dict[str, EncoderArchitecture] = {
    "bert": EncoderArchitecture("bert", bert, CLS),
    "nomic-bert": EncoderArchitecture("nomic-bert", nomic_bert, MEAN),
    "gemma-embedding": EncoderArchitecture("gemma-embedding", gemma_embedding, MEAN),
}
# Hugging Face config.json `architectures` -> (llama.cpp architecture, is a cross-encoder).
HF_ARCHITECTURES = {"BertModel": ("bert", False), "BertForSequenceClassification": ("bert", True),
                    "NomicBertModel": ("nomic-bert", False),
                    # A bidirectional one (use_bidirectional_attention); gemma_embedding refuses a causal one.
                    "Gemma3TextModel": ("gemma-embedding", False)}


def register_architecture(architecture: EncoderArchitecture, hf_names: dict[str, bool]) -> None:
    ARCHITECTURES[architecture.name] = architecture
    HF_ARCHITECTURES.update({hf_name: (architecture.name, is_cross_encoder) for hf_name, is_cross_encoder in hf_names.items()})


def _hf_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{directory}: no config.json")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def encoder_architecture(path: str) -> str | None:
    """The encoder architecture of a model file or directory, or None for a generative model."""
    if os.path.isdir(path):
        names = _hf_config(path).get("architectures") or []
        for name in names:
            if name in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[name][0]
        return None
    from tokios.gguf_file import read_gguf_metadata

    architecture = read_gguf_metadata(path).get("general.architecture")
    return architecture if architecture in ARCHITECTURES else None


@dataclass
class LoadedEncoder:
    architecture: EncoderArchitecture
    config: Any  # the architecture's config (hidden_size, max_positions, name, ...)
    model: Any  # forward(EncoderBatch) -> [num_tokens, hidden]
    head: EmbeddingHead | ClassifierHead
    declaration: EmbeddingDeclaration
    tokenizer: Any
    path: str
    load_seconds: float

    @property
    def is_rerank(self) -> bool:
        return self.declaration.is_rerank

    @property
    def max_input_tokens(self) -> int:
        """The longest input served: the declared training length, within the position table."""
        limit = self.config.max_positions
        declared = self.declaration.max_seq_length
        return min(limit, declared) if declared else limit

    @property
    def dimensions(self) -> int | None:
        """A vector's size (None for a cross-encoder)."""
        if self.is_rerank:
            return None
        return self.head.dimensions or self.config.hidden_size


def load_encoder(path: str, weight_format: str = "stored", device: torch.device | str = "cpu") -> LoadedEncoder:
    from tokios.tokenizer.tokenizer import tokenizer_for_loaded_model

    started = time.perf_counter()
    device = torch.device(device)
    name = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path):
        hf_config = _hf_config(path)
        hf_name = next((each for each in hf_config.get("architectures") or [] if each in HF_ARCHITECTURES), None)
        if hf_name is None:
            raise UnsupportedError(f"{path}: architectures {hf_config.get('architectures')} is not an encoder tokios "
                                   f"serves (supported: {', '.join(sorted(HF_ARCHITECTURES))})")
        architecture_name, is_cross_encoder = HF_ARCHITECTURES[hf_name]
        architecture = ARCHITECTURES[architecture_name]
        config = architecture.module.config_from_hf(hf_config, name)
        declaration = declaration_from_directory(path, default_pooling=architecture.default_pooling,
                                                 is_cross_encoder=is_cross_encoder)
        weights = _directory_weights(path, architecture, declaration)
        tokenizer_source: Any = path
    else:
        from tokios.gguf_file import GGUFFile
        from tokios.model.loader import read_gguf_tensors

        gguf = GGUFFile(path)
        architecture_name = gguf.metadata.get("general.architecture")
        if architecture_name not in ARCHITECTURES:
            raise UnsupportedError(f"{path}: architecture {architecture_name!r} is not an encoder tokios serves "
                                   f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        architecture = ARCHITECTURES[architecture_name]
        config = architecture.module.config_from_gguf(gguf.metadata, architecture_name,
                                                      gguf.metadata.get("general.name") or name)
        declaration = declaration_from_gguf(gguf.metadata, architecture_name, set(gguf.tensors),
                                            default_pooling=architecture.default_pooling)
        weights = read_gguf_tensors(gguf)
        tokenizer_source = gguf.metadata
    head = _make_head(declaration, weights, device, path)
    try:
        model = architecture.module.Model(config, weights, weight_format, device)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing weight {exc.args[0]}") from None
    if weights:
        raise UnsupportedError(f"{path}: tensors {sorted(weights)[:5]} are not part of {architecture.name} as tokios "
                               "implements it")
    tokenizer = tokenizer_for_loaded_model(tokenizer_source, path)
    return LoadedEncoder(architecture, config, model, head, declaration, tokenizer, path,
                         time.perf_counter() - started)


def _make_head(declaration: EmbeddingDeclaration, weights: dict, device: torch.device, path: str):
    from tokios.model.quant import as_dense

    if declaration.pooling != RANK:
        # BERT's pooler (dense + tanh on the first token) serves only its pretraining and
        # classification heads; a sentence embedding pools the hidden states themselves.
        weights.pop("cls.weight", None), weights.pop("cls.bias", None)
        return EmbeddingHead(declaration, weights, device)
    if "cls.output.weight" not in weights:
        raise ModelLoadError("a cross-encoder without its classifier (cls.output.weight)")
    if "cls.weight" not in weights:
        # llama.cpp's converter drops BERT's pooler; llama.cpp then classifies the [CLS] state
        # itself (llama-graph.cpp build_pooling), and so do we, to score the file as it does.
        logger.warning("%s: this cross-encoder has no pooler layer (llama.cpp's converter drops BERT's "
                       "pooler.dense): its scores are the classifier on the [CLS] hidden state, as llama.cpp "
                       "computes them, not transformers' classifier(tanh(pooler([CLS]))) on the original "
                       "model; serve the Hugging Face directory for those", path)

    def pair(stem: str):
        weight = weights.pop(f"{stem}.weight", None)
        bias = weights.pop(f"{stem}.bias", None)
        return None if weight is None else (as_dense(weight), None if bias is None else as_dense(bias))

    head = ClassifierHead(pair("cls"), pair("cls.output"), device)
    if head.num_labels != 1:
        raise UnsupportedError(f"{path}: a classifier of {head.num_labels} labels; reranking needs a cross-encoder "
                               "with one relevance logit")
    return head


def _directory_weights(directory: str, architecture: EncoderArchitecture, declaration: EmbeddingDeclaration) -> dict:
    """The checkpoint's tensors under llama.cpp's names, and the Dense modules' under theirs."""
    from safetensors.torch import load_file

    from tokios.model.loader import weights_from_hf

    weights = {}
    for name, tensor in weights_from_hf(directory).items():
        gguf_name = architecture.module.hf_name_to_gguf(name)
        if gguf_name is not None:
            weights[gguf_name] = tensor.float() if tensor.dtype != torch.bfloat16 else tensor
    dense_paths = [module.get("path", "") for module in sentence_transformers_modules(directory) or []
                   if module["type"].endswith("Dense")]
    for index, relative in enumerate(dense_paths):
        for name, tensor in load_file(os.path.join(directory, relative, "model.safetensors")).items():
            weights[f"dense.{index}.{name}"] = tensor.float()
    return weights


GENERATE, EMBEDDING, RERANK = "generate", "embedding", "rerank"


def decoder_declaration(path: str) -> EmbeddingDeclaration | None:
    """A generative architecture's file made into an embedding model (Qwen3-Embedding: last-token
    pooling, an instruction prompt before queries): the pooling its GGUF carries, or its
    sentence-transformers modules; None for a chat or base model."""
    from tokios.encoder.declared import LAST

    if os.path.isdir(path):
        if sentence_transformers_modules(path) is None:
            return None
        declaration = declaration_from_directory(path, default_pooling=LAST)
    else:
        from tokios.gguf_file import read_gguf_metadata

        metadata = read_gguf_metadata(path)
        architecture = metadata.get("general.architecture")
        if metadata.get(f"{architecture}.pooling_type") is None:
            return None
        declaration = declaration_from_gguf(metadata, architecture, set(), default_pooling=LAST)
    if declaration.is_rerank:
        raise UnsupportedError(f"{path}: a generative model scoring pairs by its yes/no logits (pooling rank, "
                               "Qwen3-Reranker) is not supported; rerank with a cross-encoder (BERT-family "
                               "sequence classification)")
    if declaration.pooling not in ("mean", LAST):
        raise UnsupportedError(f"{path}: {declaration.pooling} pooling of a generative model is not supported "
                               "(mean, last)")
    if declaration.dense:
        raise UnsupportedError(f"{path}: Dense layers after a generative model's pooling are not supported")
    return declaration


def model_kind(path: str) -> str:
    """GENERATE, EMBEDDING or RERANK, from the file's metadata (no weights read)."""
    architecture = encoder_architecture(path)
    if architecture is None:
        return EMBEDDING if decoder_declaration(path) is not None else GENERATE
    if os.path.isdir(path):
        names = _hf_config(path).get("architectures") or []
        return RERANK if any(HF_ARCHITECTURES.get(name, (None, False))[1] for name in names) else EMBEDDING
    from tokios.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    declaration = declaration_from_gguf(gguf.metadata, architecture, set(gguf.tensors),
                                        default_pooling=ARCHITECTURES[architecture].default_pooling)
    return RERANK if declaration.is_rerank else EMBEDDING
