"""HarmonyParser (reasoning/harmony.py) on gpt-oss's output text: the cases of llama.cpp's chat
tests for gpt-oss that apply (tests/test-chat.cpp, "GPT-OSS format tests"), the ends of the
output (`<|call|>`, `<|return|>`), text that departs from the format, and the streamed split at
every position equal to the whole one."""

from __future__ import annotations

import pytest

from tokios.reasoning import HARMONY, THINK, AnswerParser, answer_parser
from tokios.reasoning.harmony import HarmonyParser

THINKING = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?"
ARGS = '{"arg1": 1}'

# (output, calls_possible, expected reasoning, expected content, expected calls [(name, arguments)])
CASES = {
    # llama.cpp's cases
    "final channel": ("<|channel|>final<|message|>Hello, world!\nWhat's up?", False, "",
                      "Hello, world!\nWhat's up?", []),
    "commentary channel": ("<|channel|>commentary<|message|>Hello, world!\nWhat's up?", False, "",
                           "Hello, world!\nWhat's up?", []),
    "analysis then final": (THINKING + FINAL, False, "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    "analysis cut short": ("<|channel|>analysis<|message|>I'm\nthinking", False, "I'm\nthinking", "", []),
    "recipient in the role header": (f" to=functions.special_function<|channel|>analysis<|message|>{ARGS}", True,
                                     "", "", [("special_function", ARGS)]),
    "recipient in the channel header": (f"<|channel|>analysis to=functions.special_function<|message|>{ARGS}",
                                        True, "", "", [("special_function", ARGS)]),
    "constrained": (f" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{ARGS}", True,
                    "", "", [("special_function", ARGS)]),
    "commentary call": (f"<|channel|>commentary to=functions.special_function<|message|>{ARGS}", True, "", "",
                        [("special_function", ARGS)]),
    "analysis then call": (THINKING + f"<|start|>assistant to=functions.special_function<|channel|>analysis"
                           f"<|message|>{ARGS}", True, "I'm\nthinking", "", [("special_function", ARGS)]),
    "edit call": ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary"
                  ' to=functions.edit <|constrain|>json<|message|>{"oldString": "if (part < railCount - 1) {", '
                  '"newString": "if (part < 4) {", "replaceAll": false}', True, "Thinking about edit...", "",
                  [("edit", '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
                            '"replaceAll": false}')]),
    "structured final": ("<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
                         '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45}', False,
                         "I need to output the invoice details in JSON", '{"amount": 123.45}', []),
    "built-in tool, recipient in the role": (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant to=container.exec"
        "<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'", True, "I will execute python to say hello",
        "", []),
    "built-in tool, recipient in the channel": (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant<|channel|>"
        "commentary to=python <|constrain|>code<|message|>print(\"hello\")", True,
        "I will execute python to say hello", "", []),
    "to=assistant before the reasoning": ("<|channel|>commentary to=assistant" + THINKING + FINAL, False,
                                          "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    "to=assistant before the answer": (
        THINKING + "<|start|>assistant<|channel|>commentary to=assistant<|channel|>final<|message|>Hello", False,
        "I'm\nthinking", "Hello", []),
    # the ends of the output, as the model writes them
    "final with its return": (THINKING + FINAL + "<|return|>", False, "I'm\nthinking", "Hello, world!\nWhat's up?",
                              []),
    "call with its end": (THINKING + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                          '<|constrain|>json<|message|>{"city":"Paris \\"Nord\\"","at":{"day":[1,2]}}<|call|>', True,
                          "I'm\nthinking", "", [("get_weather", '{"city":"Paris \\"Nord\\"","at":{"day":[1,2]}}')]),
    "preamble then call": (THINKING + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
                           "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>", True,
                           "I'm\nthinking", "Checking.", [("f", "{}")]),
    "two analysis messages": (THINKING + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + FINAL,
                              False, "I'm\nthinking\n\nMore.", "Hello, world!\nWhat's up?", []),
    "a call without tools is dropped": (THINKING + f"<|start|>assistant to=functions.f<|channel|>commentary"
                                        f"<|message|>{ARGS}<|call|>", False, "I'm\nthinking", "", []),
    "an empty call": ("<|channel|>commentary to=functions.ping <|constrain|>json<|message|><|call|>", True, "", "",
                      [("ping", "")]),
    # text that departs from the format is content
    "plain text": ("Just text, no markers", False, "", "Just text, no markers", []),
    "text then markers": ("Hi there\n<|end|><|start|>assistant<|channel|>final<|message|>ok", False, "",
                          "Hi there\n\n\nok", []),
    "text before an end": ("Hi<|end|>", False, "", "Hi", []),
    "header cut short": ("<|channel|>analy", False, "", "", []),
    "recipient cut short": (" to=functions.get_wea", True, "", "", []),
}


def _run(parser: HarmonyParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """The concatenated deltas of feeding `pieces` then finishing: (reasoning, content, calls, ids)."""
    reasoning, content, calls = "", "", {}
    for delta in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls
                calls[call.index] = [call.id, call.name, ""]
            calls[call.index][2] += call.arguments
    assert sorted(calls) == list(range(len(calls)))
    return reasoning, content, [(name, arguments) for _, name, arguments in calls.values()], [
        call_id for call_id, _, _ in calls.values()]


@pytest.mark.parametrize("name", CASES)
def test_whole_output(name):
    text, calls_possible, reasoning, content, calls = CASES[name]
    parser = HarmonyParser(calls_possible)
    got_reasoning, got_content, got_calls, ids = _run(parser, [text])
    assert (got_reasoning, got_content, got_calls) == (reasoning, content, calls)
    assert (parser.reasoning, parser.content, parser.has_calls) == (reasoning, content, bool(calls))
    assert [(call["id"], call["function"]["name"], call["function"]["arguments"])
            for call in parser.tool_calls()] == [(i, n, a) for i, (n, a) in zip(ids, calls)]


@pytest.mark.parametrize("name", CASES)
def test_split_at_every_position_equals_the_whole(name):
    text, calls_possible, reasoning, content, calls = CASES[name]
    for position in range(len(text) + 1):
        got = _run(HarmonyParser(calls_possible), [text[:position], text[position:]])[:3]
        assert got == (reasoning, content, calls), position
    assert _run(HarmonyParser(calls_possible), list(text))[:3] == (reasoning, content, calls)


def test_no_marker_text_is_shown_while_it_streams():
    """A delta never shows a part of a marker: the held-back text waits for the next one."""
    text = CASES["call with its end"][0] + CASES["analysis then final"][0]
    parser = HarmonyParser(True)
    for character in text:
        delta = parser.feed(character)
        shown = delta.reasoning + delta.content + "".join(call.arguments for call in delta.tool_calls)
        assert "<|" not in shown and "|>" not in shown


def test_is_reasoning_only_inside_an_analysis_body():
    parser = HarmonyParser(False)
    parser.feed("<|channel|>analysis<|mess")
    assert not parser.is_reasoning
    parser.feed("age|>still thinking")
    assert parser.is_reasoning
    parser.feed("<|end|><|start|>assistant<|channel|>final<|message|>ok")
    assert not parser.is_reasoning


def test_the_factory_picks_the_parser_of_the_format():
    assert isinstance(answer_parser(HARMONY, False, True), HarmonyParser)
    assert isinstance(answer_parser(THINK, True, True), AnswerParser)
    assert isinstance(answer_parser(None, False, False), AnswerParser)
