"""Embedding and rerank serving steps, shared by the dialects that ask for vectors or scores
(OpenAI's /v1/embeddings, Ollama's /api/embed and /api/embeddings, the Cohere/Jina /v1/rerank).

Owns what a loaded model offers here (`EmbeddingService`): its kind (a chat model, an embedding
model, a cross-encoder), what its file declares (encoder/declared.py: pooling, normalisation,
prompts, the longest input, Matryoshka sizes), and the steps: inputs -> token ids (the declared
prompt before a text, truncation or a 400 past the longest input) -> the engine (the encoder
engine's packed forwards, or pooling requests on a generative engine) -> vectors cut to the
asked dimensions, or relevance scores. A chat model's vectors are its final hidden states
pooled (`--pooling`): they serve similarity search roughly; its model card says so.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request

from tokios.encoder.declared import EmbeddingDeclaration
from tokios.encoder.heads import truncate_dimensions
from tokios.encoder.loader import EMBEDDING, GENERATE, RERANK, decoder_declaration
from tokios.errors import InvalidRequestError, TokiosError
from tokios.server.streams import run_watching_disconnect

# Inputs one embedding request may carry (OpenAI's limit is 2,048).
MAX_INPUTS = 2048
# Documents one rerank request may carry.
MAX_DOCUMENTS = 1000
_SCORE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "identity": lambda logits: logits}


@dataclass
class EmbeddingService:
    kind: str  # GENERATE, EMBEDDING or RERANK
    model_name: str
    declaration: EmbeddingDeclaration | None  # None: a chat model's pooled hidden states
    dimensions: int | None  # a vector's size (None for a cross-encoder)
    max_input_tokens: int
    pooling: str  # the chat model's --pooling, or the declared one

    @classmethod
    def of(cls, engine: Any, model_name: str, chat_pooling: str) -> EmbeddingService:
        if getattr(engine, "is_encoder", False):
            encoder = engine.encoder
            return cls(RERANK if encoder.is_rerank else EMBEDDING, model_name, encoder.declaration,
                       encoder.dimensions, encoder.max_input_tokens, encoder.declaration.pooling)
        declaration = decoder_declaration(engine.core.model_path)
        limit = engine.max_model_len - 1  # a pooling request still schedules one sampled token
        if declaration is None:
            return cls(GENERATE, model_name, None, engine.model_config.hidden_size, limit, chat_pooling)
        if declaration.max_seq_length:
            limit = min(limit, declaration.max_seq_length)
        return cls(EMBEDDING, model_name, declaration, engine.model_config.hidden_size, limit, declaration.pooling)

    # ---- what the model is -------------------------------------------------------------------
    def card(self) -> dict[str, Any]:
        """What /v1/models says about the model's vectors."""
        if self.kind == RERANK:
            return {"kind": RERANK, "max_input_tokens": self.max_input_tokens}
        embedding: dict[str, Any] = {"dimensions": self.dimensions, "pooling": self.pooling,
                                     "max_input_tokens": self.max_input_tokens}
        if self.declaration is None:
            embedding["source"] = "pooled_hidden_states"
            embedding["note"] = ("a chat model's final hidden states, pooled: not a trained sentence embedding; "
                                 "serve an embedding model for retrieval")
        else:
            embedding["source"] = "trained"
            embedding["normalized"] = self.declaration.normalize
            if self.declaration.matryoshka_dimensions:
                embedding["matryoshka_dimensions"] = list(self.declaration.matryoshka_dimensions)
            if self.declaration.prompts:
                embedding["prompts"] = sorted(self.declaration.prompts)
        return {"kind": self.kind, "embedding": embedding}

    def require(self, kind: str) -> None:
        require_kind(self.kind, kind, self.model_name)

    # ---- inputs ---------------------------------------------------------------------------------
    def prompt_text(self, prompt_name: str | None) -> str:
        """The declared prompt put before each text input (`prompt_name`, else the default one)."""
        prompts = self.declaration.prompts if self.declaration is not None else {}
        if prompt_name is None:
            default = self.declaration.default_prompt_name if self.declaration is not None else None
            return prompts.get(default, "") if default else ""
        if prompt_name not in prompts:
            offered = ", ".join(sorted(prompts)) or "none"
            raise InvalidRequestError(f"prompt_name: model {self.model_name!r} declares no prompt {prompt_name!r} "
                                      f"(its prompts: {offered})", param="prompt_name")
        return prompts[prompt_name]

    def fit(self, ids: list[int], index: int, truncate: bool, param: str) -> list[int]:
        if not ids:
            raise InvalidRequestError(f"{param}[{index}] is empty", param=param)
        if len(ids) <= self.max_input_tokens:
            return ids
        if not truncate:
            raise InvalidRequestError(
                f"{param}[{index}] has {len(ids)} tokens, over this model's limit of {self.max_input_tokens} "
                f"(send truncate: true to embed its first {self.max_input_tokens} tokens)", param=param)
        return ids[:self.max_input_tokens]

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimensions:
            return
        if dimensions > self.dimensions:
            raise InvalidRequestError(f"dimensions: this model's embeddings have {self.dimensions} dimensions, "
                                      f"got {dimensions}", param="dimensions")
        sizes = self.declaration.matryoshka_dimensions if self.declaration is not None else ()
        if not sizes:
            raise InvalidRequestError(f"dimensions: model {self.model_name!r} declares no shorter (Matryoshka) sizes; "
                                      f"its embeddings have {self.dimensions} dimensions, got {dimensions}",
                                      param="dimensions")
        if dimensions not in sizes:
            raise InvalidRequestError(f"dimensions must be one of the sizes model {self.model_name!r} was trained for "
                                      f"({', '.join(map(str, sorted(sizes, reverse=True)))}), got {dimensions}",
                                      param="dimensions")


