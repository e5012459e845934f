"""ToolCallParser: generated text -> content and OpenAI tool calls, whole or while it streams.

Fed the text deltas of one choice in order, it returns what each delta adds: content text, and
tool-call deltas in OpenAI's streaming form (a call's first delta carries its index, id and
name; later ones carry argument fragments). The non-streaming answer feeds the whole text at
once, so both answers come from the same code, and a text fed in any pieces gives the same
content and calls as fed whole:

- content that might be the start of a `<tool_call>` tag is held back until the next delta
  decides it, and so is trailing whitespace, because whitespace right before a call is the
  call's separator, not content (llama.cpp parses "Hi\n<tool_call>..." to the content "Hi");
- a call's arguments stream as they arrive: the parser follows the JSON object (nesting,
  strings, escapes) to find its closing brace, so a `</tool_call>` or `}` inside a string
  argument never ends the call;
- after the arguments, the wrapper's `}` and `</tool_call>` (with or without the newline our
  grammar writes: Hermes 2 Pro and Reka write none), then, between calls, any whitespace.

The call format is call_format.py's, which the grammar enforces; text that departs from it
(possible only without the grammar) is reported as content, never dropped.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokios.tool_calls.call_format import ARGUMENTS_PREFIX, CALL_CLOSE, CALL_OPEN, NAME_PREFIX

# After a call's arguments object: the wrapper's brace, optional whitespace, the closing tag.
_CALL_TAIL = re.compile(r"\}\s*" + re.escape(CALL_CLOSE))


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> list[dict[str, Any]]:
        """OpenAI's streamed form: a call's first delta carries its id, type, name and
        `arguments: ""` (as OpenAI's own stream does); its arguments follow in later deltas. So
        a first delta that already holds arguments is two, for two chunks."""
        if self.id is None:
            return [{"index": self.index, "function": {"arguments": self.arguments}}]
        header = {"index": self.index, "id": self.id, "type": "function",
                  "function": {"name": self.name, "arguments": ""}}
        if not self.arguments:
            return [header]
        return [header, {"index": self.index, "function": {"arguments": self.arguments}}]


def openai_tool_call_chunks(calls: list[ToolCallDelta]) -> list[list[dict[str, Any]]]:
    """The `tool_calls` of successive OpenAI stream chunks for one parsed delta: each chunk
    names a call at most once, as OpenAI's stream does."""
    chunks: list[list[dict[str, Any]]] = [[]]
    for call in calls:
        for entry in call.as_openai():
            if any(existing["index"] == entry["index"] for existing in chunks[-1]):
                chunks.append([])
            chunks[-1].append(entry)
    return chunks


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""  # what a reasoning model's thinking adds (reasoning/answer.py)


def held_back(text: str, *markers: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: what a
    streaming parser keeps until the next delta says whether a marker begins there."""
    longest = 0
    for marker in markers:
        for length in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-length:]):
                longest = length
                break
    return longest


def openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed calls ({"id", "name", "arguments"}) in the shape of a chat message's `tool_calls`."""
    return [{"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}} for call in calls]


class ToolCallParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._cursor = 0
        self._state = "content"  # content | header | arguments | tail | between
        # Where the arguments scan is in the JSON: object depth, inside a string, after a backslash.
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False
        self._separator = ""  # the whitespace before the last `<tool_call>`
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    @property
    def has_open_call(self) -> bool:
        """The last call's arguments were cut short (incomplete JSON). A call cut in its header is
        not among the calls; one cut after its arguments closed is whole to the client."""
        return self._state == "arguments"

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls so far in the shape of a chat message's `tool_calls`."""
        return openai_tool_calls(self.calls)

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
        if self._state == "content":
            self._emit_content(delta, rest)
        # A call cut inside its header is dropped: it names no function yet, and its text is
        # call text, which never goes into content.
        self._cursor = len(self._buffer)
        return delta

    # ---- the state machine ----------------------------------------------------------------
    def _step(self, delta: ParsedDelta, final: bool) -> bool:
        """One move; False when the buffered text cannot advance the state until more arrives."""
        rest = self._buffer[self._cursor:]
        if not rest:
            return False
        if self._state == "content":
            return self._read_content(delta, rest, final)
        if self._state == "header":
            return self._read_header(delta, rest)
        if self._state == "arguments":
            return self._read_arguments(delta, rest)
        if self._state == "tail":
            match = _CALL_TAIL.match(rest)
            if match:
                self._cursor += match.end()
                self._state = "between"
                return True
            if not final and _could_begin_tail(rest):
                return False
            self._state = "content"  # not our format: the text stays content
            return True
        # between calls: whitespace, then another call or the end
        stripped = rest.lstrip()
        if stripped.startswith(CALL_OPEN):
            self._cursor += len(rest) - len(stripped) + len(CALL_OPEN)
            self._state = "header"
            return True
        if not stripped or (CALL_OPEN.startswith(stripped) and not final):
            if final:
                self._cursor += len(rest)
            return False
        self._state = "content"  # text after the calls: content, as given
        return True

    def _read_content(self, delta: ParsedDelta, rest: str, final: bool) -> bool:
        at = rest.find(CALL_OPEN)
        if at >= 0:
            before = rest[:at].rstrip()
            self._emit_content(delta, before)
            self._separator = rest[len(before):at]  # given back if no call follows the tag
            self._cursor += at + len(CALL_OPEN)
            self._state = "header"
            return True
        if final:
            return False  # finish() emits the rest
        keep = held_back(rest, CALL_OPEN)
        ready = rest[:len(rest) - keep].rstrip()
        self._emit_content(delta, ready)
        self._cursor += len(ready)
        return False

    def _read_header(self, delta: ParsedDelta, rest: str) -> bool:
        if not (rest.startswith(NAME_PREFIX) or NAME_PREFIX.startswith(rest)):
            self._emit_content(delta, self._separator + CALL_OPEN)
            self._state = "content"
            return True
        end = rest.find(ARGUMENTS_PREFIX, len(NAME_PREFIX))
        if end < 0:
            return False
        name = rest[len(NAME_PREFIX):end]
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""}
        self.calls.append(call)
        delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], name))
        self._cursor += end + len(ARGUMENTS_PREFIX)
        self._state = "arguments"
        self._depth, self._is_in_string, self._is_escaped = 0, False, False
        return True

    def _read_arguments(self, delta: ParsedDelta, rest: str) -> bool:
        """Emit the arguments up to the brace that closes the object (True), or all of `rest`
        when the object is still open (False: wait for more)."""
        for position, char in enumerate(rest):
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._is_in_string = False
            elif char == '"':
                self._is_in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._emit_arguments(delta, rest[:position + 1])
                    self._cursor += position + 1
                    self._state = "tail"
                    return True
        self._emit_arguments(delta, rest)
        self._cursor += len(rest)
        return False

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


def _could_begin_tail(text: str) -> bool:
    """Whether more text could make `text` a call's tail (`}`, whitespace, `</tool_call>`)."""
    return text.startswith("}") and CALL_CLOSE.startswith(text[1:].lstrip())
