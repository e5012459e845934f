"""Reasoning without the model: the think-format split (streamed at every pair of split points
equals whole), the answer parser's order (reasoning first, then calls), the thinking budget's
state machine and masks, how a request's thinking resolves against a template, format detection
over llama.cpp's real templates, and the tool-call grammar with a reasoning block in front."""

from __future__ import annotations

import pytest
import torch

from tokios.errors import InvalidRequestError
from tests.unit.test_structured import compiler, tokenizer  # noqa: F401 (fixtures: SmolLM2's vocabulary)
from tokios.model_files import llama_cpp_sources
from tokios.reasoning import (HARMONY, THINK, AnswerParser, BudgetMatcher, ThinkingBudget, ThinkingRequest,
                              detect_reasoning_format, plan_thinking, resolve_reasoning_format)
from tokios.reasoning.grammar import reasoning_rules
from tokios.reasoning.parser import ThinkParser
from tokios.tool_calls import ToolSet
from tokios.tool_calls.grammar import tool_call_grammar

THINK_CASES = [
    # (output, prompt opened the thinking, reasoning, content)
    ("Let me think.\n\n</think>\n\nThe answer is 4.", True, "Let me think.", "The answer is 4."),
    ("<think>\nhmm, a < b and </thin is not the end</think>4", False, "hmm, a < b and </thin is not the end", "4"),
    ("\n\n<think>x</think>\n\ny", False, "x", "y"),
    ("Just 4.", False, "", "Just 4."),
    ("\n\nJust 4.", False, "", "Just 4."),
    ("<thin", False, "", "<thin"),
    ("cut short in the middle of </thi", True, "cut short in the middle of </thi", ""),
    ("a\n\n b \n</think>", True, "a\n\n b", ""),
    ("r</think>answer with <think>inside</think>", True, "r", "answer with <think>inside</think>"),
    ("«ü» ünïcode</think>\n«ok»", True, "«ü» ünïcode", "«ok»"),
    ("", True, "", ""),
    # llama.cpp's expected parses (tests/test-chat.cpp: QwQ, Qwen3.5, and a model-opened block)
    ("Let me think about this...\n</think>\nThe answer is 42.", True, "Let me think about this...",
     "The answer is 42."),
    ("</think>Hello, world!", True, "", "Hello, world!"),
    ("I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", True, "I'm\nthinking", "Hello, world!\nWhat's up?"),
    ("<think>I'm\nthinking</think>Hello, world!\nWhat's up?", False, "I'm\nthinking", "Hello, world!\nWhat's up?"),
]


def split_in_three(parser, text: str, i: int, j: int) -> tuple[str, str]:
    parts = [parser.feed(text[:i]), parser.feed(text[i:j]), parser.feed(text[j:]), parser.finish()]
    return "".join(part.reasoning for part in parts), "".join(part.content for part in parts)


@pytest.mark.parametrize("text,starts_inside,reasoning,content", THINK_CASES)
def test_think_split_streamed_at_every_two_points_equals_whole(text, starts_inside, reasoning, content):
    whole = ThinkParser(THINK, starts_inside)
    first, rest = whole.feed(text), whole.finish()
    assert (first.reasoning + rest.reasoning, first.content + rest.content) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split_in_three(ThinkParser(THINK, starts_inside), text, i, j) == (reasoning, content), (i, j)


def test_think_parser_never_shows_a_marker_that_is_still_arriving():
    parser = ThinkParser(THINK, starts_inside=True)
    assert parser.feed("thinking </").reasoning == "thinking"
    assert parser.feed("think").reasoning == ""
    assert parser.is_reasoning
    split = parser.feed(">\n\nanswer")
    assert (split.reasoning, split.content, parser.is_reasoning) == ("", "answer", False)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"nord\\""}}\n</tool_call>'


