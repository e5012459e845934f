"""Our tokenizer against llama.cpp's own test vectors for its ggml-vocab-*.gguf vocabularies.

llama.cpp ships vocabulary-only GGUF files beside `<file>.inp` and `<file>.out`
(model_files.llama_cpp_sources() / "models", from the pinned llama-cpp-python sdist). The .inp
holds the test texts, separated by the line "__ggml_vocab_test__" (each text ends before the
"\\n" that precedes the marker; the marker after the last text ends the file); the .out holds one
line of space-separated token ids per text. tests/test-tokenizer-0.cpp reads them so and
tokenizes with common_tokenize(ctx, text, add_special=false, parse_special=false); the ids were
written by the original Hugging Face tokenizer (convert_hf_to_gguf_update.py). Here every
vocabulary with vectors is loaded with Tokenizer.from_gguf_file and must give the same ids on
every text, without BOS/EOS (add_special_tokens=False). parse_special=false is met because no
text contains a control token's spelling, which is checked. llama.cpp's test only prints the
detokenized ids; we also require that decoding gives the text back, which holds on every text
except for the WordPiece (`bert`) vocabulary: BERT's decoder gives the normalised text
(lower-cased, accents stripped, punctuation spaced), which test_wordpiece.py compares with
transformers' decoding.

Vocabulary files not tested here:
- ggml-vocab-qwen35.gguf: Qwen3.5's pre-tokenizer belongs with the hybrid models (a later issue);
- ggml-vocab-aquila.gguf, -baichuan.gguf, -gpt-neox.gguf, -nomic-bert-moe.gguf: llama.cpp
  ships no test vectors for them.

Each vocabulary takes 0.1-1.7 s to load (Gemma 4's 262k tokens and 515k merges the most); the
texts themselves tokenize in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokios.model_files import llama_cpp_sources
from tokios.tokenizer import Tokenizer

TEST_SEPARATOR = "\n__ggml_vocab_test__\n"
# Vocabularies whose decoding gives the normalised text, not the text (see above).
NORMALISING_VOCABULARIES = ("bert-bge",)

VOCABULARIES = (
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "refact",
    "starcoder",
)
NOT_TESTED = {
    "qwen35": "the hybrid models' issue",
}


def vocabulary_path(name: str) -> Path:
    return llama_cpp_sources() / "models" / f"ggml-vocab-{name}.gguf"


def read_test_vectors(vocabulary: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs, read as llama.cpp's test-tokenizer-0 reads them."""
    raw = vocabulary.with_name(vocabulary.name + ".inp").read_bytes().decode("utf-8")
    texts = raw.split(TEST_SEPARATOR)
    if texts[-1] == "":  # the marker after the last text
        texts.pop()
    id_lines = vocabulary.with_name(vocabulary.name + ".out").read_bytes().decode("utf-8").split("\n")
    if id_lines[-1] == "":
        id_lines.pop()
    assert len(texts) == len(id_lines), f"{vocabulary.name}: {len(texts)} texts but {len(id_lines)} id lines"
    return [(text, [int(token) for token in line.split()]) for text, line in zip(texts, id_lines)]


def test_every_vocabulary_with_vectors_is_tested_or_named_as_not():
    with_vectors = {
        path.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
        for path in (llama_cpp_sources() / "models").glob("ggml-vocab-*.gguf.inp")
    }
    assert with_vectors == set(VOCABULARIES) | set(NOT_TESTED)


@pytest.mark.parametrize("name", VOCABULARIES)
def test_ids_equal_llama_cpp_test_vectors(name):
    path = vocabulary_path(name)
    tokenizer = Tokenizer.from_gguf_file(path)
    vectors = read_test_vectors(path)
    assert len(vectors) >= 40

    control_texts = [tokenizer.convert_ids_to_tokens([i])[0] for i in tokenizer.all_special_ids]
    assert not [text for text, _ in vectors if any(control in text for control in control_texts)]

    mismatches = [
        (text, expected, ids)
        for text, expected in vectors
        if (ids := tokenizer.encode(text, add_special_tokens=False)) != expected
    ]
    assert not mismatches, "\n".join(
        f"{text!r}: llama.cpp {expected}, ours {ids}" for text, expected, ids in mismatches
    )
    if name not in NORMALISING_VOCABULARIES:
        assert [text for text, expected in vectors if tokenizer.decode(expected) != text] == []
