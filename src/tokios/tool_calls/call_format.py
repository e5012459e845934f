"""The text form of a tool call, shared by the prompt, the grammar and the parser.

A call is written (the Hermes / Qwen 2.5 form, which models trained for tools know):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after the other, separated by a newline. The grammar forces this exact
spacing, so the parser can read the name and stream the arguments without guessing; the prompt
renders past calls the same way so the model sees its own format.
"""

from __future__ import annotations

import json

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
NAME_PREFIX = '\n{"name": "'
ARGUMENTS_PREFIX = '", "arguments": '
# After the arguments object: the wrapper's closing brace and the closing tag.
CALL_END = "}\n" + CALL_CLOSE
CALL_SEPARATOR = "\n"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def call_text(name: str, arguments_json: str) -> str:
    """One call block; `arguments_json` is the arguments object as JSON text."""
    return f"{CALL_OPEN}{NAME_PREFIX}{name}{ARGUMENTS_PREFIX}{arguments_json}{CALL_END}"


def compact_arguments(arguments: str) -> str:
    """A past call's arguments as our grammar would have written them (`{"a": 1}`), or the
    string as given when it is not JSON (the client's history is rendered, not judged)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return arguments
