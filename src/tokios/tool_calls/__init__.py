"""Tool calling on /v1/chat/completions (docs/structured.md, "Tool calls").

- definitions.py: `ToolSet`, the request's `tools`, `tool_choice` and `parallel_tool_calls`,
  validated (a bad name, a non-object parameters schema, an unknown tool in tool_choice: 400);
- prompt.py: how tools and the tool-call history reach the model: through the chat template when
  it takes `tools`, otherwise our documented prompt format (a system block listing the tools,
  calls as `<tool_call>` blocks, results as `<tool_response>` blocks);
- grammar.py: the grammar that makes a call valid by construction (`required` / named: calls
  only; `auto`: free text until the model opens a `<tool_call>`, then the call is completed under
  the grammar), with each function's arguments under its own parameters schema;
- parser.py: `ToolCallParser`, which turns the generated text, whole or as it streams, into
  content and OpenAI tool calls without ever letting call text into `content`.
"""

from tokios.tool_calls.definitions import ToolSet
from tokios.tool_calls.parser import ToolCallParser

__all__ = ["ToolCallParser", "ToolSet"]
