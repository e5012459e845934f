"""The sampling a request gets for the fields it leaves unset: one set for every door.

`tokios generate` and `chat`, the web page and the four APIs (OpenAI, Responses, Anthropic,
Ollama) all start from the same values, resolved once per model, field by field:

1. a flag (`--temperature`, `--top-p`, `--top-k`, `--min-p`, `--repeat-penalty`: on `serve` the
   default of every request, on `generate`/`chat` the request's own);
2. what the model file recommends: a GGUF file's `general.sampling.*` keys (llama.cpp's
   converter writes them from the model's generation_config.json), a Hugging Face directory's
   generation_config.json; `--sampling-defaults tokios` ignores them;
3. Tokios' own set, llama.cpp's defaults (temperature 0.8, top-p 0.95, top-k 40, min-p 0.05,
   no repetition penalty): an unset OpenAI temperature of 1.0 with nothing cut makes a small model
   ramble, and greedy decoding repeats itself.

A request's own value always wins. The model card (/v1/models, Ollama's /api/show) shows the
values and where each came from. `do_sample: false` in a generation_config.json is not read as
greedy (vLLM does not either): it is transformers' own default, saved by files that still mean
their temperature. No torch here: the CLI resolves the defaults before loading the model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokios.errors import InvalidRequestError

logger = logging.getLogger("tokios")

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# llama.cpp's (common/common.h common_params_sampling), which llama-server and its web page use.
TOKIOS_DEFAULTS: dict[str, float | int] = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                                           "repetition_penalty": 1.0}
# Where a model file says what it recommends.
_GGUF_KEY_TO_FIELD = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}

# A value's source, as the model card shows it.
FROM_FLAG, FROM_MODEL, FROM_TOKIOS = "flag", "model", "tokios"
MODEL_CHOICES = ("model", "tokios")


@dataclass(frozen=True)
class SamplingDefaults:
    """One model's values for the sampling fields a request leaves unset, and their sources."""

    field_to_value: Mapping[str, float | int]
    field_to_source: Mapping[str, str]

    def apply(self, request_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keywords: the request's, with these values where it sets none."""
        return {**self.field_to_value, **request_kwargs}

    def card(self) -> dict[str, Any]:
        """What /v1/models shows: the values, and where each came from."""
        return {**self.field_to_value, "source": dict(self.field_to_source)}

    def ollama_parameters(self) -> str:
        """Ollama's /api/show `parameters` text (its Modelfile's PARAMETER lines, Ollama's names)."""
        ollama_name = {"repetition_penalty": "repeat_penalty"}
        return "\n".join(f"{ollama_name.get(name, name)} {value:g}" for name, value in self.field_to_value.items())


TOKIOS = SamplingDefaults(TOKIOS_DEFAULTS, {name: FROM_TOKIOS for name in FIELDS})


def resolve(declared: Mapping[str, float | int], flags: Mapping[str, float | int | None]) -> SamplingDefaults:
    """Flags over what the model declares over Tokios' set, field by field."""
    field_to_value: dict[str, float | int] = {}
    field_to_source: dict[str, str] = {}
    for name in FIELDS:
        if flags.get(name) is not None:
            field_to_value[name], field_to_source[name] = flags[name], FROM_FLAG
        elif name in declared:
            field_to_value[name], field_to_source[name] = declared[name], FROM_MODEL
        else:
            field_to_value[name], field_to_source[name] = TOKIOS_DEFAULTS[name], FROM_TOKIOS
    return SamplingDefaults(field_to_value, field_to_source)


def for_model(path: str | os.PathLike[str] | None, flags: Mapping[str, float | int | None] | None = None, *,
              use_model: bool = True, metadata: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """The defaults of the model at `path` (a GGUF file or a model directory). `metadata`: the
    GGUF file's, when the caller has read it already."""
    declared = declared_by_model(path, metadata) if use_model and path is not None else {}
    return resolve(declared, flags or {})


def declared_by_model(path: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None) -> dict[str, float | int]:
    """The sampling values a model file recommends; a value out of range is dropped with a warning
    (the file is still served, with Tokios' value for that field)."""
    location = Path(path)
    if location.is_dir():
        config_file = location / "generation_config.json"
        if not config_file.is_file():
            return {}
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("%s: not read (%s); its sampling values are not used", config_file, exc)
            return {}
        raw = {name: config[name] for name in FIELDS if isinstance(config, dict) and name in config}
        return _checked(raw, str(config_file))
    if metadata is None:
        from tokios.gguf_file import read_gguf_metadata

        try:
            metadata = read_gguf_metadata(location, keys=frozenset(_GGUF_KEY_TO_FIELD))
        except Exception:  # the load reports what is wrong with the file
            return {}
    raw = {field: _without_float32_noise(metadata[key]) for key, field in _GGUF_KEY_TO_FIELD.items()
           if key in metadata}
    return _checked(raw, str(location))


def _without_float32_noise(value: Any) -> Any:
    """A GGUF float is a float32: 0.7 reads back as 0.699999988...; its shortest decimal is the
    value the converter wrote (7 significant digits hold any float32)."""
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _checked(raw: Mapping[str, Any], where: str) -> dict[str, float | int]:
    checked: dict[str, float | int] = {}
    for name, value in raw.items():
        try:
            checked[name] = check_value(name, value)
        except InvalidRequestError as exc:
            logger.warning("%s: recommends %s; ignored (%s)", where, f"{name}={value!r}", exc.message)
    return checked


def check_value(name: str, value: Any) -> float | int:
    """One sampling value, checked as SamplingParams checks it."""
    from tokios.sampling_params import SamplingParams

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    SamplingParams(**{name: value})
    return int(value) if name == "top_k" else float(value)


# ---- flags ------------------------------------------------------------------------------

_FLAG_TO_FIELD = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repeat_penalty": "repetition_penalty"}


def add_arguments(parser: argparse.ArgumentParser, *, applies_to: str) -> None:
    """The sampling flags, one definition for serve, generate and chat. applies_to: who takes the
    values ("every request that leaves it unset", "the reply")."""
    builtin = TOKIOS_DEFAULTS
    group = parser.add_argument_group(
        "sampling", f"values for {applies_to}; unset: what the model file recommends, else llama.cpp's "
                    "defaults (docs/sampling.md)")
    group.add_argument("--temperature", type=float, default=None,
                       help=f"0 is greedy (reproducible); higher is more varied (default {builtin['temperature']:g})")
    group.add_argument("--top-p", type=float, default=None,
                       help=f"nucleus sampling mass, in (0, 1] (default {builtin['top_p']:g})")
    group.add_argument("--top-k", type=int, default=None,
                       help=f"sample among the k likeliest tokens; 0 is off (default {builtin['top_k']})")
    group.add_argument("--min-p", type=float, default=None,
                       help=f"drop tokens below this share of the likeliest one's probability "
                            f"(default {builtin['min_p']:g})")
    group.add_argument("--repeat-penalty", type=float, default=None,
                       help=f"repetition penalty, 1 is off (default {builtin['repetition_penalty']:g})")
    group.add_argument("--sampling-defaults", choices=MODEL_CHOICES, default="model",
                       help="model: use the values the model file recommends (GGUF general.sampling.*, "
                            "generation_config.json); tokios: ignore them (default model)")


def from_args(args: argparse.Namespace, path: str | os.PathLike[str] | None,
              metadata: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """The defaults of the model at `path` under the parsed flags; a bad flag value is an
    InvalidRequestError naming the flag, before anything loads."""
    flags: dict[str, float | int | None] = {}
    for dest, name in _FLAG_TO_FIELD.items():
        value = getattr(args, dest, None)
        if value is not None:
            try:
                flags[name] = check_value(name, value)
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.message, param=dest) from None
    return for_model(path, flags, use_model=getattr(args, "sampling_defaults", "model") == "model", metadata=metadata)
