"""The Tokenizer: text <-> token ids, special tokens and the chat template of one model.

Owns building a Hugging Face `tokenizers` pipeline from GGUF metadata (byte-level BPE with the
pre-tokenizer llama.cpp would use, SentencePiece-style BPE with byte fallback from
sentencepiece.py for `llama` and `gemma4` vocabularies, or BERT's WordPiece from wordpiece.py for
`bert` ones; control and user-defined tokens, BOS/EOS rules) or from a Hugging Face directory,
and `load_tokenizer(path)` which picks between them; `model_chat_template(path)` reads only a
model's chat template, and `no_chat_template_error()` is the refusal when it has none. Talks to tokios/gguf_file.py (reads the
file), hf_dir.py (reads a Hugging Face directory), bos_eos.py, pretokenizers.py,
chat_template.py and byte_level.py, none of which imports this module. Used by the engine front
end, the server (chat template, prompt tokens, text pairs for a reranker) and the detokenizer /
stop matcher.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models

from tokios.errors import InvalidRequestError, ModelLoadError, TokiosError, UnsupportedError
from tokios.gguf_file import GGUF_MAGIC, read_gguf_metadata
from tokios.tokenizer.bos_eos import bos_eos_processor
from tokios.tokenizer.byte_level import build_token_bytes_table, is_byte_level_spelling, spell_bytes
from tokios.tokenizer.chat_template import ChatTemplate
from tokios.tokenizer.hf_dir import read_hf_dir, read_hf_dir_chat_template
from tokios.tokenizer.pretokenizers import pre_tokenization
from tokios.tokenizer.sentencepiece import build_sentencepiece_bpe
from tokios.tokenizer.wordpiece import build_wordpiece

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_ADDED_TOKEN_TYPES = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)

# Tokens that end a turn in the chat formats we know. Like llama.cpp's end-of-generation set, any
# of these that the vocabulary has as a special token stops generation, not only the file's EOS
# (SmolLM2's EOS is <|im_end|>, but a base-model habit of writing <|endoftext|> must stop too).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<|return|>",  # gpt-oss's harmony: the final answer's end
    "<|call|>",  # and a tool call's
)
# In harmony `<|end|>` ends one message and the next follows (the reasoning, then the answer):
# a vocabulary with harmony's two ends does not stop at it (as llama.cpp's end-of-generation set).
HARMONY_ENDS = ("<|return|>", "<|call|>")


class Tokenizer:
    """One model's tokenizer; immutable after construction and safe to share between threads."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        source: str = "",
    ):
        self.backend = backend
        self.source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._compiled_chat_template = ChatTemplate(chat_template) if chat_template else None
        added_tokens = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, token in added_tokens.items() if token.special)
        special_contents = {added_tokens[i].content: i for i in self.all_special_ids}
        end_of_turn_ids = {special_contents[text] for text in END_OF_TURN_TOKENS if text in special_contents}
        if all(text in special_contents for text in HARMONY_ENDS):
            end_of_turn_ids.discard(special_contents.get("<|end|>"))
        eos_ids = end_of_turn_ids | set(extra_eos_token_ids)
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self._id_to_special_text = {
            "bos_token": bos_token_id,
            "eos_token": eos_token_id,
            "unk_token": unk_token_id,
            "pad_token": pad_token_id,
        }
        self._token_bytes_tables: dict[bool, tuple[bytes, ...] | None] = {}
        self.shown_special_ids: frozenset[int] = frozenset()

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, source: str = "") -> Tokenizer:
        """Build the tokenizer a GGUF file describes from its metadata (see read_gguf_metadata)."""
        tokenizer_model = metadata.get("tokenizer.ggml.model")
        if tokenizer_model is None:
            raise ModelLoadError(f"GGUF metadata has no tokenizer.ggml.model {_where(source)}")
        if tokenizer_model not in ("gpt2", "llama", "gemma4", "bert"):
            raise UnsupportedError(
                f"tokenizer model {tokenizer_model!r} is not supported (supported: 'gpt2', byte-level BPE; "
                f"'llama' and 'gemma4', SentencePiece-style BPE with byte fallback; 'bert', WordPiece) "
                f"{_where(source)}"
            )
        tokens = _require(metadata, "tokenizer.ggml.tokens", source)
        token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelLoadError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries but tokenizer.ggml.tokens has "
                f"{len(tokens)} {_where(source)}"
            )
        if tokenizer_model == "bert":
            backend = build_wordpiece(metadata, _where(source))
        elif tokenizer_model in ("llama", "gemma4"):
            backend = build_sentencepiece_bpe(metadata, metadata.get("general.architecture"), _where(source))
        else:
            merges = _require(metadata, "tokenizer.ggml.merges", source)
            words = pre_tokenization(metadata.get("tokenizer.ggml.pre"))
            backend = _build_byte_level_bpe(
                tokens, token_types, merges, source, ignore_merges=words.keeps_whole_words
            )
            backend.pre_tokenizer = words.pre_tokenizer()
            backend.decoder = decoders.ByteLevel()

        def token_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise ModelLoadError(f"{key} = {value} is outside the vocabulary [0, {len(tokens)}) {_where(source)}")
            return int(value)

        bos_token_id = token_id("tokenizer.ggml.bos_token_id")
        eos_token_id = token_id("tokenizer.ggml.eos_token_id")
        if tokenizer_model != "bert":  # WordPiece brings its own [CLS] ... [SEP]
            backend.post_processor = bos_eos_processor(
                backend,
                # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise,
                # and to a `gemma4` one whatever its file says.
                bos_token_id
                if tokenizer_model == "gemma4"
                or metadata.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama")
                else None,
                eos_token_id if metadata.get("tokenizer.ggml.add_eos_token", False) else None,
                _where(source),
            )
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            unk_token_id=token_id("tokenizer.ggml.unknown_token_id"),
            pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
            chat_template=metadata.get(CHAT_TEMPLATE_KEY),
            source=source,
        )

    @classmethod
    def from_gguf_file(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_metadata(read_gguf_metadata(path), source=str(path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config.json (chat template, special tokens) from a directory."""
        backend, arguments = read_hf_dir(Path(path))
        return cls(backend, **arguments)

    # ---- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; BOS/EOS are added only when the model asks for them."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}", param="prompt")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(
        self, text_a: str, text_b: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[int]]:
        """Token ids and token type ids (0 for `text_a`'s part, 1 for `text_b`'s) of a text pair, as
        a cross-encoder reads it: "[CLS] a [SEP] b [SEP]" for BERT."""
        for text, param in ((text_a, "query"), (text_b, "documents")):
            if not isinstance(text, str):
                raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}", param=param)
        processor = self.backend.post_processor
        if add_special_tokens and (processor is None or processor.num_special_tokens_to_add(True) == 0):
            # Without a separator the model cannot tell where the second text starts.
            raise UnsupportedError(
                f"the tokenizer of {self.source or 'this model'} has no template for text pairs (a "
                "cross-encoder's, such as BERT's [CLS] a [SEP] b [SEP])"
            )
        encoding = self.backend.encode(text_a, text_b, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(self._checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary spelling of each id (byte-level pieces look like "Ġworld")."""
        id_to_token = self.backend.id_to_token
        return [id_to_token(token_id) for token_id in self._checked_ids(ids)]

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            checked = [operator.index(token_id) for token_id in ids]
        except TypeError:
            raise InvalidRequestError("token ids must be a list of integers", param="token_ids") from None
        if checked and (min(checked) < 0 or max(checked) >= self.vocab_size):
            bad_id = next(i for i in checked if not 0 <= i < self.vocab_size)
            raise InvalidRequestError(
                f"token id {bad_id} is outside the vocabulary [0, {self.vocab_size})", param="token_ids"
            )
        return checked

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    @property
    def is_byte_level(self) -> bool:
        """True when decoding is "concatenate each token's bytes, then UTF-8" (GPT-2 style)."""
        return isinstance(self.backend.decoder, decoders.ByteLevel)

    def token_bytes_table(self, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
        """token id -> the bytes decode() produces for it, or None for a non-byte-level decoder.

        Built once per setting (about 50k entries); the incremental detokenizer indexes it.
        """
        if skip_special_tokens not in self._token_bytes_tables:
            table = None
            if self.is_byte_level:
                id_to_token = self.backend.id_to_token
                skipped_ids = sorted(self.skipped_special_ids) if skip_special_tokens else ()
                table = build_token_bytes_table([id_to_token(i) for i in range(self.vocab_size)], skipped_ids)
            self._token_bytes_tables[skip_special_tokens] = table
        return self._token_bytes_tables[skip_special_tokens]

    @cached_property
    def byte_fallback_token_to_byte(self) -> dict[int, int]:
        """token id -> byte for SentencePiece byte-fallback tokens spelled "<0xNN>" (empty if none)."""
        return {
            token_id: int(token[3:5], 16)
            for token, token_id in self.backend.get_vocab(with_added_tokens=False).items()
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">") and _is_hex(token[3:5])
        }

    # ---- chat -----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's own template, exactly as transformers does."""
        if self._compiled_chat_template is None:
            raise no_chat_template_error()
        special_tokens = {
            name: self.backend.id_to_token(token_id)
            for name, token_id in self._id_to_special_text.items()
            if token_id is not None
        }
        return self._compiled_chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=special_tokens,
            **kwargs,
        )

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else tool_calls/prompt.py does)."""
        return self._compiled_chat_template is not None and self._compiled_chat_template.takes_tools

    @property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads beyond its own (enable_thinking, reasoning_effort...)."""
        return self._compiled_chat_template.variables if self._compiled_chat_template is not None else frozenset()

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token `text` is, if it is one (an added or special token)."""
        token_id = self.backend.token_to_id(text)
        return token_id if token_id is not None and self.backend.id_to_token(token_id) == text else None

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """The special tokens decoding drops when told to skip them."""
        return frozenset(self.all_special_ids) - self.shown_special_ids

    def show_special_tokens(self, token_ids: Iterable[int]) -> None:
        """Keep these special tokens in decoded text even when special tokens are skipped: the
        markers a reasoning or tool-call parser reads (the server sets them once, at load)."""
        self.shown_special_ids = self.shown_special_ids | frozenset(token_ids)
        self._token_bytes_tables = {}  # a copy (with_chat_template) must keep its own tables

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """The same tokenizer with another chat template (--chat-template)."""
        other = copy.copy(self)
        other.chat_template = chat_template
        other._compiled_chat_template = ChatTemplate(chat_template)
        other.__dict__.pop("chat_template_fingerprint", None)
        return other

    @cached_property
    def chat_template_fingerprint(self) -> str:
        """16 hex chars that change whenever the template or the vocabulary changes.

        Used as the prefix-cache salt, so cached blocks are never shared between tokenizations.
        """
        digest = hashlib.sha256()
        digest.update((self.chat_template or "").encode("utf-8"))
        digest.update(b"\0")
        vocab = self.backend.get_vocab(with_added_tokens=True)
        tokens_by_id = sorted(vocab, key=vocab.__getitem__)
        digest.update("\n".join(tokens_by_id).encode("utf-8", errors="surrogatepass"))
        digest.update(f"\0{self.bos_token_id}\0{self.eos_token_id}".encode())
        return digest.hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


CHAT_TEMPLATE_KEY = "tokenizer.chat_template"  # GGUF metadata


def no_chat_template_error() -> InvalidRequestError:
    """The refusal of a chat with a model that has no chat template: from the loaded tokenizer,
    and before loading, where the file shows it has none (model_chat_template)."""
    return InvalidRequestError(
        "this model has no chat template (its file carries none: a pretrained model); start tokios "
        "with --chat-template FILE or a built-in name (chatml, gemma), or send a plain completion "
        "prompt (/v1/completions, tokios generate --raw) instead",
        param="messages",
    )


def model_chat_template(path: str | Path) -> str | None:
    """The chat template a model's file (GGUF metadata) or directory (tokenizer_config.json,
    chat_template.jinja) carries, None when it has none, read without building the tokenizer or
    reading weights: a chat with a model that has none is refused before the model loads."""
    path = Path(path)
    if path.is_dir():
        template = read_hf_dir_chat_template(path)
    else:
        template = read_gguf_metadata(path, frozenset({CHAT_TEMPLATE_KEY})).get(CHAT_TEMPLATE_KEY)
    # An empty template is none, as the Tokenizer takes it.
    return template if isinstance(template, str) and template else None


def has_chat_template(path: str | Path) -> bool:
    """Whether the model at `path` carries a chat template (model_chat_template). A file that
    cannot be read counts as having one: its load then reports what is wrong with it, as it
    would for any other model."""
    try:
        return model_chat_template(path) is not None
    except (TokiosError, OSError, ValueError):  # ValueError: a template that is not UTF-8
        return True


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A .gguf file -> from its metadata; a directory -> Hugging Face tokenizer files."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.suffix.lower() == ".gguf" or _starts_with_gguf_magic(path):
        return Tokenizer.from_gguf_file(path)
    raise ModelLoadError(f"expected a .gguf file or a directory with tokenizer.json: {path}")


# Tokenizers built from GGUF files, by the file's identity (path, size, modification time): a
# model loaded again in one process (an evicted model coming back, a draft on the target's file,
# a second engine) reuses the tokenizer instead of rebuilding it (2 s for Gemma's 262k-piece
# vocabulary, whose merges are recovered from the pieces). Tokenizers are immutable.
_GGUF_TOKENIZER_CACHE_SIZE = 4
_gguf_tokenizers: OrderedDict[tuple, Tokenizer] = OrderedDict()
_gguf_tokenizers_lock = threading.Lock()


def tokenizer_for_loaded_model(source: Mapping[str, Any] | str | Path, path: str) -> Tokenizer:
    """The tokenizer of a model the loader read: `source` is the GGUF metadata it already parsed
    (no second read of the file), or the Hugging Face directory. `path` names the model in errors."""
    if not isinstance(source, Mapping):
        return Tokenizer.from_hf_dir(source)
    try:
        status = os.stat(path)
    except OSError:
        return Tokenizer.from_gguf_metadata(source, source=path)
    key = (os.path.realpath(path), status.st_size, status.st_mtime_ns)
    with _gguf_tokenizers_lock:
        if key in _gguf_tokenizers:
            _gguf_tokenizers.move_to_end(key)
            return _gguf_tokenizers[key]
    tokenizer = Tokenizer.from_gguf_metadata(source, source=path)
    with _gguf_tokenizers_lock:
        _gguf_tokenizers[key] = tokenizer
        while len(_gguf_tokenizers) > _GGUF_TOKENIZER_CACHE_SIZE:
            _gguf_tokenizers.popitem(last=False)
    return tokenizer


def _starts_with_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as file:
        return file.read(4) == GGUF_MAGIC


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdefABCDEF" for char in text)


def _where(source: str) -> str:
    return f"(in {source})" if source else "(in GGUF metadata)"


def _require(metadata: Mapping[str, Any], key: str, source: str) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata has no {key} {_where(source)}")
    return value


def _build_byte_level_bpe(
    tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], source: str, *, ignore_merges: bool
) -> tokenizers.Tokenizer:
    # Control and user-defined tokens keep their raw text: they are matched whole in the input
    # (as llama.cpp does), and the byte-level decoder passes such text through unchanged.
    added_ids = [i for i, token_type in enumerate(token_types) if token_type in _ADDED_TOKEN_TYPES]
    control_tokens = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in added_ids
        if token_types[i] == TOKEN_TYPE_CONTROL
    ]
    user_defined_tokens = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in added_ids
        if token_types[i] == TOKEN_TYPE_USER_DEFINED
    ]
    # One regex pass over all tokens finds the rare file that stores plain text instead of the byte
    # alphabet; only then is each token checked (BPE needs the byte spelling).
    if is_byte_level_spelling("".join(tokens)):
        spelled_tokens: Sequence[str] = tokens
    else:
        added_id_set = set(added_ids)
        spelled_tokens = [
            token if i in added_id_set or is_byte_level_spelling(token) else spell_bytes(token)
            for i, token in enumerate(tokens)
        ]
    vocab = dict(zip(spelled_tokens, range(len(spelled_tokens))))
    # Merges are "left right"; split them all in one C call instead of 49k Python calls.
    if set(map(str.count, merges, itertools.repeat(" "))) - {1}:
        malformed = next(merge for merge in merges if merge.count(" ") != 1)
        raise ModelLoadError(f"malformed entry {malformed!r} in tokenizer.ggml.merges {_where(source)}")
    parts_iterator = iter(" ".join(merges).split(" "))
    merge_pairs = list(zip(parts_iterator, parts_iterator))
    try:
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, ignore_merges=ignore_merges)
        )
    except Exception as exc:  # tokenizers raises plain Exception for inconsistent merges
        raise ModelLoadError(f"cannot build the BPE tokenizer {_where(source)}: {exc}") from None
    backend.add_special_tokens(control_tokens)
    backend.add_tokens(user_defined_tokens)
    return backend

