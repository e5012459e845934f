"""SentencePiece-style vocabularies from GGUF metadata as a `tokenizers` BPE with byte fallback.

Owns build_sentencepiece_bpe(); tokenizer.py calls it for `tokenizer.ggml.model = llama` files and
for Gemma 4's `gemma4` (the same scheme on raw UTF-8, with its merges in the file and no space
prefix). A `llama` GGUF lists tokens, scores and token types but (usually) no merges, so the merges
are recovered from the vocabulary: every split of a token into two tokens is a merge, ranked by the
merged token's priority. That priority is the score for most SentencePiece models; for Gemma files
it is the token's position, because their scores do not follow the merge order (transformers' GGUF
loader makes the same choice, and ids must equal its ids). Spaces are the "▁" marker; pieces
missing from the vocabulary fall back to <0xNN> byte tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from tokios.errors import ModelLoadError

SPACE_MARKER = "\u2581"
# Architectures whose merge order is the file's token order rather than its scores.
_MERGE_ORDER_BY_POSITION = ("gemma", "gemma2", "gemma3")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def recover_merges(vocab: Mapping[str, int], priority: Mapping[str, float]) -> list[tuple[str, str]]:
    """All (left, right) with left + right in the vocabulary, best-first: by the merged token's
    priority (higher first), then the longer left piece, then the longer right piece."""
    ranked = []
    for token, token_priority in priority.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-token_priority, -cut, -(len(token) - cut), left, right))
    ranked.sort(key=lambda entry: entry[:3])
    return [(left, right) for *_, left, right in ranked]


def build_sentencepiece_bpe(metadata: Mapping[str, Any], architecture: str | None,
                            where: str) -> tokenizers.Tokenizer:
    """The backend tokenizer (no post-processor: BOS/EOS rules are the caller's)."""
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    by_position = architecture in _MERGE_ORDER_BY_POSITION
    if by_position:
        # Gemma stores tokens of two or more spaces as real spaces, but text is looked up with
        # the space marker; spell them so, or no merge can ever produce them.
        tokens = [SPACE_MARKER * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(f"a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token {where}")
        priority = dict(zip(tokens, scores))
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = recover_merges(vocab, priority)
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[int(unknown_id)] if unknown_id is not None and 0 <= int(unknown_id) < len(tokens) else None
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True,
                                                  byte_fallback=True))
    except Exception as exc:  # tokenizers raises plain Exception for inconsistent merges
        raise ModelLoadError(f"cannot build the SentencePiece tokenizer {where}: {exc}") from None
    # Unless the file says otherwise, llama.cpp prepends a space to `llama` vocabularies but not
    # to Gemma's nor to the `gemma4` model (a BPE whose merges run on the text as it is).
    adds_space_prefix = metadata.get(
        "tokenizer.ggml.add_space_prefix", not by_position and metadata["tokenizer.ggml.model"] == "llama"
    )
    steps = [normalizers.Replace(" ", SPACE_MARKER)]
    if adds_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE_MARKER))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(" "), behavior="merged_with_previous")
    decode_steps = [decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()]
    if adds_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_CONTROL])
    # Original spellings: a user-defined token is matched whole in the raw text (newline runs).
    original = metadata["tokenizer.ggml.tokens"]
    backend.add_tokens([AddedToken(original[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types)
                        if kind == TOKEN_TYPE_USER_DEFINED and original[i] in vocab])
    return backend
