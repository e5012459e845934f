"""Tiny models of the architectures whose weights no package ships, as users get them: built with
transformers' own config and model classes (seeded random weights), saved as a Hugging Face
directory with a real tokenizer (transformers' reading of one of llama.cpp's ggml-vocab-*.gguf
files), and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py from the pinned source
distribution (model_files.llama_cpp_sources(); scripts/setup unpacks it).

Owns `converted_model()`, which makes (once per test session and architecture) the directory, the
GGUF file and the transformers model that the parity tests compare the engine against, and
`TinyFamily`, which says what one architecture's tiny model is.

Random weights are scaled so that greedy decisions are not near-ties: with transformers' std 0.02
a Llama-shaped model picks the same token everywhere, so those configs set `initializer_range`
around 0.5 (logits spread over tens of units); Gemma scales its embedding by sqrt(hidden) and
collapses at 0.5, so it keeps 0.02 with random norm weights.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from tokios.model_files import llama_cpp_sources


@dataclass(frozen=True)
class TinyFamily:
    """One architecture's tiny model: `make_config(vocab_size)` returns its transformers config;
    `vocab` names the ggml-vocab-<vocab>.gguf whose tokenizer it carries; `random_biases` fills
    the attention biases (zero in transformers' initialisation) so that their layout is tested;
    `random_scales` names the endings of parameters and buffers that transformers initialises to
    ones or zeros (norm weights, layer scalars), drawn from [0.5, 1.5) instead so that a misplaced
    or wrongly stored one (Gemma's 1 + w) shows. `special_tokens` are added to the vocabulary
    (markers of a chat format whose own vocabulary no file here ships); `chat_template` names a
    template of llama.cpp's models/templates that the tokenizer carries."""

    name: str
    make_config: Callable[[int], object]
    vocab: str
    random_biases: bool = False
    random_scales: tuple[str, ...] = ()
    seed: int = 0
    extra_files: dict = field(default_factory=dict)  # file name -> text, written into the directory
    special_tokens: tuple[str, ...] = ()
    chat_template: str | None = None


# Vocabularies whose file AutoTokenizer cannot open: it first reads the file's model config, and
# transformers cannot parse gemma-4's (head_count_kv is an array per layer). The tokenizer class
# reads only the vocabulary.
_VOCAB_TO_TOKENIZER_CLASS = {"gemma-4": "GemmaTokenizerFast"}


@functools.lru_cache(maxsize=None)
def vocab_tokenizer(vocab: str):
    """transformers' tokenizer read from llama.cpp's ggml-vocab-<vocab>.gguf (10 s for a
    150k-token vocabulary)."""
    transformers = pytest.importorskip("transformers")
    tokenizer_class = getattr(transformers, _VOCAB_TO_TOKENIZER_CLASS.get(vocab, "AutoTokenizer"))
    return tokenizer_class.from_pretrained(str(llama_cpp_sources() / "models"), gguf_file=f"ggml-vocab-{vocab}.gguf")


def family_tokenizer(family: TinyFamily):
    """The tokenizer of the family's vocabulary, with its added special tokens and template."""
    if not family.special_tokens and family.chat_template is None:
        return vocab_tokenizer(family.vocab)
    return _extended_tokenizer(family.vocab, family.special_tokens, family.chat_template)


@functools.lru_cache(maxsize=None)
def _extended_tokenizer(vocab: str, special_tokens: tuple[str, ...], chat_template: str | None):
    import copy

    tokenizer = copy.deepcopy(vocab_tokenizer(vocab))  # the shared one stays as its file has it
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = (llama_cpp_sources() / "models" / "templates" / chat_template).read_text()
    return tokenizer


def build_hf_directory(family: TinyFamily, directory: Path):
    """Saves the family's seeded random model and its tokenizer into `directory`; returns the
    transformers model (float32, eval mode)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = family_tokenizer(family)
    config = family.make_config(len(tokenizer))
    torch.manual_seed(family.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if family.random_biases and name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if family.random_scales and name.endswith(family.random_scales):
                tensor.uniform_(0.5, 1.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    sentencepiece_model = sentencepiece_model_file(family.vocab)
    if sentencepiece_model is not None:
        (directory / "tokenizer.model").write_bytes(sentencepiece_model)
    for name, text in family.extra_files.items():
        (directory / name).write_text(text)
    return model


def sentencepiece_model_file(vocab: str) -> bytes | None:
    """The tokenizer.model a SentencePiece-vocabulary checkpoint ships beside tokenizer.json (the
    converter reads the pieces from it for such families, Phi-3's), made from llama.cpp's
    ggml-vocab-<vocab>.gguf: its pieces, scores and types as a SentencePiece ModelProto (BPE);
    None for a vocabulary of another kind. transformers saves no such file from a GGUF-read
    tokenizer. Encoded by hand (protobuf's wire format): the protobuf package is no dependency."""
    from tokios.gguf_file import read_gguf_metadata

    # Our own reader: gguf's GGUFReader takes 30 s over a 262k-token vocabulary.
    metadata = read_gguf_metadata(llama_cpp_sources() / "models" / f"ggml-vocab-{vocab}.gguf")
    if metadata["tokenizer.ggml.model"] != "llama":
        return None
    pieces = [piece.encode("utf-8") for piece in metadata["tokenizer.ggml.tokens"]]
    scores = [float(score) for score in metadata["tokenizer.ggml.scores"]]
    # GGUF and SentencePiece number the piece types alike (1 normal, 2 unknown, 3 control, 4 user
    # defined, 5 unused, 6 byte), but SentencePiece allows one unknown piece (id 0): the padding
    # pieces a GGUF marks unknown are unused ones there.
    types = [2 if index == 0 else (5 if kind == 2 else kind)
             for index, kind in enumerate(metadata["tokenizer.ggml.token_type"])]
    model = b"".join(_proto_field(1, _proto_field(1, piece) + _proto_field(2, struct.pack("<f", score), wire=5)
                                  + _proto_field(3, kind, wire=0))
                     for piece, score, kind in zip(pieces, scores, types))
    model += _proto_field(2, _proto_field(3, 2, wire=0) + _proto_field(35, 1, wire=0))  # trainer: BPE, byte fallback
    # normalizer: no charsmap, a dummy prefix, whitespace kept and escaped as U+2581
    model += _proto_field(3, _proto_field(1, b"identity") + _proto_field(3, 1, wire=0)
                          + _proto_field(4, 0, wire=0) + _proto_field(5, 1, wire=0))
    return model


def _proto_field(number: int, value, wire: int = 2) -> bytes:
    """One protobuf field: wire 0 a varint, 2 bytes with their length, 5 four bytes as given."""
    def varint(number: int) -> bytes:
        out = bytearray()
        while True:
            out.append(number & 0x7F | (0x80 if number > 0x7F else 0))
            number >>= 7
            if not number:
                return bytes(out)

    key = varint(number << 3 | wire)
    if wire == 0:
        return key + varint(value)
    return key + (varint(len(value)) + value if wire == 2 else value)


def convert_to_gguf(hf_directory: Path, gguf_path: Path, outtype: str = "f32", options: tuple[str, ...] = ()) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `hf_directory`, as a user runs it (the same call
    `tokios bench random-model` makes), with the script's own `options`."""
    from tokios.tools.bench.peers import convert_hf_directory

    return convert_hf_directory(hf_directory, gguf_path, outtype, options)


@dataclass
class ConvertedModel:
    family: TinyFamily
    hf_directory: Path
    gguf_path: Path
    reference: object  # the transformers model the directory was saved from


_converted: dict[str, ConvertedModel] = {}


def converted_model(family: TinyFamily, tmp_path_factory) -> ConvertedModel:
    """The family's tiny model, made once per test session."""
    if family.name not in _converted:
        directory = tmp_path_factory.mktemp(f"tiny-{family.name}")
        reference = build_hf_directory(family, directory / "hf")
        gguf_path = convert_to_gguf(directory / "hf", directory / f"{family.name}.f32.gguf")
        _converted[family.name] = ConvertedModel(family, directory / "hf", gguf_path, reference)
    return _converted[family.name]


def quantized_model(family: TinyFamily, tmp_path_factory) -> Path:
    """The family's tiny model requantized as llama.cpp's Q4_K_M chooses (blocks/requantize.py:
    rows too short for K-quants fall back to Q5_0 / Q8_0 as llama-quantize's do; a mixture of
    experts keeps its experts 3-D in their blocks, its router float32), made once per session."""
    from tokios.model.blocks.requantize import mostly_q4_k_m, requantize_gguf

    converted = converted_model(family, tmp_path_factory)
    path = converted.gguf_path.with_name(f"{family.name}.q4_k_m.gguf")
    if not path.exists():
        requantize_gguf(str(converted.gguf_path), str(path), mostly_q4_k_m)
    return path
