"""The real chat templates llama.cpp collects (models/templates/*.jinja in its pinned sources:
Qwen 2.5/3, QwQ, gpt-oss, DeepSeek R1/V3, Llama 3.x, Phi-3/4, Gemma, Mistral, Hermes, Command R,
...) render every conversation exactly as transformers' apply_chat_template renders it, or both
refuse it.

Conversations: a single user turn, a system prompt and two exchanges, an assistant tool call
with its tool result, a reasoning model's history (assistant content with a think block), a prior
assistant turn with its reasoning in the message fields templates read (`reasoning_content`,
`thinking`), and a turn that reasoned and called a tool, then the tool's result; each with and
without the generation prompt, and once with `tools` given; the last two also with the
variables a reasoning request sets (`enable_thinking=False`, `reasoning_effort="low"`). Templates
that read the date get a fixed date on both sides. Every template must render at least one case
(one that both refused everywhere would otherwise say nothing; tool-use templates refuse a turn
without `tools`). At the pinned sources: 70 templates, 1,438 renderings equal, 102 cases refused
by both; 25 templates write the reasoning fields' text (Qwen3 and gpt-oss only in the turn that
called a tool), 11 change with enable_thinking=False and 3 with reasoning_effort="low".
"""

from __future__ import annotations

import pytest

from tokios.errors import InvalidRequestError
from tokios.model_files import llama_cpp_sources
from tokios.tokenizer.chat_template import ChatTemplate

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# Templates that read more than the conversation and `tools`: what their models' cards pass.
EXTRA_VARIABLES = {
    "fireworks-ai-llama-3-firefunction-v2": {"functions": '[{"name": "get_weather"}]', "datetime": "2026-01-15"},
}
# Command R's tool-use template takes tools in Cohere's shape, not OpenAI's.
TOOLS_BY_TEMPLATE = {
    "CohereForAI-c4ai-command-r-plus-tool_use": [{
        "name": "get_weather", "description": "The weather in a city",
        "parameter_definitions": {"city": {"description": "the city", "type": "str", "required": True}}}],
}
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is gravity?"}],
    "system_two_exchanges": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Name a prime number larger than 10 — and say «why»."},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, clear"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>Add them.</think>4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    # Reasoning in the fields real templates read: `reasoning_content` (Qwen3, DeepSeek, GLM,
    # ...) and `thinking` (gpt-oss); each template reads the one it knows.
    "reasoning_fields": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them: 4.", "thinking": "Add them: 4."},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    # A turn that reasoned, then called a tool, then its result: gpt-oss renders that turn's
    # analysis (the model's loop is still going), Qwen3 keeps reasoning after the last user turn.
    "reasoning_tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
         "thinking": "I need the weather tool.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, clear"},
    ],
}
# The template variables a reasoning request sets (thinking off; an effort), rendered over the
# reasoning conversations with the generation prompt.
REASONING_VARIABLES = ({"enable_thinking": False}, {"reasoning_effort": "low"})


def template_paths():
    try:
        return sorted((llama_cpp_sources() / "models" / "templates").glob("*.jinja"))
    except Exception as exc:  # collected before the fixtures: fail the one test that says why
        return [pytest.param(None, marks=pytest.mark.xfail(reason=str(exc), strict=True))]


def render_transformers(source: str, messages, add_generation_prompt: bool, tools, **variables):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, tools=tools,
                                        add_generation_prompt=add_generation_prompt, **SPECIAL_TOKENS, **variables)
    return rendered[0]


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    import transformers.utils.chat_template_utils as hf_templates

    from tokios.tokenizer import chat_template

    class FixedDateTime:
        @staticmethod
        def now():
            import datetime

            return datetime.datetime(2026, 1, 15, 9, 30)

    monkeypatch.setattr(chat_template, "datetime", FixedDateTime)
    monkeypatch.setattr(hf_templates, "datetime", FixedDateTime, raising=False)


@pytest.mark.parametrize("path", template_paths(), ids=lambda path: path.stem if path else "missing")
def test_template_renders_as_transformers_renders_it(path):
    pytest.importorskip("transformers")
    source = path.read_text(encoding="utf-8")
    ours = ChatTemplate(source)
    variables = EXTRA_VARIABLES.get(path.stem, {})
    tools = TOOLS_BY_TEMPLATE.get(path.stem, TOOLS)
    cases = [(name, add_generation_prompt, case_tools, {})
             for name in CONVERSATIONS
             for add_generation_prompt, case_tools in ((True, None), (False, None), (True, tools))]
    cases += [(name, True, tools, reasoning_variables) for name in ("reasoning_fields", "reasoning_tool_call")
              for reasoning_variables in REASONING_VARIABLES]
    num_rendered = 0
    for name, add_generation_prompt, case_tools, reasoning_variables in cases:
        case = f"{name}, add_generation_prompt={add_generation_prompt}, tools={case_tools is not None}, {reasoning_variables}"
        messages = CONVERSATIONS[name]
        case_variables = {**variables, **reasoning_variables}
        try:
            expected = render_transformers(source, messages, add_generation_prompt, case_tools, **case_variables)
        except Exception:
            with pytest.raises(InvalidRequestError):
                ours.render(messages, add_generation_prompt=add_generation_prompt, tools=case_tools,
                            special_tokens=SPECIAL_TOKENS, **case_variables)
            continue
        rendered = ours.render(messages, add_generation_prompt=add_generation_prompt, tools=case_tools,
                               special_tokens=SPECIAL_TOKENS, **case_variables)
        assert rendered == expected, case
        num_rendered += 1
    assert num_rendered > 0, "transformers renders none of the cases: the test says nothing about this template"
