"""Pre-tokenizers for GGUF byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.

Owns the table from llama.cpp's pre-tokenizer names to the regular expressions that cut text into
words before BPE merges run; used by tokenizer.py. The expressions are the ones the original
Hugging Face tokenizers use (llama.cpp's own copies are adapted for its regex engine, with
hand-written splitters for a few), applied in order as "isolated" splits, then the byte-level
spelling without a further regex.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

from tokios.errors import ModelLoadError

# GPT-2's word splitter (also what ByteLevel(use_regex=True) applies).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Each digit on its own first (SmolLM/StarCoder vocabularies were trained that way), then GPT-2.
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)

# llama.cpp's fallback for BPE vocabularies that name no known pre-tokenizer.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

# pre-tokenizer name (as convert_hf_to_gguf.py writes it) -> regexes applied in order.
PRE_TOKENIZER_TO_SPLITS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_SPLITS,
    "gpt-2": (GPT2_SPLIT,),
    "gpt2": (GPT2_SPLIT,),
    "mpt": (GPT2_SPLIT,),
    "olmo": (GPT2_SPLIT,),
    "phi-2": (GPT2_SPLIT,),
    "smollm": DIGITS_THEN_GPT2,
    "starcoder": DIGITS_THEN_GPT2,
    "refact": DIGITS_THEN_GPT2,
    "command-r": DIGITS_THEN_GPT2,
    "codeshell": DIGITS_THEN_GPT2,
    "exaone": DIGITS_THEN_GPT2,
    "minerva-7b": DIGITS_THEN_GPT2,
    "llama-bpe": (LLAMA3_SPLIT,),
    "llama3": (LLAMA3_SPLIT,),
    "llama-v3": (LLAMA3_SPLIT,),
    "dbrx": (LLAMA3_SPLIT,),
    "smaug-bpe": (LLAMA3_SPLIT,),
    "falcon3": (LLAMA3_SPLIT,),
    "pixtral": (LLAMA3_SPLIT,),
    "qwen2": (QWEN2_SPLIT,),
    "stablelm2": (QWEN2_SPLIT,),
    "deepseek-r1-qwen": (QWEN2_SPLIT,),
    "megrez": (QWEN2_SPLIT,),
    "gpt-4o": (GPT4O_SPLIT,),
    "llama4": (GPT4O_SPLIT,),
}


def build_pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer for a `tokenizer.ggml.pre` name (None means "default")."""
    splits = PRE_TOKENIZER_TO_SPLITS.get(name or "default")
    if splits is None:
        raise ModelLoadError(
            f"unknown tokenizer.ggml.pre {name!r}; supported: {', '.join(sorted(PRE_TOKENIZER_TO_SPLITS))}"
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits
    ]
    # The regexes above already cut words; ByteLevel only respells bytes here.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
