"""Pre-tokenizers for GGUF byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.

Owns the table from llama.cpp's pre-tokenizer names to how text is cut into words before BPE
merges run: regular expressions applied in order as "isolated" splits on the text, the byte-level
spelling, optionally more splits on the spelled words, and whether a word that is itself a token
skips the merges. Used by tokenizer.py. The expressions are the ones the original Hugging Face
tokenizers use (llama.cpp's own copies are adapted for its regex engine, with hand-written
splitters for a few); llama.cpp's ggml-vocab-*.gguf test vectors check them
(tests/model/test_llama_cpp_vocabularies.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Han, Hangul and the blocks between U+0800 and U+4E00, as DeepSeek's tokenizers isolate them.
DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

# DeepSeek LLM's letters: the cased letters (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee,
# Glagolitic, Coptic, fullwidth Latin, Deseret, Osage, Old Hungarian, Warang Citi, Adlam); other
# scripts fall through to the CJK and digit splits or stay whole.
DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)

# ASCII and Unicode punctuation, the Hugging Face Punctuation pre-tokenizer's set.
PUNCTUATION_RUN = r"[\p{P}\$\+<=>\^~\|`]+"


@dataclass(frozen=True)
class PreTokenization:
    """How one vocabulary cuts text into words.

    `splits` run on the text, `byte_level_splits` on the words after their byte-level spelling
    (where the original tokenizer puts them after its ByteLevel step, which matters for the
    Latin-1 numerals "²", "½" that spell bytes). With `keeps_whole_words`, a word that is itself
    in the vocabulary is that token without running the merges (Llama 3's `ignore_merges`; the
    merges alone can miss such a token, "ĠViá»ĩt" in Llama 3).
    """

    splits: tuple[str, ...]
    byte_level_splits: tuple[str, ...] = ()
    keeps_whole_words: bool = False

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        steps: list[pre_tokenizers.PreTokenizer] = [_isolated(pattern) for pattern in self.splits]
        # The regexes already cut words; ByteLevel only respells bytes here.
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        steps.extend(_isolated(pattern) for pattern in self.byte_level_splits)
        return pre_tokenizers.Sequence(steps)


def _isolated(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated")


GPT2 = PreTokenization((GPT2_SPLIT,))
LLAMA3 = PreTokenization((LLAMA3_SPLIT,), keeps_whole_words=True)
QWEN2 = PreTokenization((QWEN2_SPLIT,))
GPT4O = PreTokenization((GPT4O_SPLIT,))
# Each digit on its own first (SmolLM/StarCoder vocabularies were trained that way), then GPT-2.
DIGITS_THEN_GPT2 = PreTokenization((r"\p{N}", GPT2_SPLIT))
# llama.cpp's fallback for BPE vocabularies that name no known pre-tokenizer.
DEFAULT = PreTokenization((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))
# Falcon: punctuation runs, GPT-2, then digit runs and groups of three on the spelled bytes.
FALCON = PreTokenization((PUNCTUATION_RUN, GPT2_SPLIT), byte_level_splits=(r"\p{N}+", r"[0-9][0-9][0-9]"))
DEEPSEEK_LLM = PreTokenization((
    r"[\r\n]",
    rf"\s?[{DEEPSEEK_LLM_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    DEEPSEEK_CJK,
    r"\p{N}+",
))
DEEPSEEK_CODER = PreTokenization((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"))

# pre-tokenizer name (as convert_hf_to_gguf.py writes it) -> how its vocabulary cuts words.
PRE_TOKENIZATIONS: dict[str, PreTokenization] = {
    "default": DEFAULT,
    "gpt-2": GPT2,
    "gpt2": GPT2,
    "mpt": GPT2,
    "olmo": GPT2,
    "phi-2": GPT2,
    "smollm": DIGITS_THEN_GPT2,
    "starcoder": DIGITS_THEN_GPT2,
    "refact": DIGITS_THEN_GPT2,
    "command-r": DIGITS_THEN_GPT2,
    "codeshell": DIGITS_THEN_GPT2,
    "exaone": DIGITS_THEN_GPT2,
    "minerva-7b": DIGITS_THEN_GPT2,
    "llama-bpe": LLAMA3,
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "falcon3": LLAMA3,
    "pixtral": LLAMA3,
    # Llama 3's regex, but llama.cpp runs the merges on every word of these.
    "dbrx": PreTokenization((LLAMA3_SPLIT,)),
    "smaug-bpe": PreTokenization((LLAMA3_SPLIT,)),
    "qwen2": QWEN2,
    "stablelm2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "megrez": QWEN2,
    "gpt-4o": GPT4O,
    "llama4": GPT4O,
    "falcon": FALCON,
    "deepseek-llm": DEEPSEEK_LLM,
    "deepseek-coder": DEEPSEEK_CODER,
}


def pre_tokenization(name: str | None) -> PreTokenization:
    """The word cutting for a `tokenizer.ggml.pre` name (None means "default")."""
    found = PRE_TOKENIZATIONS.get(name or "default")
    if found is None:
        raise ModelLoadError(
            f"unknown tokenizer.ggml.pre {name!r}; supported: {', '.join(sorted(PRE_TOKENIZATIONS))}"
        )
    return found


def build_pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer for a `tokenizer.ggml.pre` name (None means "default")."""
    return pre_tokenization(name).pre_tokenizer()
