"""WordPiece (BERT) vocabularies from GGUF metadata as a `tokenizers` pipeline.

Owns build_wordpiece(); tokenizer.py calls it for `tokenizer.ggml.model = bert` files.
llama.cpp's converter stores a BERT vocabulary in "phantom space" spelling: a word-start piece
`tok` as "\u2581tok", a continuation `##tok` as "tok", control tokens ([CLS], [SEP]...) as they
are. The pipeline maps that back to BERT's own spelling and runs BERT's steps: BertNormalizer,
BertPreTokenizer, greedy longest-match WordPiece ("##" continuations, a word over 100 characters
becomes [UNK], as BERT's default), "[CLS] a [SEP]" and "[CLS] a [SEP] b [SEP]" (token types 0 and
1) around the text when special tokens are asked for, and BERT's decoder (which joins
continuations and tidies the spaces before punctuation, so decoded text is the normalised text).

Lower-casing and accent stripping follow what the file declares, with llama.cpp's reading of it:
`tokenizer.ggml.normalizer.lowercase` (written from tokenizer.json's BertNormalizer; absent
means true, llama.cpp's default, which is right for files converted before the key existed: the
bge vocabulary is uncased) and `tokenizer.ggml.normalizer.strip_accents` (absent means "as
lowercase", BERT's own rule). Control characters are dropped and CJK ideographs split into
single-character words always, as both BERT and llama.cpp do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from tokios.errors import ModelLoadError

PHANTOM_SPACE = "\u2581"
CONTINUATION_PREFIX = "##"
# BERT's limit (transformers' BertTokenizer and tokenizers' WordPiece default); GGUF does not
# carry it, and llama.cpp's own tokenizer has none: a longer word is [UNK] for BERT, pieces there.
MAX_INPUT_CHARS_PER_WORD = 100
TOKEN_TYPE_CONTROL = 3


def bert_spelling(token: str, token_type: int) -> str:
    """The vocabulary entry BERT wrote for a token that llama.cpp's converter spelled `token`."""
    if token_type == TOKEN_TYPE_CONTROL:
        return token
    if token.startswith(PHANTOM_SPACE):
        return token[len(PHANTOM_SPACE):]
    # Older converters wrote BERT's "[unusedN]" pieces without the phantom space: they read as
    # continuations here, which no text reaches ("[" is a word alone) and which decode glued to
    # the word before, as llama.cpp prints them.
    return CONTINUATION_PREFIX + token


def build_wordpiece(metadata: Mapping[str, Any], where: str) -> tokenizers.Tokenizer:
    """The backend tokenizer, with its [CLS]/[SEP] post-processor."""
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled = [bert_spelling(token, token_type) for token, token_type in zip(tokens, token_types)]
    vocab = {token: token_id for token_id, token in enumerate(spelled)}
    if len(vocab) != len(spelled):
        # The dict kept each spelling's last id: the first copy of a repeated one is not it.
        duplicate = next(token for token_id, token in enumerate(spelled) if vocab[token] != token_id)
        raise ModelLoadError(f"the WordPiece vocabulary holds {duplicate!r} twice {where}")

    def special_token(keys: tuple[str, ...], role: str) -> tuple[str, int]:
        for key in keys:
            value = metadata.get(key)
            if value is not None:
                if not 0 <= int(value) < len(tokens):
                    raise ModelLoadError(f"{key} = {value} is outside the vocabulary [0, {len(tokens)}) {where}")
                return spelled[int(value)], int(value)
        raise ModelLoadError(f"a WordPiece vocabulary needs its {role} token: none of {', '.join(keys)} {where}")

    unknown, _ = special_token(("tokenizer.ggml.unknown_token_id",), "unknown")
    # Older converters wrote cls_token_id; newer ones write [CLS] as BOS and [SEP] as EOS too.
    cls = special_token(("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id"), "[CLS]")
    sep = special_token(("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id"), "[SEP]")

    backend = tokenizers.Tokenizer(models.WordPiece(
        vocab, unk_token=unknown, continuing_subword_prefix=CONTINUATION_PREFIX,
        max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD,
    ))
    lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # llama.cpp wraps every WordPiece text in [CLS] ... [SEP] whatever add_bos/add_eos say, as BERT.
    backend.post_processor = processors.BertProcessing(sep, cls)
    backend.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX, cleanup=True)
    backend.add_special_tokens([AddedToken(spelled[i], special=True, normalized=False)
                                for i, token_type in enumerate(token_types) if token_type == TOKEN_TYPE_CONTROL])
    return backend
