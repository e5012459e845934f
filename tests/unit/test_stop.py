"""StopStringMatcher: stop strings across delta boundaries, hold-back, several stops, flush."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError
from tokios.tokenizer import StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    """Concatenated emitted text (plus flush when no stop matched) and the matched stop."""
    emitted = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        emitted.append(text)
        if matched is not None:
            return "".join(emitted), matched
    emitted.append(matcher.flush())
    return "".join(emitted), None


def test_backticks_split_across_deltas_are_held_then_cut():
    matcher = StopStringMatcher(["```"])
    assert matcher.feed("code: ``") == ("code: ", None)  # "``" might start "```"
    assert matcher.feed("`") == ("", "```")
    assert matcher.is_stopped and matcher.matched_stop_str == "```"
    assert matcher.feed("more text") == ("", None)


def test_held_text_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopStringMatcher(["```"])
    assert matcher.feed("a ``") == ("a ", None)
    assert matcher.feed("x") == ("``x", None)


def test_double_newline_stop_split_in_two_deltas():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("First line.\n") == ("First line.", None)
    assert matcher.feed("\nSecond") == ("", "\n\n")


def test_multi_word_stop_across_many_deltas():
    matcher = StopStringMatcher(["The End."])
    emitted, matched = feed_all(matcher, ["Once upon a time. The", " E", "nd", ".", " Epilogue"])
    assert (emitted, matched) == ("Once upon a time. ", "The End.")


def test_stop_that_never_completes_is_flushed():
    matcher = StopStringMatcher(["STOP HERE"])
    text, matched = matcher.feed("we almost STOP H")
    assert matched is None and text == "we almost "
    assert matcher.flush() == "STOP H"
    assert matcher.flush() == ""


def test_hold_back_is_at_most_longest_stop_minus_one():
    matcher = StopStringMatcher(["abcdef", "xy"])
    text, _ = matcher.feed("zzzzabcde")
    assert text == "zzzz"  # "abcde": 5 = len("abcdef") - 1 characters held
    assert matcher.flush() == "abcde"


def test_earliest_completing_stop_wins_among_several():
    matcher = StopStringMatcher(["world", "lo w", "xyz"])
    assert matcher.feed("hello world") == ("hel", "lo w")


def test_same_end_prefers_the_longer_stop():
    matcher = StopStringMatcher(["bc", "abc"])
    assert matcher.feed("xabc") == ("x", "abc")


def test_include_stop_str_in_output():
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=True)
    emitted, matched = feed_all(matcher, ["42</ans", "wer> trailing"])
    assert (emitted, matched) == ("42</answer>", "</answer>")


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("bad_stop", [[""], ["ok", ""], [None], [3]])
def test_empty_or_non_string_stop_is_rejected(bad_stop):
    with pytest.raises(InvalidRequestError) as excinfo:
        StopStringMatcher(bad_stop)
    assert excinfo.value.param == "stop"


# A small alphabet makes partial and full stop matches frequent.
_ALPHABET = st.sampled_from(list("ab`\n "))
_TEXT = st.text(_ALPHABET, max_size=40)
_STOPS = st.lists(st.text(_ALPHABET, min_size=1, max_size=4), max_size=3)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, stops=_STOPS, include=st.booleans(), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_char_by_char_equals_all_at_once_equals_any_cut(text, stops, include, cuts):
    whole = feed_all(StopStringMatcher(stops, include), [text])
    by_char = feed_all(StopStringMatcher(stops, include), list(text))
    points = sorted(set(min(c, len(text)) for c in cuts))
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    by_cuts = feed_all(StopStringMatcher(stops, include), pieces)
    assert whole == by_char == by_cuts
    emitted, matched = whole
    if matched is None:
        assert emitted == text
        assert not any(stop in text for stop in stops)
    else:
        # Reference: the first position at which some stop string is complete.
        end = min(i for i in range(1, len(text) + 1) if any(text[:i].endswith(s) for s in stops))
        start = min(end - len(s) for s in stops if text[:end].endswith(s))
        assert emitted == text[: end if include else start]


def test_work_per_delta_does_not_grow_with_output_length():
    matcher = StopStringMatcher(["<stop>"])
    for _ in range(5000):
        text, matched = matcher.feed("token <sto")
        assert matched is None
        assert len(matcher._held) <= matcher.max_held_chars
