"""SentencePiece-style GGUF vocabularies (tokenizer/sentencepiece.py) on a toy vocabulary: merges
recovered by score or by position, byte fallback for what the vocabulary lacks, the space marker,
BOS as the file says, Gemma 4's `gemma4` model (merges from the file, no space prefix, BOS always),
and streaming decode of byte pieces. Parity with transformers on the real Gemma 3 file is
tests/model/test_gemma3.py's job; Gemma 4's vocabulary against llama.cpp's vectors is
tests/model/test_llama_cpp_vocabularies.py's."""

from __future__ import annotations

from tokios.tokenizer import Tokenizer
from tokios.tokenizer.detokenizer import IncrementalDetokenizer
from tokios.tokenizer.sentencepiece import recover_merges

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def toy_metadata(architecture: str, tokens: list[str], scores: list[float], **extra) -> dict:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    all_tokens = specials + BYTE_TOKENS + tokens
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": all_tokens,
        "tokenizer.ggml.scores": [0.0] * (len(specials) + 256) + scores,
        "tokenizer.ggml.token_type": [3] * len(specials) + [6] * 256 + [1] * len(tokens),
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        **extra,
    }


WORDS = ["a", "b", "c", "\u2581", "ab", "bc", "abc", "\u2581a", "\u2581abc"]


def test_merges_rank_by_priority_then_longer_left_piece():
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    merges = recover_merges(vocab, {"ab": -3, "bc": -4, "abc": -5})
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_position_order_for_gemma_and_score_order_otherwise():
    # No "abc": "abc" is either ab + c or a + bc. "ab" is listed first, "bc" scores higher.
    words, scores = ["a", "b", "c", "ab", "bc"], [0.0, 0.0, 0.0, -5.0, -1.0]
    by_position = Tokenizer.from_gguf_metadata(toy_metadata("gemma3", words, scores))
    by_score = Tokenizer.from_gguf_metadata(toy_metadata("llama", words, scores,
                                                         **{"tokenizer.ggml.add_space_prefix": False}))
    spell = lambda tokenizer: tokenizer.convert_ids_to_tokens(tokenizer.encode("abc", add_special_tokens=False))
    assert spell(by_position) == ["ab", "c"]
    assert spell(by_score) == ["a", "bc"]


def test_space_prefix_when_the_file_asks_for_it():
    tokenizer = Tokenizer.from_gguf_metadata(toy_metadata("llama", WORDS, [0.0] * len(WORDS)))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("abc", add_special_tokens=False)) == ["\u2581abc"]
    assert tokenizer.decode(tokenizer.encode("abc", add_special_tokens=False)) == "abc"


def test_bos_is_added_as_the_file_says_and_by_default():
    metadata = toy_metadata("gemma3", WORDS, [0.0] * len(WORDS))
    assert Tokenizer.from_gguf_metadata(metadata).encode("a")[0] == 2
    no_bos = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert 2 not in no_bos.encode("a")


def test_gemma4_model_merges_as_listed_without_space_prefix_and_always_adds_bos():
    metadata = toy_metadata("gemma4", ["a", "b", "\u2581", "ab", "\u2581b"], [0.0] * 5,
                            **{"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.add_bos_token": False,
                               "tokenizer.ggml.merges": ["a b", "\u2581 b"]})
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("ab b")) == ["<bos>", "ab", "\u2581b"]
    assert tokenizer.decode(tokenizer.encode("ab b", add_special_tokens=False)) == "ab b"


def test_missing_characters_fall_back_to_bytes_and_decode_back():
    tokenizer = Tokenizer.from_gguf_metadata(toy_metadata("gemma3", WORDS, [0.0] * len(WORDS)))
    text = "a Ω😀 abc"
    ids = tokenizer.encode(text, add_special_tokens=False)
    byte_ids = [i for i in ids if 4 <= i < 4 + 256]
    assert len(byte_ids) == len("Ω😀".encode())
    assert tokenizer.decode(ids) == text


def test_streaming_decode_never_splits_a_byte_fallback_character():
    tokenizer = Tokenizer.from_gguf_metadata(toy_metadata("gemma3", WORDS, [0.0] * len(WORDS)))
    text = "abc😀a Ω"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
