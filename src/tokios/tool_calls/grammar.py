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

from tokios.structured.spec import JSON_OPTIONS, StructuredOutput
from tokios.tool_calls.call_format import ARGUMENTS_PREFIX, CALL_END, CALL_OPEN, CALL_SEPARATOR, NAME_PREFIX
from tokios.tool_calls.definitions import ToolSet


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def tool_call_grammar(tools: ToolSet, reasoning: tuple[str, list[str]] | None = None) -> StructuredOutput:
    """The answer's grammar; `reasoning` (reasoning/grammar.py: an expression and its rules) is
    a reasoning model's thinking, which comes first and is free text."""
    functions = tools.callable_functions
    rules = ["%llguidance {}"]
    thinking = ""
    if reasoning is not None:
        # The blank space a model writes between its thinking and its answer.
        thinking = reasoning[0] + " AFTER_THINKING? "
        rules += [*reasoning[1], r"AFTER_THINKING: /[ \t\n]+/"]
    more = "more_calls" if tools.parallel and tools.mode != "function" else ""
    if tools.calls_required:
        rules.append(f"start: {thinking}{_literal(CALL_OPEN)} call_body {more}")
    else:
        rules += [f"start: {thinking}answer",
                  "answer: plain_text | text_then_call call_body " + more,
                  "plain_text: TEXT",
                  f"text_then_call[lazy]: TEXT {_literal(CALL_OPEN)}",
                  r"TEXT: /(.|\n)*/"]
    if more:
        rules.append(f"more_calls: ({_literal(CALL_SEPARATOR + CALL_OPEN)} call_body)*")
    alternatives = " | ".join(f"function_{index}" for index in range(len(functions)))
    rules.append(f"call_body: {_literal(NAME_PREFIX)} ({alternatives}) {_literal(CALL_END)}")
    for index, function in enumerate(functions):
        schema = {**function.parameters, "x-guidance": JSON_OPTIONS}
        rules.append(f"function_{index}: {_literal(function.name + ARGUMENTS_PREFIX)} arguments_{index}")
        rules.append(f"arguments_{index}: %json {json.dumps(schema)}")
    return StructuredOutput("grammar", "\n".join(rules) + "\n", param="tools")
