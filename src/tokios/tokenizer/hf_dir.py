"""Reading a tokenizer from a Hugging Face model directory.

Owns reading tokenizer.json (the `tokenizers` pipeline), tokenizer_config.json (chat template,
special tokens, add_bos_token / add_eos_token), chat_template.jinja (newer layout) and
generation_config.json (extra end-of-generation ids); `read_hf_dir_chat_template` reads only the
chat template. Tokenizer.from_hf_dir (tokenizer.py) builds the Tokenizer from what `read_hf_dir`
returns; this module does not import tokenizer.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from tokios.errors import ModelLoadError
from tokios.tokenizer.bos_eos import bos_eos_processor


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_from_config(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _chat_template_in(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():  # the newer layout wins over tokenizer_config.json's entry
        return jinja_file.read_text(encoding="utf-8")
    return _chat_template_from_config(config)


def read_hf_dir_chat_template(directory: Path) -> str | None:
    """The directory's chat template, without building its tokenizer (None: it has none)."""
    config_file = directory / "tokenizer_config.json"
    return _chat_template_in(directory, parse_json_file(config_file) if config_file.is_file() else {})


def read_hf_dir(directory: Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The directory's `tokenizers` pipeline and the keyword arguments of the Tokenizer built on it."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"no tokenizer.json in {directory}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises plain Exception on a malformed file
        raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from None
    # A tokenizer.json may pad or truncate every encoding (sentence-transformers' MiniLM pads to
    # 128); transformers ignores that unless a call asks for it, and so do we: lengths are the
    # engine's business.
    backend.no_padding()
    backend.no_truncation()

    config_file = directory / "tokenizer_config.json"
    config = parse_json_file(config_file) if config_file.is_file() else {}
    chat_template = _chat_template_in(directory, config)

    def token_id(name: str) -> int | None:
        text = _token_text(config.get(name))
        if text is None:
            return None
        found = backend.token_to_id(text)
        if found is None:
            raise ModelLoadError(f"{config_file}: {name} {text!r} is not in the vocabulary")
        return found

    bos_token_id = token_id("bos_token")
    eos_token_id = token_id("eos_token")
    if "add_bos_token" in config or "add_eos_token" in config:
        # The config's flags win over tokenizer.json's post-processor, as in transformers.
        backend.post_processor = bos_eos_processor(
            backend,
            bos_token_id if config.get("add_bos_token") else None,
            eos_token_id if config.get("add_eos_token") else None,
            f"(in {config_file})",
        )

    extra_eos_token_ids: list[int] = []
    generation_config_file = directory / "generation_config.json"
    if generation_config_file.is_file():
        configured = parse_json_file(generation_config_file).get("eos_token_id")
        if isinstance(configured, int):
            extra_eos_token_ids.append(configured)
        elif isinstance(configured, list):
            extra_eos_token_ids.extend(i for i in configured if isinstance(i, int))

    return backend, dict(
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        unk_token_id=token_id("unk_token"),
        pad_token_id=token_id("pad_token"),
        chat_template=chat_template,
        extra_eos_token_ids=extra_eos_token_ids,
        source=str(directory),
    )


def parse_json_file(path: Path) -> dict[str, Any]:
    """Read a JSON object file, as ModelLoadError on failure."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value
