"""Tiny models of the architectures whose weights no package ships, as users get them: built with
transformers' own config and model classes (seeded random weights), saved as a Hugging Face
directory with a real tokenizer (transformers' reading of one of llama.cpp's ggml-vocab-*.gguf
files), and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py from the pinned source
distribution (model_files.llama_cpp_sources(); scripts/setup unpacks it).

Owns `converted_model()`, which makes (once per test session and architecture) the directory, the
GGUF file and the transformers model that the parity tests compare the engine against, and
`TinyFamily`, which says what one architecture's tiny model is.

Random weights are scaled up from transformers' initialisation (std 0.02 makes every position's
greedy choice the same token, and near-ties everywhere): with `initializer_range` around 0.5 the
logits spread over tens of units, so a greedy decision moves only when the maths does.
"""

from __future__ import annotations

import functools
import subprocess
import sys
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
    the attention biases (zero in transformers' initialisation) and `random_norms` the RMSNorm
    weights (ones there) so that their layout is tested."""

    name: str
    make_config: Callable[[int], object]
    vocab: str
    random_biases: bool = False
    random_norms: bool = False
    seed: int = 0
    extra_files: dict = field(default_factory=dict)  # file name -> text, written into the directory


@functools.lru_cache(maxsize=None)
def vocab_tokenizer(vocab: str):
    """transformers' tokenizer read from llama.cpp's ggml-vocab-<vocab>.gguf (10 s for a
    150k-token vocabulary)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(llama_cpp_sources() / "models"),
                                                      gguf_file=f"ggml-vocab-{vocab}.gguf")


def build_hf_directory(family: TinyFamily, directory: Path):
    """Saves the family's seeded random model and its tokenizer into `directory`; returns the
    transformers model (float32, eval mode)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = vocab_tokenizer(family.vocab)
    config = family.make_config(len(tokenizer))
    torch.manual_seed(family.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if family.random_biases and name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
            if family.random_norms and name.endswith("norm.weight"):
                parameter.normal_(1.0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    for name, text in family.extra_files.items():
        (directory / name).write_text(text)
    return model


def convert_to_gguf(hf_directory: Path, gguf_path: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `hf_directory`, as a user runs it (its own gguf-py
    first on the path, as the script arranges); a failure shows the script's last output."""
    script = llama_cpp_sources() / "convert_hf_to_gguf.py"
    result = subprocess.run([sys.executable, str(script), str(hf_directory), "--outfile", str(gguf_path),
                             "--outtype", outtype], capture_output=True, text=True)
    if result.returncode != 0 or not gguf_path.is_file():
        raise AssertionError(f"convert_hf_to_gguf.py failed ({result.returncode}) on {hf_directory}:\n"
                             f"{result.stderr[-3000:]}")
    return gguf_path


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
