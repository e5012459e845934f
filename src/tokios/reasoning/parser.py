"""ThinkParser: a `think`-format output split into reasoning and answer, whole or while it streams.

Fed one choice's text deltas in order, it returns what each adds to the reasoning and to the
content. The output starts inside the reasoning when the prompt opened it; otherwise the model
may open it itself (`<think>` first, after any blank space), or answer at once (blank space
before the answer is dropped, as after a closed reasoning block). Text that may be
the start of a marker, and blank space at either end of the reasoning or at the start of the
answer, is held back until more text decides it, so a marker split across tokens or deltas is
never shown and the streamed split equals the whole one. A reasoning block the output never
closes is reasoning to its end (a `length` finish cut it short). Anything after the close is
content, `<think>` included: the reasoning is the first block only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokios.reasoning.formats import ReasoningFormat
from tokios.tool_calls.parser import held_back

OPENING, REASONING, ANSWER_START, CONTENT = range(4)


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ThinkParser:
    def __init__(self, reasoning_format: ReasoningFormat, starts_inside: bool):
        self.format = reasoning_format
        self._state = REASONING if starts_inside else OPENING
        self._buffer = ""  # text not yet decided
        self._reasoning_started = False  # leading blank space of the reasoning is dropped
        self.reasoning = ""
        self.content = ""

    @property
    def is_reasoning(self) -> bool:
        return self._state == REASONING

    def feed(self, text: str) -> ReasoningSplit:
        self._buffer += text
        split = ReasoningSplit()
        self._advance(split, final=False)
        return split

    def finish(self) -> ReasoningSplit:
        split = ReasoningSplit()
        self._advance(split, final=True)
        if self._buffer:
            if self._state == REASONING:
                self._emit_reasoning(split, self._buffer.rstrip())
            elif self._state in (OPENING, CONTENT):
                self._emit_content(split, self._buffer)
            self._buffer = ""
        return split

    def _advance(self, split: ReasoningSplit, final: bool) -> None:
        start, end = self.format.start, self.format.end
        while self._buffer:
            if self._state == OPENING:
                stripped = self._buffer.lstrip()
                if stripped.startswith(start):
                    self._buffer = stripped[len(start):]
                    self._state = REASONING
                elif not final and start.startswith(stripped):
                    return  # blank space or a part of the marker so far: wait
                else:
                    # No thinking: the answer, without the blank space a template's closed
                    # thinking block leaves before it.
                    self._buffer = stripped
                    self._state = CONTENT
            elif self._state == REASONING:
                if not self._reasoning_started:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        return
                    self._reasoning_started = True
                at = self._buffer.find(end)
                if at >= 0:
                    self._emit_reasoning(split, self._buffer[:at].rstrip())
                    self._buffer = self._buffer[at + len(end):]
                    self._state = ANSWER_START
                    continue
                # Hold back a possible start of the close, and trailing blank space (dropped if
                # the close follows it).
                keep = held_back(self._buffer, end)
                body = self._buffer[:len(self._buffer) - keep]
                settled = body.rstrip()
                self._emit_reasoning(split, settled)
                self._buffer = self._buffer[len(settled):]
                return
            elif self._state == ANSWER_START:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    return
                self._state = CONTENT
            else:
                self._emit_content(split, self._buffer)
                self._buffer = ""

    def _emit_reasoning(self, split: ReasoningSplit, text: str) -> None:
        if text:
            split.reasoning += text
            self.reasoning += text

    def _emit_content(self, split: ReasoningSplit, text: str) -> None:
        if text:
            split.content += text
            self.content += text
