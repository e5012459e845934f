"""The grammar of a tool-calling answer, as a StructuredOutput the engine constrains decoding with.

- `required`: one or more calls (one when parallel_tool_calls is false), nothing else;
- a named tool_choice: exactly one call of that function;
- `auto`: either plain text, or text up to a `<tool_call>` the model chooses to open, after which
  the call is completed under the grammar (llguidance's lazy lexeme: the text ends at the first
  `<tool_call>`), then more calls or the end.

Each call's arguments are generated under the function's own parameters schema, compactly
(`{"a": 1}`: no free whitespace, so the call's end is unambiguous to the streaming parser).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from tokios.structured.spec import JSON_OPTIONS, StructuredOutput
from tokios.tool_calls.call_format import (ARGUMENTS_PREFIX, CALL_CLOSE, CALL_END, CALL_OPEN, CALL_SEPARATOR,
                                           NAME_PREFIX)
from tokios.tool_calls.definitions import ToolSet


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def tool_call_grammar(tools: ToolSet, reasoning: tuple[str, list[str]] | None = None,
                      special_ids: Mapping[str, int] | None = None) -> StructuredOutput:
    """The answer's grammar; `reasoning` (reasoning/grammar.py: an expression and its rules) is
    a reasoning model's thinking, which comes first and is free text. `special_ids`: the ids of
    the call tags that are special tokens in the model's vocabulary (Qwen3's `<tool_call>`): the
    grammar asks for that token (llguidance's `<[ID]>`), which the model writes, rather than the
    tag's text, which a special token does not match."""
    special_ids = special_ids or {}

    def tag(text: str) -> str:
        return f"<[{special_ids[text]}]>" if text in special_ids else _literal(text)

    call_open = tag(CALL_OPEN)
    functions = tools.callable_functions
    rules = ["%llguidance {}"]
    thinking = ""
    if reasoning is not None:
        # The blank space a model writes between its thinking and its answer ("\n\n"), bounded:
        # a small model under `required` would pad there until max_tokens.
        thinking = reasoning[0] + " AFTER_THINKING? "
        rules += [*reasoning[1], r"AFTER_THINKING: /[ \t\n]{1,4}/"]
    more = "more_calls" if tools.parallel and tools.mode != "function" else ""
    if tools.calls_required:
        rules.append(f"start: {thinking}{call_open} call_body {more}")
    else:
        rules += [f"start: {thinking}answer",
                  "answer: plain_text | text_then_call call_body " + more,
                  "plain_text: TEXT",
                  # Text cannot hold a special token: it ends at the tag without a lazy lexeme.
                  f"text_then_call: TEXT {call_open}" if CALL_OPEN in special_ids
                  else f"text_then_call[lazy]: TEXT {call_open}",
                  r"TEXT: /(.|\n)*/"]
    if more:
        rules.append(f"more_calls: ({_literal(CALL_SEPARATOR)} {call_open} call_body)*")
    alternatives = " | ".join(f"function_{index}" for index in range(len(functions)))
    call_end = _literal(CALL_END.removesuffix(CALL_CLOSE)) + " " + tag(CALL_CLOSE)
    rules.append(f"call_body: {_literal(NAME_PREFIX)} ({alternatives}) {call_end}")
    for index, function in enumerate(functions):
        schema = {**function.parameters, "x-guidance": JSON_OPTIONS}
        rules.append(f"function_{index}: {_literal(function.name + ARGUMENTS_PREFIX)} arguments_{index}")
        rules.append(f"arguments_{index}: %json {json.dumps(schema)}")
    return StructuredOutput("grammar", "\n".join(rules) + "\n", param="tools")
