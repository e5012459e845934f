"""BERT's WordPiece tokenizer against transformers on all-MiniLM-L6-v2, from its directory and
from the GGUF llama.cpp's converter makes of it.

The directory's tokenizer.json is read by Tokenizer.from_hf_dir; the GGUF's phantom-space
vocabulary is rebuilt by tokenizer/wordpiece.py. Both must give transformers' AutoTokenizer's ids
on the same directory, with and without [CLS]/[SEP], for text pairs (ids and token types), and
decode as it does. llama.cpp's own vectors for the bge vocabulary are in
test_llama_cpp_vocabularies.py; here its decoding is checked against transformers on MiniLM's
tokenizer, which has the same vocabulary.
"""

from __future__ import annotations

import pytest

from test_llama_cpp_vocabularies import read_test_vectors, vocabulary_path
from tokios.errors import UnsupportedError
from tokios.tokenizer import Tokenizer

TEXTS = (
    "",
    "Hello World",
    "HeLLo WoRLD, MiXeD CaSe!",
    "Héllo, café naïve Ångström — résumé Äpfel Cửa Việt",
    "我想在apple工作1314151天～ 日本語のテキスト",
    "한국어 텍스트",
    "Punctuation: (a) [b] {c} <d> 'e' \"f\" ... !!! ??? $%^&*#@ ~`|\\/",
    "a" * 100,  # the longest word WordPiece splits
    "b" * 101 + " ok",  # one character more: [UNK]
    "supercalifragilistic" * 6,
    "this is 🦙.cpp 🚀 😶\u200d🌫️ ✅",
    " \t\n  spaced\u00a0out\u3000text \x00\x07 \ufffd end",
    "[CLS] literal [SEP] and [MASK] tokens",
    "unaffable tokenization of rerankers: it's, don't, y'all",
    "Numbers 3.14159 1,000,000 2nd 42nd",
    "a sentence of more than the 128 tokens MiniLM's tokenizer.json truncates to " * 12,
)
PAIRS = (
    ("what is the capital of France?", "Paris is the capital of France."),
    ("", "an empty query"),
    ("Héllo", ""),
    ("c" * 120, "日本"),
    ("🦙", "MiXeD CaSe"),
)


@pytest.fixture(scope="module")
def transformers_tokenizer(minilm_directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(minilm_directory))


@pytest.fixture(scope="module", params=("directory", "gguf"))
def tokenizer(request, minilm_directory):
    if request.param == "directory":
        return Tokenizer.from_hf_dir(minilm_directory)
    return Tokenizer.from_gguf_file(request.getfixturevalue("minilm_gguf"))


@pytest.mark.parametrize("add_special_tokens", (True, False))
def test_ids_equal_transformers(tokenizer, transformers_tokenizer, add_special_tokens):
    mismatches = [
        (text, expected, ids)
        for text in TEXTS
        if (ids := tokenizer.encode(text, add_special_tokens=add_special_tokens))
        != (expected := transformers_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    ]
    assert not mismatches, "\n".join(
        f"{text!r}: transformers {expected}, ours {ids}" for text, expected, ids in mismatches
    )


def test_pairs_equal_transformers(tokenizer, transformers_tokenizer):
    # Batched, as a cross-encoder calls it: called with one pair, transformers takes an empty
    # second text for no second text and leaves out its [SEP].
    for text_a, text_b in PAIRS:
        expected = transformers_tokenizer([text_a], [text_b])
        assert tokenizer.encode_pair(text_a, text_b) == (expected["input_ids"][0], expected["token_type_ids"][0])
        bare = transformers_tokenizer([text_a], [text_b], add_special_tokens=False)
        assert tokenizer.encode_pair(text_a, text_b, add_special_tokens=False) == (
            bare["input_ids"][0], bare["token_type_ids"][0]
        )


@pytest.mark.parametrize("skip_special_tokens", (True, False))
def test_decode_equals_transformers(tokenizer, transformers_tokenizer, skip_special_tokens):
    for text in TEXTS:
        ids = transformers_tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == transformers_tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), text


def test_bge_vocabulary_decodes_as_bert(transformers_tokenizer):
    """The bge file predates llama.cpp's normaliser keys and spells its tokens as older converters
    did; its vocabulary is MiniLM's, so its decoding must be transformers' on MiniLM's tokenizer."""
    path = vocabulary_path("bert-bge")
    ours = Tokenizer.from_gguf_file(path)
    for text, ids in read_test_vectors(path):
        assert ours.decode(ids) == transformers_tokenizer.decode(ids), text


def test_a_pair_needs_a_pair_template():
    gpt2 = Tokenizer.from_gguf_file(vocabulary_path("gpt-2"))
    with pytest.raises(UnsupportedError, match="no template for text pairs"):
        gpt2.encode_pair("query", "document")
