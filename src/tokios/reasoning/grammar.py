"""The reasoning part of an answer's grammar: the thinking a tool-call grammar lets through first.

A request under a grammar (tools) that a reasoning model answers must be free to think before
it answers: the grammar starts with the reasoning block, any text up to its close, and only then
the answer's rules apply, so call-shaped text inside the reasoning is not forced into a call and
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
                    end_special_id: int | None, must_think: bool = False) -> tuple[str, list[str]]:
    """(the expression that goes before the answer in `start`, the rules it needs). `must_think`:
    the request has thinking on, so a model that opens the reasoning itself (Qwen3) opens it
    first, as it was trained to (else a small model may skip to the answer, or pad before it)."""
    if end_special_id is not None:
        rules = [f"thinking: THINKING_TEXT {_marker(reasoning_format.end, end_special_id)}",
                 r"THINKING_TEXT: /(.|\n)*/"]
    else:
        rules = [f"thinking[lazy]: /(.|\\n)*/ {_literal(reasoning_format.end)}"]
    if starts_inside:
        return "thinking", rules
    rules.append(f"opened_thinking: {_marker(reasoning_format.start, start_special_id)} thinking")
    return "opened_thinking" if must_think else "opened_thinking?", rules