def test_call_shaped_text_inside_the_reasoning_is_reasoning_and_a_call_after_it_is_a_call():
    text = f"I could write {CALL} here.</think>\n\n{CALL}"
    whole = AnswerParser(THINK, starts_inside=True, calls_possible=True)
    whole.feed(text)
    whole.finish()
    assert whole.reasoning == f"I could write {CALL} here."
    assert whole.content == "" and whole.has_calls
    assert [call["function"] for call in whole.tool_calls()] == [
        {"name": "get_weather", "arguments": '{"city": "Paris \\"nord\\""}'}]
    for cut in range(len(text) + 1):
        streamed = AnswerParser(THINK, starts_inside=True, calls_possible=True)
        deltas = [streamed.feed(text[:cut]), streamed.feed(text[cut:]), streamed.finish()]
        assert "".join(delta.reasoning for delta in deltas) == whole.reasoning
        arguments = "".join(call.arguments for delta in deltas for call in delta.tool_calls)
        assert arguments == '{"city": "Paris \\"nord\\""}'


def test_without_a_reasoning_format_everything_is_content():
    parser = AnswerParser(None, starts_inside=False, calls_possible=False)
    assert parser.feed("<think>x</think>y").content == "<think>x</think>y"
    assert parser.reasoning == "" and not parser.is_reasoning


# ---- the budget --------------------------------------------------------------------------------
START, END, FORCED, EOS = (7, 8), (9,), (50, 9, 51), 2
VOCAB = 64


def budget(max_thinking_tokens, starts_inside=True, stop_ids=(EOS,)):
    return ThinkingBudget(max_thinking_tokens, START, END, FORCED, starts_inside, stop_ids)


