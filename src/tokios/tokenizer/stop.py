"""Stop strings on streamed text, with hold-back so a stop string never leaks to the client.

Owns StopStringMatcher, used by the engine's output processor after the detokenizer (one per
request sequence). Talks to nobody.

A stop string can arrive split across deltas ("``" then "`"), so the tail of the text that could
still become a stop string is held back (at most longest_stop - 1 characters) until the next
delta settles it. Among several stop strings, the one that completes first in the text wins (ties:
the one starting first), which is what generating one character at a time would give, so the result
does not depend on how the text was cut into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokios.errors import InvalidRequestError


class StopStringMatcher:
    """feed(delta) -> (text safe to emit now, matched stop string or None); flush() -> held text."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        for index, stop_str in enumerate(stop):
            if not isinstance(stop_str, str) or not stop_str:
                raise InvalidRequestError(f"stop[{index}] must be a non-empty string", param="stop")
        self.stop_strs: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_held_chars = max((len(s) for s in self.stop_strs), default=1) - 1
        # Every proper prefix of every stop string: a text tail in this set may still grow into a stop.
        self._stop_prefixes = frozenset(s[:length] for s in self.stop_strs for length in range(1, len(s)))
        self._held = ""
        self.matched_stop_str: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop_str is not None

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        if self.matched_stop_str is not None or not text_delta:
            return "", None
        if not self.stop_strs:
            return text_delta, None
        # Held text never contains a whole stop string, so searching held + delta finds only new
        # matches, and the work is len(delta) + max_held_chars per stop string.
        text = self._held + text_delta
        best_end, best_start, best_stop = len(text) + 1, 0, None
        for stop_str in self.stop_strs:
            start = text.find(stop_str)
            if start < 0:
                continue
            end = start + len(stop_str)
            if end < best_end or (end == best_end and start < best_start):
                best_end, best_start, best_stop = end, start, stop_str
        if best_stop is not None:
            self._held = ""
            self.matched_stop_str = best_stop
            return text[: best_end if self.include_stop_str_in_output else best_start], best_stop
        num_held = self._num_chars_to_hold(text)
        self._held = text[len(text) - num_held :] if num_held else ""
        return text[: len(text) - num_held], None

    def _num_chars_to_hold(self, text: str) -> int:
        for length in range(min(self.max_held_chars, len(text)), 0, -1):
            if text[-length:] in self._stop_prefixes:
                return length
        return 0

    def flush(self) -> str:
        """The held tail, for a request that ended another way (EOS, max_tokens, abort)."""
        held, self._held = self._held, ""
        return held
