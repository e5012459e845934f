"""`tokios tokenize TEXT [--model PATH] [--chat]`: show how a model tokenizes a text.

Owns the command only; talks to tokios.tokenizer (load_tokenizer, apply_chat_template) and
tokios.model_files (the default model). Prints one line per token: id, vocabulary piece, and the
text that token decodes to, then the total count.
"""

from __future__ import annotations

import argparse
import json

from tokios.model_files import resolve_model_path
from tokios.tokenizer import load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="text to tokenize")
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap TEXT as one user message in the model's chat template first"
    )
    parser.add_argument("--json", action="store_true", help="print {ids, tokens, text} as one JSON object")


def run(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    text = args.text
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    token_ids = tokenizer.encode(text)
    pieces = tokenizer.convert_ids_to_tokens(token_ids)
    if args.json:
        print(json.dumps({"ids": token_ids, "tokens": pieces, "text": text}, ensure_ascii=False))
        return 0
    token_bytes = tokenizer.token_bytes_table(skip_special_tokens=False)
    id_width = len(str(max(token_ids, default=0)))
    for token_id, piece in zip(token_ids, pieces):
        decoded = tokenizer.decode([token_id])
        if "\ufffd" in decoded and token_bytes is not None:
            # Part of a multi-byte character: show its bytes rather than a replacement mark.
            decoded_text = "bytes " + token_bytes[token_id].hex(" ")
        else:
            decoded_text = repr(decoded)
        print(f"{token_id:>{id_width}}  {piece!r:<24} {decoded_text}")
    print(f"{len(token_ids)} tokens")
    return 0