def require_kind(model_kind: str, needed: str, model_name: str) -> None:
    """A 400 naming the model's kind when a model of `model_kind` cannot serve what a route
    `needed` (checked before the model loads: the kind is read from its file)."""
    if model_kind == needed:
        return
    if needed == RERANK:
        raise InvalidRequestError(
            f"model {model_name!r} is {_KIND_WORDS[model_kind]}; reranking needs a cross-encoder (a BERT-family "
            "sequence-classification model, served with --model PATH=NAME)", param="model")
    if needed == EMBEDDING and model_kind == GENERATE:
        return  # a chat model's pooled hidden states (its model card says what they are)
    raise InvalidRequestError(f"model {model_name!r} is {_KIND_WORDS[model_kind]}: it serves "
                              f"{_KIND_ROUTES[model_kind]}, not {_NEED_WORDS[needed]}", param="model")


_NEED_WORDS = {GENERATE: "text generation", EMBEDDING: "embeddings", RERANK: "reranking"}
_KIND_WORDS = {GENERATE: "a generative (chat) model", EMBEDDING: "an embedding model", RERANK: "a cross-encoder"}
_KIND_ROUTES = {EMBEDDING: "/v1/embeddings and /api/embed", RERANK: "/v1/rerank"}


async def token_inputs(serving: Any, inputs: list[str | list[int]], *, prompt_name: str | None, truncate: bool,
                       param: str = "input") -> list[list[int]]:
    """Texts (after the declared prompt) and token id lists -> token ids the model takes. In a
    worker thread: 2,048 texts of 8-64 tokens took 171 ms to tokenize (all-MiniLM-L6-v2), which
    the event loop's other streams should not wait for."""
    return await asyncio.to_thread(_token_inputs, serving, inputs, prompt_name, truncate, param)


def _token_inputs(serving: Any, inputs: list[str | list[int]], prompt_name: str | None, truncate: bool,
                  param: str) -> list[list[int]]:
    service: EmbeddingService = serving.embedding
    if not inputs:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"{param} has {len(inputs)} items; at most {MAX_INPUTS} per request", param=param)
    prompt = service.prompt_text(prompt_name)
    ids_list = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{param}[{index}] is an empty string", param=param)
            ids = serving.tokenizer.encode(prompt + item, add_special_tokens=True)
            if truncate and len(ids) > service.max_input_tokens:
                ids = _cut_text_keeping_special_tokens(serving.tokenizer, prompt + item, ids,
                                                       service.max_input_tokens)
        else:
            serving.check_token_ids(item, param)
            ids = list(item)
        ids_list.append(service.fit(ids, index, truncate, param))
    return ids_list


def _cut_text_keeping_special_tokens(tokenizer: Any, text: str, ids: list[int], limit: int) -> list[int]:
    """A text's first tokens within `limit`, with the special tokens the tokenizer puts around it
    ([CLS] ... [SEP]) still in place, as sentence-transformers' and Hugging Face's truncation
    leave them: the model was trained on inputs that end in [SEP]."""
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    num_text_tokens = len(text_ids)
    for start in range(len(ids) - num_text_tokens + 1):
        if ids[start:start + num_text_tokens] == text_ids:
            head, tail = ids[:start], ids[start + num_text_tokens:]
            if len(head) + len(tail) < limit:
                return head + text_ids[:limit - len(head) - len(tail)] + tail
            break
    return ids[:limit]