def allowed(matcher: BudgetMatcher, proposals=()) -> list[set[int]]:
    bitmask = torch.zeros(len(proposals) + 1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_mask(bitmask, 0, list(proposals))
    return [{token for token in range(VOCAB) if int(row[token // 32]) >> (token % 32) & 1} for row in bitmask]


def test_budget_forces_the_end_once_spent_and_never_lets_the_thinking_stop():
    matcher = BudgetMatcher(budget(3))
    for token_id in (20, 21):
        assert EOS not in allowed(matcher)[0]
        matcher.accept(token_id)
    matcher.accept(22)
    assert matcher.num_thinking_tokens == 3
    for forced in FORCED:
        assert allowed(matcher)[0] == {forced}
        matcher.accept(forced)
    assert not matcher.is_thinking
    assert allowed(matcher)[0] == set(range(VOCAB))  # answering: anything, EOS included


def test_a_model_that_closes_its_thinking_itself_is_never_forced():
    matcher = BudgetMatcher(budget(3))
    matcher.accept(20)
    matcher.accept(END[0])
    assert not matcher.is_thinking
    for token_id in range(10, 20):
        matcher.accept(token_id)
        assert allowed(matcher)[0] == set(range(VOCAB))


def test_thinking_the_model_opens_itself_counts_from_its_start():
    matcher = BudgetMatcher(budget(1, starts_inside=False))
    assert allowed(matcher)[0] == set(range(VOCAB))  # not thinking yet: may even stop
    matcher.accept(START[0])
    matcher.accept(START[1])
    assert matcher.is_thinking and EOS not in allowed(matcher)[0]
    matcher.accept(30)
    assert allowed(matcher)[0] == {FORCED[0]}


def test_a_zero_budget_closes_at_once_and_no_budget_never_forces():
    assert allowed(BudgetMatcher(budget(0)))[0] == {FORCED[0]}
    unlimited = BudgetMatcher(budget(None))
    for token_id in range(10, 40):
        unlimited.accept(token_id)
    assert allowed(unlimited)[0] == set(range(VOCAB)) - {EOS}


def test_speculative_rows_and_proposals_follow_the_same_machine():
    matcher = BudgetMatcher(budget(2))
    # proposals 20, 21 spend the budget: the third row may only be the first forced id
    rows = allowed(matcher, proposals=(20, 21))
    assert EOS not in rows[0] and EOS not in rows[1] and rows[2] == {FORCED[0]}
    assert matcher.valid_prefix([20, 21, 22]) == [20, 21]
    assert matcher.valid_prefix([20, 21, FORCED[0], FORCED[1]]) == [20, 21, FORCED[0], FORCED[1]]
    assert matcher.valid_prefix([20, EOS]) == [20]
    assert matcher.num_thinking_tokens == 0  # nothing was consumed


def test_a_negative_budget_is_a_400():
    with pytest.raises(InvalidRequestError, match="budget"):
        budget(-1)


# ---- a request's thinking against a template ---------------------------------------------------
QWEN3_VARIABLES = frozenset({"messages", "tools", "enable_thinking", "add_generation_prompt"})
GPT_OSS_VARIABLES = frozenset({"messages", "tools", "reasoning_effort", "builtin_tools", "model_identity"})


@pytest.mark.parametrize("request_,variables,template_kwargs,max_thinking_tokens", [
    (ThinkingRequest(), QWEN3_VARIABLES, {"enable_thinking": True}, None),
    (ThinkingRequest.from_effort("low"), QWEN3_VARIABLES, {"enable_thinking": True}, 1024),
    (ThinkingRequest.from_effort("high", max_thinking_tokens=77), QWEN3_VARIABLES, {"enable_thinking": True}, 77),
    (ThinkingRequest.from_effort("none"), QWEN3_VARIABLES, {"enable_thinking": False}, None),
    # a template that cannot turn thinking off: the budget closes it at once
    (ThinkingRequest.from_effort("none"), GPT_OSS_VARIABLES, {}, 0),
    (ThinkingRequest.from_effort("minimal"), GPT_OSS_VARIABLES, {"reasoning_effort": "low"}, 256),
    (ThinkingRequest.from_effort("medium"), GPT_OSS_VARIABLES, {"reasoning_effort": "medium"}, 4096),
])
def test_plan_thinking(request_, variables, template_kwargs, max_thinking_tokens):
    plan = plan_thinking(request_, THINK, variables)
    assert plan.template_kwargs == template_kwargs
    assert plan.max_thinking_tokens == max_thinking_tokens


def test_a_model_without_a_reasoning_format_refuses_to_think_and_may_be_told_not_to():
    with pytest.raises(InvalidRequestError, match="no reasoning format") as error:
        plan_thinking(ThinkingRequest.from_effort("low"), None, QWEN3_VARIABLES)
    assert error.value.param == "reasoning_effort"
    assert plan_thinking(ThinkingRequest.from_effort("none"), None, QWEN3_VARIABLES).template_kwargs == {}
    assert plan_thinking(ThinkingRequest(), None, QWEN3_VARIABLES).max_thinking_tokens is None


def test_bad_efforts_and_contradictions_are_400s_naming_the_field():
    with pytest.raises(InvalidRequestError, match="reasoning_effort must be one of"):
        ThinkingRequest.from_effort("extreme")
    with pytest.raises(InvalidRequestError, match="contradicts") as error:
        ThinkingRequest.from_effort("high").with_template_switch({"enable_thinking": False})
    assert error.value.param == "chat_template_kwargs"
    switched = ThinkingRequest().with_template_switch({"enable_thinking": False})
    assert switched.is_enabled is False


# ---- detection over the real templates -----------------------------------------------------------
def templates() -> dict[str, str]:
    folder = llama_cpp_sources() / "models" / "templates"
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.jinja"))}


def test_formats_detected_from_llama_cpps_templates():
    sources = templates()
    expected = {"Qwen-QwQ-32B": THINK, "Qwen-Qwen3-0.6B": THINK, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": THINK,
                "openai-gpt-oss-120b": HARMONY, "meta-llama-Llama-3.1-8B-Instruct": None,
                "Qwen-Qwen2.5-7B-Instruct": None, "google-gemma-2-2b-it": None}
    for name, reasoning_format in expected.items():
        assert detect_reasoning_format(sources[name], frozenset()) is reasoning_format, name
    detected = {name for name, source in sources.items() if detect_reasoning_format(source, frozenset())}
    assert len(detected) >= 30  # the thinking models of the collection (30 at the pinned sources)
    # no template: the vocabulary decides; the flag overrides both
    assert detect_reasoning_format(None, frozenset({"<think>", "</think>"})) is THINK
    assert resolve_reasoning_format("none", sources["Qwen-Qwen3-0.6B"], frozenset()) is None
    assert resolve_reasoning_format("harmony", None, frozenset()) is HARMONY


def test_templates_that_open_the_thinking_in_the_prompt():
    assert THINK.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not THINK.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.prompt_opens_reasoning("<|im_start|>assistant\n")


# ---- the tool-call grammar with the thinking first ------------------------------------------------

TOOLS = ToolSet.from_request([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], None, None)


def accepts(compiler, tokenizer, grammar, text: str) -> bool:
    matcher = compiler.compile(grammar).new_matcher()
    return all(matcher._matcher.consume_token(token_id)
               for token_id in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting


@pytest.mark.parametrize("starts_inside", [True, False])
def test_the_grammar_lets_the_thinking_through_before_the_answer(compiler, tokenizer, starts_inside):
    grammar = tool_call_grammar(TOOLS, reasoning_rules(THINK, starts_inside, None, None))
    opening = "" if starts_inside else "<think>"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # a half-written call inside the thinking is thinking, not a call the grammar must complete
    assert accepts(compiler, tokenizer, grammar, f"{opening}maybe <tool_call> then</think>\n\n{call}")
    assert accepts(compiler, tokenizer, grammar, f"{opening}no call needed</think>\n\nIt is sunny.")
    assert not accepts(compiler, tokenizer, grammar, f"{opening}x</think>\n\n<tool_call>\n{{\"name\": \"nope\"")
    required = ToolSet.from_request(TOOLS and [TOOLS.functions[0].as_tool()], "required", None)
    grammar = tool_call_grammar(required, reasoning_rules(THINK, starts_inside, None, None))
    assert accepts(compiler, tokenizer, grammar, f"{opening}thinking</think>\n\n{call}")
    assert not accepts(compiler, tokenizer, grammar, f"{opening}thinking</think>\n\nIt is sunny.")


def test_a_response_formats_grammar_starts_with_the_answer_behind_an_opened_thinking(compiler, tokenizer):
    from tokios.structured import StructuredOutput

    end_ids = tuple(tokenizer.encode(THINK.end, add_special_tokens=False))
    forced_ids = tuple(tokenizer.encode(THINK.forced_end, add_special_tokens=False))
    eos = tuple(sorted(tokenizer.eos_token_ids))
    schema = StructuredOutput.json({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def matcher(max_thinking_tokens):
        budget = ThinkingBudget(max_thinking_tokens, tuple(tokenizer.encode(THINK.start, add_special_tokens=False)),
                                end_ids, forced_ids, True, eos, grammar_after_thinking=True)
        return BudgetMatcher(budget, compiler.compile(schema).new_matcher())

    vocab_size = 49152
    thinking = tokenizer.encode("Not JSON at all: {{{ ]]", add_special_tokens=False)
    answer = tokenizer.encode('{"a": 4}', add_special_tokens=False)
    # The model closes its thinking itself: free text, then JSON only.
    closing = matcher(None)
    assert closing.valid_prefix(thinking + list(end_ids) + answer) == thinking + list(end_ids) + answer
    bitmask = torch.zeros(len(thinking) + 1, (vocab_size + 31) // 32, dtype=torch.int32)
    closing.fill_mask(bitmask, 0, thinking)
    thinking_row = {t for t in range(vocab_size) if int(bitmask[0][t // 32]) >> (t % 32) & 1}
    assert thinking_row == set(range(vocab_size)) - set(eos)  # thinking: anything but EOS
    for token_id in thinking + list(end_ids):
        assert closing.accept(token_id)
    assert not closing.is_accepting
    rows = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    closing.fill_mask(rows, 0)
    allowed_ids = {t for t in range(vocab_size) if int(rows[0][t // 32]) >> (t % 32) & 1}
    assert thinking[0] not in allowed_ids and answer[0] in allowed_ids  # the answer is the schema's
    for token_id in answer:
        assert closing.accept(token_id)
    assert closing.is_accepting
    # A spent budget forces the close, then the schema.
    forced = matcher(len(thinking))
    proposals = thinking + list(forced_ids) + answer
    assert forced.valid_prefix(proposals) == proposals
    assert forced.valid_prefix(thinking + answer) == thinking
