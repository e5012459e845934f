"""The grammar of a gpt-oss answer with tools, in harmony's messages (the parser: harmony.py).

The output starts after the template's `<|start|>assistant`:

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant
    then  <|channel|>final<|message|>ANSWER<|return|>                                (auto only)
    or    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>

The analysis comes first and is free text (a call-shaped text in it is reasoning), as gpt-oss
always reasons before it answers; a thinking budget's forced end (`<|end|><|start|>assistant`,
and for `auto` the final channel's header) is what this grammar admits there. Then, for `auto`,
a final answer or a call; for `required` or a named tool_choice, a call (of the named function
alone). The call is the form OpenAI's harmony documentation gives (the recipient in the channel
header, the `json` constraint), its arguments under the function's parameters schema, compact and
closed as tool_calls/grammar.py writes them. `<|call|>` ends the output, so a turn holds one call
whatever parallel_tool_calls says: the agent sends the result and the model calls again.

The markers are special tokens, written `<[ID]>` (llguidance's token reference), so free text can
never contain one. It lives beside the harmony parser rather than in tool_calls/ because both
spell out one format, and reasoning/ already depends on tool_calls/, not the reverse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from tokios.errors import InvalidRequestError
from tokios.reasoning.harmony import CALL, CHANNEL, CONSTRAIN, END, FUNCTIONS_PREFIX, MESSAGE, RETURN, START
from tokios.structured.spec import JSON_OPTIONS, StructuredOutput
from tokios.tool_calls.definitions import ToolSet

MARKERS = (START, END, MESSAGE, CHANNEL, CALL, RETURN, CONSTRAIN)


def harmony_tool_call_grammar(tools: ToolSet, marker_to_id: Mapping[str, int]) -> StructuredOutput:
    """`marker_to_id`: the special token id of each of harmony's markers (MARKERS)."""
    missing = [marker for marker in MARKERS if marker not in marker_to_id]
    if missing:
        raise InvalidRequestError(f"tools: gpt-oss's calls are written between harmony's markers, and {missing} "
                                  "are not special tokens of this model's vocabulary", param="tools")

    def token(marker: str) -> str:
        return f"<[{marker_to_id[marker]}]>"

    functions = tools.callable_functions
    rules = ["%llguidance {}",
             "start: analysis answer",
             f'analysis: {token(CHANNEL)} "analysis" {token(MESSAGE)} TEXT {token(END)} {token(START)} "assistant"',
             r"TEXT: /(.|\n)*/",
             "answer: call" if tools.calls_required else "answer: final | call",
             f'final: {token(CHANNEL)} "final" {token(MESSAGE)} TEXT {token(RETURN)}',
             f'call: {token(CHANNEL)} {json.dumps("commentary to=" + FUNCTIONS_PREFIX)} ('
             + " | ".join(f"function_{index}" for index in range(len(functions))) + ")"]
    for index, function in enumerate(functions):
        schema = {**function.parameters, "x-guidance": JSON_OPTIONS}
        rules.append(f'function_{index}: {json.dumps(function.name + " ")} {token(CONSTRAIN)} "json" '
                     f"{token(MESSAGE)} arguments_{index} {token(CALL)}")
        rules.append(f"arguments_{index}: %json {json.dumps(schema)}")
    return StructuredOutput("grammar", "\n".join(rules) + "\n", param="tools")
