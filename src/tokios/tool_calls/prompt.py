"""How a conversation with tools reaches the model.

A chat template that takes `tools` (its source uses the variable) renders them itself, and the
messages go to it as OpenAI sent them. Neither of our models' templates does, so for those this
module writes the documented prompt format (docs/structured.md):

- a system block after the system message (or a new system message) lists the tools as JSON,
  one per line, between <tools> tags, says how to call one, and, for `required` or a named
  tool_choice, that a call is expected;
- an assistant message's `tool_calls` become call blocks (call_format.py) after its content;
- `tool` messages become a user message of <tool_response> blocks (consecutive results merge).

With tool_choice "none" the tools are left out of the prompt (the model is not to call any), but
a history of calls and results is still rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokios.errors import InvalidRequestError
from tokios.tool_calls.call_format import (CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, call_text,
                                           compact_arguments)
from tokios.tool_calls.definitions import ToolSet

SYSTEM_ROLES = ("system", "developer")


def tools_instructions(tools: ToolSet) -> str:
    listed = "\n".join(json.dumps(function.as_tool(), ensure_ascii=False) for function in tools.functions)
    lines = [
        "You can call functions to help answer. These are the functions, one JSON object per line:",
        "<tools>", listed, "</tools>",
        f"To call a function, write {CALL_OPEN}, then on the next line a JSON object with the function's "
        f"\"name\" and its \"arguments\" (an object matching its parameters), then {CALL_CLOSE} on its own line:",
        call_text("function_name", '{"parameter": "value"}'),
        "Several calls go one after another. The results come back in "
        f"{RESPONSE_OPEN}{RESPONSE_CLOSE} blocks.",
    ]
    if tools.mode == "function":
        lines.append(f"Call the function {tools.forced_name} now.")
    elif tools.mode == "required":
        lines.append("Answer with function calls only.")
    else:
        lines.append("If no function is needed, answer directly.")
    return "\n".join(lines)


def _assistant_text(message: Mapping[str, Any], index: int) -> str:
    parts = [message.get("content") or ""]
    for call_index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"messages[{index}].tool_calls[{call_index}] must be {{'id', 'type': "
                                      "'function', 'function': {'name', 'arguments'}}", param="messages")
        arguments = function.get("arguments")
        arguments = (json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, Mapping)
                     else compact_arguments(arguments or "{}"))
        parts.append(call_text(function["name"], arguments))
    return "\n".join(part for part in parts if part)


def render_messages(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, Any]]:
    """Messages for a template without tool support: plain {role, content} only."""
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{message.get('content') or ''}\n{RESPONSE_CLOSE}"
            if rendered and rendered[-1].get("_tool_results"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "_tool_results": True})
        elif role == "assistant" and message.get("tool_calls"):
            rendered.append({"role": "assistant", "content": _assistant_text(message, index)})
        else:
            rendered.append({"role": role, "content": message.get("content") or ""})
    for message in rendered:
        message.pop("_tool_results", None)
    if tools is not None and tools.calls_possible:
        instructions = tools_instructions(tools)
        if rendered and rendered[0]["role"] in SYSTEM_ROLES:
            first = rendered[0]
            first["content"] = f"{first['content']}\n\n{instructions}" if first["content"] else instructions
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def template_inputs(messages: list[dict[str, Any]], tools: ToolSet | None,
                    template_takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template."""
    if template_takes_tools:
        functions = [function.as_tool() for function in tools.functions] if tools and tools.calls_possible else None
        return messages, functions
    return render_messages(messages, tools), None
