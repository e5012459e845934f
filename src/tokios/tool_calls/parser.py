"""ToolCallParser: generated text -> content and OpenAI tool calls, whole or while it streams.

Fed the text deltas of one choice in order, it returns what each delta adds: content text, and
tool-call deltas in OpenAI's streaming form (a call's first delta carries its index, id and
name; later ones carry argument fragments). Text that might be the start of a `<tool_call>` tag,
or of a call's end, is held back until the next delta decides it, so call text never reaches
`content` and the arguments stream holds exactly the arguments object. The non-streaming answer
feeds the whole text at once, so both answers come from the same code. The call format is
call_format.py's, which the grammar enforces; text that departs from it (possible only without
the grammar) is reported as content, never dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tokios.tool_calls.call_format import ARGUMENTS_PREFIX, CALL_END, CALL_OPEN, CALL_SEPARATOR, NAME_PREFIX

_NEXT_CALL = CALL_SEPARATOR + CALL_OPEN


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
            function = {"name": self.name, "arguments": self.arguments}
        delta["function"] = function
        return delta


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""  # what a reasoning model's thinking adds (reasoning/answer.py)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolCallParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._cursor = 0
        self._state = "content"  # content | header | arguments | between
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls so far in the shape of a chat message's `tool_calls`."""
        return [{"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}} for call in self.calls]

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        delta = ParsedDelta()
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        """Whatever was held back, at the end of the text (an unfinished call keeps its partial
        arguments: the finish reason `length` tells the client they are incomplete)."""
        delta = ParsedDelta()
        while self._step(delta, final=True):
            pass
        rest = self._buffer[self._cursor:]
        if self._state == "content" and rest:
            self._emit_content(delta, rest)
        elif self._state == "arguments" and rest:
            self._emit_arguments(delta, rest)
        self._cursor = len(self._buffer)
        return delta

    # ---- the state machine ----------------------------------------------------------------
    def _step(self, delta: ParsedDelta, final: bool) -> bool:
        """One move; False when the buffered text cannot advance the state until more arrives."""
        rest = self._buffer[self._cursor:]
        if not rest:
            return False
        if self._state == "content":
            return self._read_until(delta, rest, CALL_OPEN, self._emit_content, "header", hold_back=not final)
        if self._state == "header":
            if len(rest) < len(NAME_PREFIX):
                if not NAME_PREFIX.startswith(rest):
                    return self._not_a_call(delta)
                return False
            if not rest.startswith(NAME_PREFIX):
                return self._not_a_call(delta)
            end = rest.find(ARGUMENTS_PREFIX, len(NAME_PREFIX))
            if end < 0:
                return False
            name = rest[len(NAME_PREFIX):end]
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""}
            self.calls.append(call)
            delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], name))
            self._cursor += end + len(ARGUMENTS_PREFIX)
            self._state = "arguments"
            return True
        if self._state == "arguments":
            return self._read_until(delta, rest, CALL_END, self._emit_arguments, "between")
        # between calls: another call, or the end
        if rest.startswith(_NEXT_CALL):
            self._cursor += len(_NEXT_CALL)
            self._state = "header"
            return True
        if _NEXT_CALL.startswith(rest) and not final:
            return False
        if rest.strip():
            self._state = "content"  # text after the calls: content, as given
            return True
        self._cursor += len(rest)
        return False

    def _read_until(self, delta: ParsedDelta, rest: str, marker: str, emit, next_state: str,
                    hold_back: bool = True) -> bool:
        """Emit `rest` up to `marker` and move past it into `next_state` (True); or, with no
        marker yet, emit all of it but a tail that could begin the marker (False: wait)."""
        at = rest.find(marker)
        if at >= 0:
            emit(delta, rest[:at])
            self._cursor += at + len(marker)
            self._state = next_state
            return True
        keep = _held_back(rest, marker) if hold_back else 0
        if len(rest) > keep:
            emit(delta, rest[:len(rest) - keep])
            self._cursor += len(rest) - keep
        return False

    def _not_a_call(self, delta: ParsedDelta) -> bool:
        self._emit_content(delta, CALL_OPEN)
        self._state = "content"
        return True

    def _emit_content(self, delta: ParsedDelta, text: str) -> None:
        if text:
            delta.content += text
            self.content += text

    def _emit_arguments(self, delta: ParsedDelta, text: str) -> None:
        if not text:
            return
        self.calls[-1]["arguments"] += text
        index = len(self.calls) - 1
        if delta.tool_calls and delta.tool_calls[-1].index == index:
            delta.tool_calls[-1].arguments += text
        else:
            delta.tool_calls.append(ToolCallDelta(index, arguments=text))
