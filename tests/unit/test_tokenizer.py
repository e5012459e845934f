"""Tokenizer on the real SmolLM2 GGUF: round trips, special tokens, BOS/EOS rules, pre-tokenizer
choice, chat template, errors, Hugging Face directory loading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError, ModelLoadError, UnsupportedError
from tokios.gguf_file import read_gguf_metadata
from tokios.model_files import default_model_path
from tokios.tokenizer import Tokenizer, load_tokenizer
from tokios.tokenizer.byte_level import byte_to_char
from tokios.tokenizer.pretokenizers import PRE_TOKENIZATIONS, build_pre_tokenizer

MULTILINGUAL_SAMPLES = [
    "Hello, world!",
    "Zażółć gęślą jaźń",
    "日本語のテキストです。",
    "我爱自然语言处理",
    "emoji 😀👍🏽🇵🇱 family 👨‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # square\n",
    "   leading and trailing   \n\n\n",
    "numbers 1234567 and 3.14159",
]


@pytest.fixture(scope="module")
def metadata():
    return read_gguf_metadata(default_model_path())


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return Tokenizer.from_gguf_metadata(metadata)


def _bytes_missing_from_vocabulary() -> frozenset[int]:
    vocab = Tokenizer.from_gguf_file(default_model_path()).backend.get_vocab()
    return frozenset(byte for byte, char in byte_to_char().items() if char not in vocab)


# SmolLM2's vocabulary lacks 21 of the 256 byte pieces (6 control characters and lead bytes of
# unassigned planes 4+), so text using them cannot survive any tokenizer of this model; every
# other character must round-trip.
_MISSING_BYTES = _bytes_missing_from_vocabulary()
_REPRESENTABLE_CHARS = st.characters(codec="utf-8").filter(
    lambda char: not _MISSING_BYTES.intersection(char.encode("utf-8"))
)


@settings(max_examples=200, deadline=None)
@given(text=st.text(_REPRESENTABLE_CHARS, max_size=60))
def test_decode_of_encode_is_identity(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_missing_byte_pieces_are_few_and_never_printable():
    assert len(_MISSING_BYTES) == 21
    assert all(byte < 0x20 or byte >= 0xC0 for byte in _MISSING_BYTES)


@pytest.mark.parametrize("text", MULTILINGUAL_SAMPLES)
def test_multilingual_round_trip(tokenizer, text):
    token_ids = tokenizer.encode(text)
    assert tokenizer.decode(token_ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in token_ids)


def test_vocabulary_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.all_special_ids == list(range(17))
    # <|im_end|> ends a chat turn; <|endoftext|> ends a document: both stop generation.
    assert tokenizer.eos_token_ids == frozenset({2, 0})


def test_smollm2_adds_no_bos(tokenizer):
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id


def test_add_bos_and_eos_flags_are_honoured(metadata):
    flagged = Tokenizer.from_gguf_metadata(
        {**metadata, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    plain = flagged.encode("hi", add_special_tokens=False)
    assert flagged.encode("hi") == [1, *plain, 2]


def test_control_tokens_are_matched_whole_and_skippable(tokenizer):
    token_ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert token_ids[0] == 1 and token_ids[-1] == 2
    assert tokenizer.convert_ids_to_tokens(token_ids)[:3] == ["<|im_start|>", "user", "Ċ"]
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_split_one_by_one_for_smollm(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("x 2024"))
    assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("smollm", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("gpt-2", "ab 123", ["ab", "Ġ123"]),
        ("llama-bpe", "ab 12345", ["ab", "Ġ", "123", "45"]),
        ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("default", "a+b 1234", ["a", "+", "b", "Ġ", "123", "4"]),
    ],
)
def test_pre_tokenizer_splits_follow_llama_cpp(name, text, words):
    pre_tokenizer = build_pre_tokenizer(name)
    assert [word for word, _ in pre_tokenizer.pre_tokenize_str(text)] == words


def test_every_named_pre_tokenizer_builds():
    for name in PRE_TOKENIZATIONS:
        assert build_pre_tokenizer(name).pre_tokenize_str("It's 2024!")


def test_unknown_pre_tokenizer_is_a_load_error_naming_it(metadata):
    with pytest.raises(ModelLoadError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "no-such-pre"})


def test_unknown_tokenizer_model_is_unsupported_naming_it(metadata):
    with pytest.raises(UnsupportedError, match="'t5'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "t5"})


def test_wordpiece_without_its_special_tokens_is_a_load_error_naming_the_keys(metadata):
    special_keys = {f"tokenizer.ggml.{name}_token_id" for name in ("unknown", "cls", "bos", "seperator", "eos")}
    bert = {key: value for key, value in metadata.items() if key not in special_keys}
    bert["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.unknown_token_id"):
        Tokenizer.from_gguf_metadata(bert)
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.cls_token_id, tokenizer.ggml.bos_token_id"):
        Tokenizer.from_gguf_metadata({**bert, "tokenizer.ggml.unknown_token_id": 0})


def test_sentencepiece_model_without_scores_is_a_load_error(metadata):
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"})


def test_missing_merges_is_a_load_error(metadata):
    broken = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.merges"}
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(broken)


def test_out_of_range_eos_is_a_load_error(metadata):
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.eos_token_id": 10**6})


def test_decode_rejects_ids_outside_vocabulary(tokenizer):
    with pytest.raises(InvalidRequestError, match="49152") as excinfo:
        tokenizer.decode([5, 49152])
    assert excinfo.value.param == "token_ids"


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(InvalidRequestError):
        tokenizer.encode(["not", "text"])


def test_chat_template_renders_smollm2_format(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    without_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert without_prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert without_prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_flattens_text_parts(tokenizer):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}]) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "one\ntwo"}]
    )


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_bad_messages_are_invalid_request_on_messages(tokenizer, messages):
    with pytest.raises(InvalidRequestError) as excinfo:
        tokenizer.apply_chat_template(messages)
    assert excinfo.value.param == "messages"


def test_template_raise_exception_becomes_invalid_request(metadata):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sandbox_blocks_attribute_escapes(metadata):
    template = "{{ messages.__class__.__mro__ }}"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    with pytest.raises(InvalidRequestError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_helpers_tojson_tools_and_special_tokens(metadata):
    template = "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ greeting }}|{{ strftime_now('%Y') | length }}"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    tools = [{"type": "function", "function": {"name": "zażółć", "parameters": {}}}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, greeting="hej")
    assert rendered == '<|im_start|>|<|im_end|>|' + json.dumps(tools, ensure_ascii=False) + "|hej|4"


def test_model_without_template_rejects_chat(metadata):
    bare = {key: value for key, value in metadata.items() if key != "tokenizer.chat_template"}
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_gguf_metadata(bare).apply_chat_template([{"role": "user", "content": "x"}])


def test_fingerprint_is_stable_and_tracks_the_template(metadata, tokenizer):
    again = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.chat_template_fingerprint == again.chat_template_fingerprint
    assert len(tokenizer.chat_template_fingerprint) == 16
    changed = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": "{{ messages }}"})
    assert changed.chat_template_fingerprint != tokenizer.chat_template_fingerprint


def test_load_tokenizer_dispatches_gguf_and_hf_dir(tmp_path, tokenizer):
    assert load_tokenizer(default_model_path()).encode("Hi there") == tokenizer.encode("Hi there")
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tokenizer.chat_template,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "add_bos_token": False,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    from_dir = load_tokenizer(tmp_path)
    for text in MULTILINGUAL_SAMPLES:
        assert from_dir.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (1, 2)
    assert from_dir.eos_token_ids == frozenset({0, 2, 5})


def test_hf_dir_jinja_file_overrides_config_template(tmp_path, tokenizer):
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    (tmp_path / "chat_template.jinja").write_text("jinja {{ messages[0]['content'] }}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "jinja x"


def test_hf_dir_without_tokenizer_json_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_tokenizer(tmp_path / "absent.gguf")


def test_template_extra_variables_including_documents(metadata):
    template = "{{ documents | length }} {{ enable_thinking }} {{ messages | length }}"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], documents=[{"title": "t", "text": "d"}], enable_thinking=False
    )
    assert rendered == "1 False 1"


def test_plain_text_vocabulary_entries_are_respelled_in_the_byte_alphabet(metadata):
    # Some converters store "Ġthe" as " the"; both spellings must tokenize the same.
    tokens = list(metadata["tokenizer.ggml.tokens"])
    the_id = tokens.index("Ġthe")
    tokens[the_id] = " the"
    respelled = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.tokens": tokens})
    assert respelled.encode("in the end") == Tokenizer.from_gguf_metadata(metadata).encode("in the end")
    assert the_id in respelled.encode("in the end")


def test_malformed_merge_is_a_load_error_naming_it(metadata):
    merges = list(metadata["tokenizer.ggml.merges"])
    merges[10] = "abc"
    with pytest.raises(ModelLoadError, match="'abc'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.merges": merges})
