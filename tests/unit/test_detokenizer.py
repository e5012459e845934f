"""IncrementalDetokenizer: deltas + flush == decode(all), never a broken character mid-stream.

Runs on the real SmolLM2 byte-level tokenizer and on a small SentencePiece-style tokenizer
(byte fallback <0xNN>, "▁" space markers, Strip decoder) built here with `tokenizers`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from tokios.model_files import default_model_path
from tokios.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Zażółć gęślą jaźń 🇵🇱",
    "日本語のテキスト、そして絵文字 😀👍🏽",
    "我爱自然语言处理。",
    "family 👨‍👩‍👧 and 🧑🏾‍🚀 in space",
    "mixed: naïve café 😀 — «quotes» ∑∫",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf_file(default_model_path())


def _stream(tokenizer, token_ids, chunk_sizes, skip_special_tokens):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detokenizer.add_tokens(token_ids[start : start + size]))
        start += size
    deltas.append(detokenizer.add_tokens(token_ids[start:]))
    return deltas, detokenizer.flush()


def _token_id_pool(tokenizer):
    """Ids whose bytes are not valid UTF-8 alone (pieces of multi-byte characters), plus specials."""
    table = tokenizer.token_bytes_table(skip_special_tokens=False)
    partial_ids = []
    for token_id, data in enumerate(table):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            partial_ids.append(token_id)
    return partial_ids, tokenizer.all_special_ids


@pytest.fixture(scope="module")
def token_id_pool(tokenizer):
    return _token_id_pool(tokenizer)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_ids_concatenate_to_decode(tokenizer, token_id_pool, data, skip_special_tokens):
    partial_ids, special_ids = token_id_pool
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    token_ids = data.draw(
        st.lists(st.one_of(any_id, st.sampled_from(partial_ids), st.sampled_from(special_ids)), max_size=40)
    )
    chunk_sizes = data.draw(st.lists(st.integers(0, 4), max_size=20))
    deltas, tail = _stream(tokenizer, token_ids, chunk_sizes, skip_special_tokens)
    assert "".join(deltas) + tail == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_shows_a_broken_character(tokenizer, text):
    token_ids = tokenizer.encode(text)
    # These texts are meant to exercise split characters: make sure some token is a byte piece.
    assert any("\ufffd" in tokenizer.decode([i]) for i in token_ids)
    deltas, tail = _stream(tokenizer, token_ids, [1] * len(token_ids), skip_special_tokens=True)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text and tail == ""


def test_incomplete_trailing_character_is_flushed_as_decode_does(tokenizer):
    emoji_ids = tokenizer.encode("ok 😀")
    cut = emoji_ids[:-1]  # drops the last byte of the emoji
    detokenizer = IncrementalDetokenizer(tokenizer)
    shown = detokenizer.add_tokens(cut)
    assert shown == "ok "  # the space rides in the same token as the emoji's first bytes
    assert shown + detokenizer.flush() == tokenizer.decode(cut) == "ok \ufffd"


def test_special_tokens_skipped_or_kept(tokenizer):
    token_ids = tokenizer.encode("<|im_start|>assistant\nHi!<|im_end|>")
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(kept.add_tokens([i]) for i in token_ids) == "<|im_start|>assistant\nHi!<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(skipped.add_tokens([i]) for i in token_ids) == "assistant\nHi!"


def test_long_stream_holds_nothing_between_whole_characters(tokenizer):
    token_ids = tokenizer.encode("word " * 2000)
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token_id in token_ids:
        assert detokenizer.add_tokens([token_id]) == tokenizer.decode([token_id])
    assert detokenizer.flush() == ""


# ---- SentencePiece-style tokenizer: the windowed path ------------------------------------------


def _sentencepiece_style_tokenizer() -> Tokenizer:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'0123456789")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + ["▁"] + letters
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("▁", "a"), ("▁a", "n"), ("▁an", "d")]
    pieces += ["".join(pair) for pair in merges]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2, chat_template=None, source="sentencepiece-style")


@pytest.fixture(scope="module")
def sp_tokenizer():
    return _sentencepiece_style_tokenizer()


def test_sentencepiece_style_fixture_uses_byte_fallback_and_space_markers(sp_tokenizer):
    assert not sp_tokenizer.is_byte_level
    pieces = sp_tokenizer.convert_ids_to_tokens(sp_tokenizer.encode("the ż"))
    assert pieces == ["▁the", "▁", "<0xC5>", "<0xBC>"]
    assert sp_tokenizer.decode(sp_tokenizer.encode("the ż")) == "the ż"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.sampled_from(list("the and in ") + ["ż", "日", "😀", "é", "!"]), max_size=30),
    chunk_sizes=st.lists(st.integers(0, 3), max_size=20),
    bos=st.booleans(),
)
def test_windowed_path_concatenates_to_decode(sp_tokenizer, text, chunk_sizes, bos):
    token_ids = ([1] if bos else []) + sp_tokenizer.encode(text)
    for skip_special_tokens in (True, False):
        deltas, tail = _stream(sp_tokenizer, token_ids, chunk_sizes, skip_special_tokens)
        expected = sp_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + tail == expected
        assert all("\ufffd" not in delta for delta in deltas)


def test_windowed_path_keeps_a_bounded_window(sp_tokenizer):
    detokenizer = IncrementalDetokenizer(sp_tokenizer)
    token_ids = sp_tokenizer.encode("the and " * 500)
    pieces = [detokenizer.add_tokens([i]) for i in token_ids]
    assert "".join(pieces) + detokenizer.flush() == sp_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(detokenizer._stream._ids) <= 2
