"""The reasoning part of an answer's grammar: the thinking a tool-call grammar lets through first.

A request under a grammar (tools) that a reasoning model answers while thinking must be free to
think before it answers: the grammar starts with the reasoning block (opened by the prompt, or
by the model), any text up to its close, and only then the answer's rules apply, so call-shaped text inside the reasoning is not forced into a call and
a call after it is one. Where the close is a special token the block is text then that token
(text cannot contain a special token); otherwise the text ends lazily at the first close.
"""

from __future__ import annotations

import json

from tokios.reasoning.formats import ReasoningFormat


def _literal(text: str) -> str:
    return json.dumps(text)


def _marker(text: str, special_id: int | None) -> str:
    return f"<[{special_id}]>" if special_id is not None else _literal(text)


def reasoning_rules(reasoning_format: ReasoningFormat, starts_inside: bool, start_special_id: int | None,
                    end_special_id: int | None) -> tuple[str, list[str]]:
    """(the expression that goes before the answer in `start`, the rules it needs), for a request
    that thinks."""
    if end_special_id is not None:
        rules = [f"thinking: THINKING_TEXT {_marker(reasoning_format.end, end_special_id)}",
                 r"THINKING_TEXT: /(.|\n)*/"]
    else:
        rules = [f"thinking[lazy]: /(.|\\n)*/ {_literal(reasoning_format.end)}"]
    if starts_inside:
        return "thinking", rules
    # The model opens the thinking itself (Qwen3): it must, once asked to think, as it was
    # trained to. (Optional, the open marker would be a second way to start the answer's free
    # text, and llguidance's lexer would commit to whichever lexeme ends first: a `<tool_call>`
    # inside the thinking; and a small model may skip to the answer or pad before it.)
    rules.append(f"opened_thinking: {_marker(reasoning_format.start, start_special_id)} thinking")
    return "opened_thinking", rules
