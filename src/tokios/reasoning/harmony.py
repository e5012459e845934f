"""HarmonyParser: gpt-oss's harmony output -> reasoning, content and tool calls, whole or streamed.

gpt-oss writes its answer as messages (OpenAI's harmony format). The output starts after the
template's `<|start|>assistant`; each message is a header, `<|message|>`, and a body:

    <|channel|>analysis<|message|>BODY<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
    <|start|>assistant<|channel|>final<|message|>BODY<|return|>

The recipient (`to=...`) may stand before the channel too (`<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`, the form the template renders past calls in). `<|end|>`
ends a message and the next one follows; `<|call|>` (a tool call) and `<|return|>` (the final
answer) end the output. The markers are special tokens the server shows in the decoded text
(Serving._reasoning_format).

By channel and recipient: `analysis` is reasoning; `final`, and `commentary` without a recipient
(a preamble before calls), are content; a message to `functions.NAME`, in whichever channel, is a
call of NAME whose arguments stream as they come; a message to any other recipient (the built-in
browser and python tools, which we do not run) is dropped, as llama.cpp drops it. Messages of one
kind are joined by a blank line. Text that departs from the format (possible only without the
tool-call grammar: a header that never reaches `<|message|>`) is content, never dropped.

The same interface as AnswerParser (answer.py), so ChatRun reads both alike. As there, text that
may be the start of a marker is held back until more text decides it, so the streamed split
equals the whole one.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from tokios.tool_calls.parser import ParsedDelta, ToolCallDelta, held_back, openai_tool_calls

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
FUNCTIONS_PREFIX = "functions."
# What ends a message's body. `<|start|>` without an `<|end|>` before it still opens the next
# message (a model that skips the end).
_BODY_ENDS = (END, CALL, RETURN, START)
# Longer than any header gpt-oss writes (a function name, a channel and a constraint): a header
# that runs past it, or over a line break, is text, not a header.
MAX_HEADER_CHARS = 256
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_LEADING_RECIPIENT = re.compile(r"^ to=[^\s<]*")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")

HEADER, BODY, BETWEEN = range(3)
REASONING, CONTENT, CALL_ARGUMENTS, DROPPED = range(4)  # what a body is



def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """(position, marker) of the first of `markers` in `text`; (-1, None) if none is there."""
    found = (-1, None)
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (found[1] is None or at < found[0]):
            found = (at, marker)
    return found


def _looks_like_header(text: str) -> bool:
    """Whether `text` (a header the output ended in) is the start of a header rather than text."""
    rest = _LEADING_RECIPIENT.sub("", text.removeprefix("assistant"), count=1)
    return not rest or rest.startswith((CHANNEL, CONSTRAIN)) or any(
        marker.startswith(rest) for marker in (CHANNEL, CONSTRAIN, " to="))


class HarmonyParser:
    def __init__(self, calls_possible: bool):
        self._calls_possible = calls_possible
        self._state = HEADER
        self._kind = CONTENT  # the body being read
        self._buffer = ""  # text not yet decided
        self._has_body_text = False  # whether the body being read has shown text yet
        self.reasoning = ""
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}

    # ---- AnswerParser's interface ---------------------------------------------------------------
    @property
    def is_reasoning(self) -> bool:
        """Inside an analysis message the output has not ended (yet)."""
        return self._state == BODY and self._kind == REASONING

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def tool_calls(self) -> list[dict[str, Any]]:
        return openai_tool_calls(self.calls)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        delta = ParsedDelta()
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        """Whatever was held back, at the end of the output: a body cut short keeps its text (a
        `length` finish says so); a header cut short is dropped, unless it was text."""
        delta = ParsedDelta()
        while self._step(delta, final=True):
            pass
        if self._state == BODY:
            self._emit_body(delta, self._buffer)
        elif self._state == HEADER and not _looks_like_header(self._buffer):
            self._emit_body(delta, self._buffer)
        self._buffer = ""
        return delta

    # ---- the state machine ------------------------------------------------------------------------
    def _step(self, delta: ParsedDelta, final: bool) -> bool:
        """One move; False when the buffered text cannot advance the state until more arrives."""
        if not self._buffer:
            return False
        if self._state == BETWEEN:
            if self._buffer.startswith(START):
                self._buffer = self._buffer[len(START):]
            elif START.startswith(self._buffer) and not final:
                return False
            self._state = HEADER
            return True
        if self._state == HEADER:
            return self._read_header(delta)
        return self._read_body(delta, final)

    def _read_header(self, delta: ParsedDelta) -> bool:
        at, marker = _first_of(self._buffer, (MESSAGE, *_BODY_ENDS))
        if marker == MESSAGE:
            self._open_body(delta, self._buffer[:at])
            self._buffer = self._buffer[at + len(MESSAGE):]
            return True
        header = self._buffer if at < 0 else self._buffer[:at]
        if at >= 0 or "\n" in header or len(header) > MAX_HEADER_CHARS:
            # Not a header: text, up to whatever ends it.
            self._state, self._kind, self._has_body_text = BODY, CONTENT, False
            return True
        return False

    def _open_body(self, delta: ParsedDelta, header: str) -> None:
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else ""
        recipients = [recipient for recipient in _RECIPIENT.findall(header) if recipient != "assistant"]
        recipient = recipients[-1] if recipients else None
        self._state, self._has_body_text = BODY, False
        if recipient is not None:
            if recipient.startswith(FUNCTIONS_PREFIX) and self._calls_possible:
                self._kind = CALL_ARGUMENTS
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": recipient[len(FUNCTIONS_PREFIX):],
                        "arguments": ""}
                self.calls.append(call)
                delta.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], call["name"]))
            else:
                self._kind = DROPPED
        else:
            self._kind = REASONING if channel == "analysis" else CONTENT

    def _read_body(self, delta: ParsedDelta, final: bool) -> bool:
        at, marker = _first_of(self._buffer, _BODY_ENDS)
        if marker is not None:
            self._emit_body(delta, self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            self._state = HEADER if marker == START else BETWEEN
            return True
        keep = 0 if final else held_back(self._buffer, *_BODY_ENDS)
        self._emit_body(delta, self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _emit_body(self, delta: ParsedDelta, text: str) -> None:
        if self._kind == CALL_ARGUMENTS:
            self._emit_arguments(delta, text)
            return
        if not text or self._kind == DROPPED:
            return
        if self._kind == REASONING:
            separator = "\n\n" if self.reasoning and not self._has_body_text else ""
            delta.reasoning += separator + text
            self.reasoning += separator + text
        else:
            separator = "\n\n" if self.content and not self._has_body_text else ""
            delta.content += separator + text
            self.content += separator + text
        self._has_body_text = True

    def _emit_arguments(self, delta: ParsedDelta, text: str) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        self.calls[-1]["arguments"] += text
        if delta.tool_calls and delta.tool_calls[-1].index == index:
            delta.tool_calls[-1].arguments += text
        else:
            delta.tool_calls.append(ToolCallDelta(index, arguments=text))
