"""The post-processor that adds BOS and/or EOS around each encoded text.

Owns `bos_eos_processor`, shared by the two ways a Tokenizer is built: from GGUF metadata
(tokenizer.py, the file's add_bos_token / add_eos_token) and from a Hugging Face directory
(hf_dir.py, tokenizer_config.json's flags).
"""

from __future__ import annotations

import tokenizers
from tokenizers import processors

from tokios.errors import ModelLoadError


def bos_eos_processor(
    backend: tokenizers.Tokenizer, bos_token_id: int | None, eos_token_id: int | None, where: str
) -> processors.PostProcessor | None:
    """A post-processor adding BOS and/or EOS around each encoded text, or None for neither.
    `where` names the source in an error, e.g. "(in model.gguf)"."""
    if bos_token_id is None and eos_token_id is None:
        return None
    single: list[str] = []
    special_tokens: list[tuple[str, int]] = []
    if bos_token_id is not None:
        bos = backend.id_to_token(bos_token_id)
        single.append(f"{bos}:0")
        special_tokens.append((bos, bos_token_id))
    single.append("$A:0")
    if eos_token_id is not None:
        eos = backend.id_to_token(eos_token_id)
        single.append(f"{eos}:0")
        if all(token_id != eos_token_id for _, token_id in special_tokens):
            special_tokens.append((eos, eos_token_id))
    try:
        return processors.TemplateProcessing(single=single, special_tokens=special_tokens)
    except Exception as exc:  # a token text with spaces cannot appear in a template string
        raise ModelLoadError(f"cannot add BOS/EOS tokens {where}: {exc}") from None