async def embed(serving: Any, http_request: Request, ids_list: list[list[int]], lease: Any, *,
                dimensions: int | None = None, param: str = "input") -> list[list[float]]:
    """One vector per input, normalised as the model declares, cut to `dimensions`."""
    service: EmbeddingService = serving.embedding
    service.require(EMBEDDING)
    service.check_dimensions(dimensions)
    engine = serving.engine
    if getattr(engine, "is_encoder", False):
        with serving.admission.admit():
            vectors = await run_watching_disconnect(http_request, engine.encode(ids_list))
        normalize = service.declaration.normalize
    else:
        vectors = await _pooled_hidden_states(serving, http_request, ids_list, lease, service.pooling, param)
        normalize = service.declaration is None or service.declaration.normalize
        if normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
    if dimensions is not None and dimensions != vectors.shape[1]:
        vectors = truncate_dimensions(vectors, dimensions, normalize)
    return vectors.tolist()


async def _pooled_hidden_states(serving: Any, http_request: Request, ids_list: list[list[int]], lease: Any,
                                pooling: str, param: str) -> torch.Tensor:
    from tokios.server.serving import make_sampling_params

    kwargs = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "pooling": pooling}
    job = serving.new_job(f"embd-{uuid.uuid4().hex}", ids_list, make_sampling_params(kwargs), kwargs, lease)
    outputs = await serving.finish(http_request, job)
    rows = []
    for output in outputs:
        if output is None or output.embedding is None:
            raise TokiosError("the engine returned no embedding for an input")
        rows.append(torch.tensor(output.embedding, dtype=torch.float32))
    return torch.stack(rows)


async def rerank(serving: Any, http_request: Request, query: str, documents: list[str], *,
                 truncate: bool = True) -> tuple[list[float], int]:
    """(relevance score of each document for the query, tokens read). The pair is the
    cross-encoder's "[CLS] query [SEP] document [SEP]", the document's tokens of type 1
    (Tokenizer.encode_pair); a pair past the model's limit loses the end of its document
    (truncate) or is a 400."""
    service: EmbeddingService = serving.embedding
    service.require(RERANK)
    if not query:
        raise InvalidRequestError("query must not be empty", param="query")
    if not documents:
        raise InvalidRequestError("documents must not be empty", param="documents")
    if len(documents) > MAX_DOCUMENTS:
        raise InvalidRequestError(f"documents has {len(documents)} items; at most {MAX_DOCUMENTS} per request",
                                  param="documents")
    pairs, types = await asyncio.to_thread(_pair_inputs, serving, query, documents, truncate)
    with serving.admission.admit():
        logits = await run_watching_disconnect(http_request, serving.engine.encode(pairs, types))
    # The one label's logit through the declared activation, as sentence-transformers'
    # CrossEncoder.predict gives it (a loaded cross-encoder has one label: encoder/loader.py).
    scores = _SCORE_ACTIVATIONS[service.declaration.score_activation](logits[:, 0]).tolist()
    return [float(score) if math.isfinite(score) else 0.0 for score in scores], sum(len(pair) for pair in pairs)


def _pair_inputs(serving: Any, query: str, documents: list[str],
                 truncate: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Each (query, document) pair's token ids and token types, fitted to the model's limit."""
    service: EmbeddingService = serving.embedding
    pairs, types = [], []
    for index, document in enumerate(documents):
        ids, kinds = serving.tokenizer.encode_pair(query, document)  # [CLS] query [SEP] document [SEP]
        if len(ids) > service.max_input_tokens:
            num_query_tokens = kinds.index(1) if 1 in kinds else len(kinds)
            if num_query_tokens + 2 > service.max_input_tokens:
                raise InvalidRequestError(f"query has {num_query_tokens} tokens with [CLS] and [SEP]: no room for a "
                                          f"document within this model's limit of {service.max_input_tokens}",
                                          param="query")
            if not truncate:
                raise InvalidRequestError(
                    f"documents[{index}] with the query makes {len(ids)} tokens, over this model's limit of "
                    f"{service.max_input_tokens} (truncation is false)", param="documents")
            # The document loses its end; its closing [SEP] stays.
            ids = ids[:service.max_input_tokens - 1] + ids[-1:]
            kinds = kinds[:service.max_input_tokens - 1] + kinds[-1:]
        pairs.append(ids)
        types.append(kinds)
    return pairs, types
