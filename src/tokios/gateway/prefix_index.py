"""Which backend holds which prompt prefix: the gateway's side of prefix-aware routing.

Backends report the chained block hashes their prefix cache stores and drops (each engine's block
pool logs them, kv_cache/events.py; the connector's `--report-cache-events` polls them and sends
CACHE_EVENTS frames over the link it already holds). `PrefixIndex` keeps, per backend and model,
the set of hashes held now. For a request, `PromptHasher` turns the body into the token ids the
backend will compute (the same chat template and tokenizer, loaded by the gateway from the same
model file: `tokios gateway --tokenizer NAME=PATH`) and hashes its full blocks with the engine's
own `chain_hash` from each backend's root hash; a chained hash names its whole prefix, so the
blocks a backend would reuse are the leading run of those hashes it holds. The router
(gateway/router.py) decides with that count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokios.errors import InvalidRequestError
from tokios.kv_cache.manager import chain_hash

logger = logging.getLogger("tokios.gateway")


@dataclass(frozen=True)
class HashScheme:
    """How a backend hashes a model's prompts: its block size and the root of its chain (the
    engine salts it with the model file, weight format and template, so backends running another
    file never match)."""

    block_size: int
    root_hash: int


def _hash_list(payload: dict[str, Any], field: str) -> list[int]:
    values = payload.get(field, [])
    if not isinstance(values, list):
        raise InvalidRequestError(f"cache events: {field} must be a list of hex hashes", param=field)
    try:
        return [int(value, 16) for value in values]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"cache events: {field} holds something that is not a hex hash", param=field) from exc


class PrefixIndex:
    def __init__(self) -> None:
        self._key_to_hashes: dict[tuple[str, str], set[int]] = {}  # (backend id, model) -> hashes held
        self._key_to_scheme: dict[tuple[str, str], HashScheme] = {}

    def apply(self, backend_id: str, payload: dict[str, Any]) -> None:
        """One CACHE_EVENTS frame: a reset replaces the model's set, otherwise a change to it."""
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("cache events: model must be a non-empty string", param="model")
        stored, removed = _hash_list(payload, "stored"), _hash_list(payload, "removed")
        key = (backend_id, model)
        block_size, root_hash = payload.get("block_size"), payload.get("root_hash")
        if payload.get("reset"):
            self._key_to_hashes[key] = set()
            if isinstance(block_size, int) and block_size > 0 and isinstance(root_hash, str) and root_hash:
                self._key_to_scheme[key] = HashScheme(block_size, _hash_list({"root_hash": [root_hash]},
                                                                             "root_hash")[0])
            else:  # the model is not loaded there: it holds nothing
                self._key_to_scheme.pop(key, None)
        hashes = self._key_to_hashes.setdefault(key, set())
        hashes.update(stored)
        hashes.difference_update(removed)

    def drop(self, backend_id: str) -> None:
        """Forget a backend that left (it sends a whole snapshot when it comes back)."""
        for key in [key for key in self._key_to_hashes if key[0] == backend_id]:
            del self._key_to_hashes[key]
            self._key_to_scheme.pop(key, None)

    def backend_ids(self) -> list[str]:
        return sorted({backend_id for backend_id, _ in self._key_to_hashes})

    def scheme(self, backend_id: str, model: str) -> HashScheme | None:
        return self._key_to_scheme.get((backend_id, model))

    def num_blocks(self, backend_id: str) -> int:
        return sum(len(hashes) for (owner, _), hashes in self._key_to_hashes.items() if owner == backend_id)

    def num_matched_blocks(self, backend_id: str, model: str, block_hashes: list[int]) -> int:
        """How many of the prompt's leading blocks the backend holds (the blocks it would reuse)."""
        held = self._key_to_hashes.get((backend_id, model))
        if not held:
            return 0
        num_matched = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            num_matched += 1
        return num_matched


def block_hashes(token_ids: list[int], scheme: HashScheme) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the backend's KV manager computes them."""
    hashes: list[int] = []
    parent = scheme.root_hash
    for start in range(0, len(token_ids) - scheme.block_size + 1, scheme.block_size):
        parent = chain_hash(parent, token_ids[start:start + scheme.block_size])
        hashes.append(parent)
    return hashes


class PrefixQuery:
    """One request's prompt against the index: the router asks how many tokens each backend holds."""

    def __init__(self, index: PrefixIndex, model: str, token_ids: list[int]):
        self.index = index
        self.model = model
        self.token_ids = token_ids
        self._scheme_to_hashes: dict[HashScheme, list[int]] = {}

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    def num_matched_tokens(self, backend_id: str) -> int:
        scheme = self.index.scheme(backend_id, self.model)
        if scheme is None:
            return 0
        hashes = self._scheme_to_hashes.get(scheme)
        if hashes is None:  # backends of one model share a scheme: hash the prompt once
            hashes = self._scheme_to_hashes[scheme] = block_hashes(self.token_ids, scheme)
        return self.index.num_matched_blocks(backend_id, self.model, hashes) * scheme.block_size


# The most prompt text hashed for routing: encoding runs in a worker thread but holds the GIL, so
# a huge prompt must not stall the gateway's streams (64 Ki characters: about 16k tokens, 40 ms).
# A longer prompt is cut; its hashed prefix still finds the backend holding its beginning.
MAX_HASHED_CHARS = 64 * 1024
# Tokens dropped from the end of a cut text: the cut may split a word that whole text tokenizes
# differently, and a wrong last block would end the match early.
_CUT_MARGIN_TOKENS = 64


class PromptHasher:
    """The leading prompt token ids of OpenAI chat and completions bodies, per model whose tokenizer
    the gateway was given. Anything it cannot turn into the backend's exact ids gives None, and the
    request is routed by load alone."""

    def __init__(self, model_to_tokenizer_path: dict[str, str]):
        from tokios.tokenizer.tokenizer import load_tokenizer

        self._model_to_tokenizer = {}
        for model, path in model_to_tokenizer_path.items():
            self._model_to_tokenizer[model] = load_tokenizer(path)
            logger.info("prefix-aware routing: tokenizer of %s from %s", model, path)

    def has_model(self, model: str) -> bool:
        return model in self._model_to_tokenizer

    def prompt_token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None:
        tokenizer = self._model_to_tokenizer.get(payload.get("model"))
        if tokenizer is None:
            return None
        try:
            if path == "/v1/chat/completions":
                from tokios.server.generation import ChatTurn
                from tokios.server.dialects.openai.protocol import ChatCompletionRequest
                from tokios.tool_calls import ToolSet

                body = ChatCompletionRequest.model_validate(payload)
                tools = ToolSet.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
                turn = ChatTurn(body.messages_as_dicts(), {}, tools=tools,
                                add_generation_prompt=body.add_generation_prompt)
                return _leading_ids(tokenizer, *turn.prompt_text(tokenizer))
            if path == "/v1/completions":
                prompt = payload.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    return _leading_ids(tokenizer, prompt, True)
                # Ids the backend would refuse (it answers the client why) give no hint.
                if (isinstance(prompt, list) and prompt
                        and all(type(token) is int and 0 <= token < tokenizer.vocab_size for token in prompt)):
                    return list(prompt[:MAX_HASHED_CHARS // 4])
        except Exception as exc:  # a body the backend will refuse: it says why, the router only loses a hint
            logger.debug("no prompt hashes for a %s body: %s", path, exc)
        return None


def _leading_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= MAX_HASHED_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text[:MAX_HASHED_CHARS], add_special_tokens=add_special_tokens)[:-_CUT_MARGIN_TOKENS]
