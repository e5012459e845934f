"""AnswerParser: one choice's output text -> reasoning, content and tool calls.

The one parser ChatRun (server/generation.py) feeds each choice's text deltas, and the whole
text for a non-streamed answer, so both answers come from the same code. It chains what the
model's formats need: the reasoning split first (reasoning/parser.py), so that call-shaped text
inside the reasoning is reasoning, then the tool-call parser (tool_calls/parser.py) over the
content, so that a call after the reasoning is a call. A model without a reasoning format, or a
request without tools, skips that stage. gpt-oss's harmony output carries all three in its
channels and has its own parser (reasoning/harmony.py) with the same interface.
"""

from __future__ import annotations

from typing import Any

from tokios.reasoning.formats import HARMONY, ReasoningFormat
from tokios.reasoning.harmony import HarmonyParser
from tokios.reasoning.parser import ThinkParser
from tokios.tool_calls.parser import ParsedDelta, ToolCallParser


class AnswerParser:
    def __init__(self, reasoning_format: ReasoningFormat | None, starts_inside: bool, calls_possible: bool):
        self._thinking = ThinkParser(reasoning_format, starts_inside) if reasoning_format is not None else None
        self._calls = ToolCallParser() if calls_possible else None
        self._content = ""

    @property
    def reasoning(self) -> str:
        return self._thinking.reasoning if self._thinking is not None else ""

    @property
    def is_reasoning(self) -> bool:
        """Inside a reasoning block the output has not closed (yet)."""
        return self._thinking is not None and self._thinking.is_reasoning

    @property
    def content(self) -> str:
        return self._calls.content if self._calls is not None else self._content

    @property
    def has_calls(self) -> bool:
        return self._calls is not None and self._calls.has_calls

    @property
    def has_open_call(self) -> bool:
        """A call whose arguments have not closed yet."""
        return self._calls is not None and self._calls.has_open_call

    def tool_calls(self) -> list[dict[str, Any]]:
        return self._calls.tool_calls() if self._calls is not None else []

    def feed(self, text: str) -> ParsedDelta:
        if self._thinking is None:
            return self._feed_content(text, final=False)
        split = self._thinking.feed(text)
        delta = self._feed_content(split.content, final=False)
        delta.reasoning = split.reasoning
        return delta

    def finish(self) -> ParsedDelta:
        """Whatever each stage held back, at the end of the output."""
        if self._thinking is None:
            return self._feed_content("", final=True)
        split = self._thinking.finish()
        delta = self._feed_content(split.content, final=True)
        delta.reasoning = split.reasoning
        return delta

    def _feed_content(self, text: str, final: bool) -> ParsedDelta:
        if self._calls is None:
            self._content += text
            return ParsedDelta(content=text)
        delta = self._calls.feed(text)
        if final:
            rest = self._calls.finish()
            delta.content += rest.content
            delta.tool_calls += rest.tool_calls
        return delta


def answer_parser(reasoning_format: ReasoningFormat | None, starts_inside: bool,
                  calls_possible: bool) -> AnswerParser | HarmonyParser:
    """The parser of one choice's output for the model's format (harmony's channels, or the
    reasoning split then the tool-call parser)."""
    if reasoning_format == HARMONY:
        return HarmonyParser(calls_possible)
    return AnswerParser(reasoning_format, starts_inside, calls_possible)
