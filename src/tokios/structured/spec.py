"""StructuredOutput: what one request asks its output to match, checked for shape at the door.

Five kinds, as vLLM's `structured_outputs` names them: `json` (a JSON schema), `json_object` (any
JSON object), `regex`, `choice` (one of a list of strings) and `grammar` (Lark, or llama.cpp's
GBNF, told apart by llguidance). The server builds one from `response_format` or
`structured_outputs` (server/dialects/openai/protocol.py), tool calling builds one from the tools
(tool_calls/grammar.py). Whether the schema or grammar actually compiles is the compiler's
question (compiler.py), answered before the request is queued; every error names `param`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokios.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# JSON is generated compactly but readably: `{"a": 1, "b": [2, 3]}`. llguidance's default allows
# any whitespace between tokens, which lets a small model pad with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# A schema for "any JSON object" (response_format json_object): OpenAI's json mode gives objects.
ANY_JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def _json_schema(value: Any, param: str) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object), got {type(value).__name__}", param=param)
    return dict(value)


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    # The constraint as text: a JSON schema serialised in its own key order (the order in which
    # properties are generated), a regex, a JSON list of choices, a grammar. With `kind`, the
    # compiler's cache key.
    source: str
    # The request field that errors name, e.g. "response_format.json_schema.schema".
    param: str = "structured_outputs"

    def __repr__(self) -> str:  # request log lines name the kind, not a whole schema
        return f"StructuredOutput({self.kind}, {len(self.source)} chars)"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}",
                                      param=self.param)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def json(cls, schema: Any, param: str = "structured_outputs.json") -> StructuredOutput:
        return cls("json", json.dumps(_json_schema(schema, param)), param)

    @classmethod
    def json_object(cls, param: str = "structured_outputs.json_object") -> StructuredOutput:
        return cls("json_object", json.dumps(ANY_JSON_OBJECT_SCHEMA), param)

    @classmethod
    def regex(cls, pattern: Any, param: str = "structured_outputs.regex") -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(f"{param} must be a non-empty regular expression string", param=param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: Any, param: str = "structured_outputs.choice") -> StructuredOutput:
        if (not isinstance(options, (list, tuple)) or not options
                or not all(isinstance(option, str) and option for option in options)):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return cls("choice", json.dumps(list(options)), param)

    @classmethod
    def grammar(cls, text: Any, param: str = "structured_outputs.grammar") -> StructuredOutput:
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError(f"{param} must be a non-empty grammar (Lark or GBNF)", param=param)
        return cls("grammar", text, param)

    @classmethod
    def from_structured_outputs(cls, value: Any, param: str = "structured_outputs") -> StructuredOutput | None:
        """vLLM's request field: an object with exactly one of json, json_object, regex, choice,
        grammar. Its other options (structural_tag, whitespace_pattern, ...) are refused, not
        ignored."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"{param} must be an object with one of {list(KINDS)}", param=param)
        given = {key: item for key, item in value.items() if item is not None and item is not False}
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"{param}: {', '.join(unknown)} not supported; give exactly one of "
                                      f"{list(KINDS)}", param=f"{param}.{unknown[0]}")
        if len(given) != 1:
            raise InvalidRequestError(f"{param} must give exactly one of {list(KINDS)}, got "
                                      f"{sorted(given) or 'none'}", param=param)
        (kind, item), = given.items()
        where = f"{param}.{kind}"
        if kind == "json_object":
            if item is not True:
                raise InvalidRequestError(f"{where} must be true", param=where)
            return cls.json_object(where)
        return getattr(cls, kind)(item, where)

    @classmethod
    def from_response_format(cls, value: Any, param: str = "response_format") -> StructuredOutput | None:
        """OpenAI's chat field: {"type": "text"} (None), {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"{param} must be an object with a type", param=param)
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(param)
        if kind == "json_schema":
            wrapper = value.get("json_schema")
            where = f"{param}.json_schema"
            if not isinstance(wrapper, Mapping):
                raise InvalidRequestError(f"{where} must be an object with name and schema", param=where)
            if "schema" not in wrapper:
                raise InvalidRequestError(f"{where}.schema is required", param=f"{where}.schema")
            return cls.json(wrapper["schema"], f"{where}.schema")
        raise InvalidRequestError(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                                  param=f"{param}.type")

    # ---- to llguidance ---------------------------------------------------------------------
    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON or Lark form). Raises InvalidRequestError naming
        `param` when the text cannot even be translated (a GBNF syntax error)."""
        import llguidance

        try:
            if self.kind in ("json", "json_object"):
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.source)
            return llguidance.grammar_from("grammar", self.source)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f"{self.param}: {exc}", param=self.param) from None
