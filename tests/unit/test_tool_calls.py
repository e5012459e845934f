"""Tool calling without a model: definitions and tool_choice validation, the prompt format, the
call grammar (driven by llguidance over the real tokenizer) and the parser, whole and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError
from tokios.tool_calls import ToolCallParser, ToolSet
from tokios.tool_calls.call_format import call_text
from tokios.tool_calls.prompt import render_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


# ---- definitions ----------------------------------------------------------------------------

def test_tool_choice_modes_and_defaults():
    auto = ToolSet.from_request([WEATHER, TIME], None, None)
    assert auto.mode == "auto" and auto.calls_possible and not auto.calls_required and auto.parallel is False
    forced = ToolSet.from_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert forced.mode == "function" and [f.name for f in forced.callable_functions] == ["get_time"]
    assert ToolSet.from_request([WEATHER], "required", None).calls_required
    assert not ToolSet.from_request([WEATHER], "none", None).calls_possible
    assert ToolSet.from_request(None, "none", None) is None


def test_parameters_schemas_are_closed_unless_they_say_otherwise():
    nested = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                         "open": {"type": "object", "properties": {}, "additionalProperties": True},
                                         "properties": {"type": "string"}}}}}
    parameters = ToolSet.from_request([nested], None, None).functions[0].parameters
    assert parameters["additionalProperties"] is False
    assert parameters["properties"]["inner"]["additionalProperties"] is False
    assert parameters["properties"]["open"]["additionalProperties"] is True
    assert parameters["properties"]["properties"] == {"type": "string"}  # a property's name is not a keyword
    no_parameters = ToolSet.from_request([{"type": "function", "function": {"name": "ping"}}], None, None)
    assert no_parameters.functions[0].parameters["properties"] == {}


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ("get_weather", None, "tools"),
])
def test_bad_tools_and_tool_choice_are_refused_by_field(tools, tool_choice, param):
    with pytest.raises(InvalidRequestError) as info:
        ToolSet.from_request(tools, tool_choice, None)
    assert info.value.param == param


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(InvalidRequestError) as info:
        ToolSet.from_request([WEATHER], None, "yes")
    assert info.value.param == "parallel_tool_calls"


# ---- the prompt -----------------------------------------------------------------------------

def test_history_of_calls_and_results_renders_in_the_call_format():
    tools = ToolSet.from_request([WEATHER], "auto", None)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "b", "content": "25 C"},
    ]
    rendered = render_messages(messages, tools)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == (call_text("get_weather", '{"city": "Paris"}') + "\n"
                                      + call_text("get_weather", '{"city": "Rome"}'))
    assert rendered[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
    # tool_choice none: no tool list in the prompt, the history still rendered.
    plain = render_messages(messages, ToolSet.from_request([WEATHER], "none", None))
    assert plain[0]["content"] == "Be brief." and "<tool_call>" in plain[2]["content"]


# ---- the parser -----------------------------------------------------------------------------

TEXT = ("Checking. " + call_text("get_weather", '{"city": "Par}is", "n": {"a": [1, {"b": "}\\n"}]}}')
        + "\n" + call_text("get_time", "{}"))


def _reassemble(deltas):
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id is not None:
                assert entry["id"] is None, "only a call's first delta carries its id"
                entry["id"], entry["name"] = call.id, call.name
            entry["arguments"] += call.arguments
    return content, [calls[index] for index in sorted(calls)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_streamed_deltas_reassemble_to_the_whole_answer(cuts):
    parser, deltas, position = ToolCallParser(), [], 0
    for size in cuts:
        deltas.append(parser.feed(TEXT[position:position + size]))
        position += size
    deltas.append(parser.feed(TEXT[position:]))
    deltas.append(parser.finish())
    content, calls = _reassemble(deltas)
    assert content == "Checking. "
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Par}is", "n": {"a": [1, {"b": "}\\n"}]}}'), ("get_time", "{}")]
    assert [c["id"] for c in calls] == [c["id"] for c in parser.tool_calls()]
    assert json.loads(calls[0]["arguments"])["n"]["a"][1]["b"] == "}\n"
    # No delta ever held call text in content.
    assert all("<tool" not in delta.content for delta in deltas)


def test_text_that_only_looks_like_a_tag_stays_content():
    parser = ToolCallParser()
    assert parser.feed("a < b and <tool").content == "a < b and "
    assert parser.feed("kit> done").content == "<toolkit> done"
    assert parser.finish().content == "" and not parser.has_calls
    cut = ToolCallParser()
    cut.feed('<tool_call>\n{"name": "f", "arguments": {"a": "x')
    cut.finish()
    assert cut.tool_calls()[0]["function"] == {"name": "f", "arguments": '{"a": "x'}


def test_a_template_that_takes_tools_renders_them_itself():
    from tokios.tokenizer.chat_template import ChatTemplate
    from tokios.tool_calls.prompt import template_inputs

    source = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}"
              "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}\n{% endfor %}")
    template = ChatTemplate(source)
    assert template.takes_tools and not ChatTemplate("{{ messages[0].content }}").takes_tools
    tools = ToolSet.from_request([WEATHER, TIME], "auto", None)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    rendered_messages, template_tools = template_inputs(messages, tools, template_takes_tools=True)
    assert rendered_messages is messages and [t["function"]["name"] for t in template_tools] == ["get_weather",
                                                                                                   "get_time"]
    text = template.render(rendered_messages, add_generation_prompt=False, tools=template_tools, special_tokens={})
    assert text == "TOOLS:get_weather;get_time;user: hiassistant: [call get_time]"  # trim_blocks, as HF
    # tool_choice none: the template gets no tools.
    assert template_inputs(messages, ToolSet.from_request([WEATHER], "none", None), True)[1] is None


@pytest.mark.parametrize("template, object_arguments", [
    ("openai-gpt-oss-120b.jinja", True), ("Qwen-Qwen2.5-7B-Instruct.jinja", True),
    ("Qwen-Qwen3-0.6B.jinja", False), ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", False)])
def test_a_past_calls_arguments_reach_a_tojson_template_as_the_object_the_model_wrote(template, object_arguments):
    """OpenAI clients send a past call's arguments as JSON text; a template that writes them with
    `tojson` whatever they are (gpt-oss's, Qwen2.5's, Llama 3.x's) gets the object, else it would
    write a quoted string the model never wrote. One that checks for text (Qwen3's) gets the text
    as sent, byte for byte."""
    from tokios.model_files import llama_cpp_sources
    from tokios.tokenizer.chat_template import ChatTemplate

    chat_template = ChatTemplate((llama_cpp_sources() / "models" / "templates" / template).read_text())
    assert chat_template.takes_object_arguments == object_arguments
    arguments = '{"city":"Paris"}'
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tools = [{"type": "function", "function": WEATHER["function"]}]
    rendered = chat_template.render(messages, add_generation_prompt=True, tools=tools, special_tokens={})
    assert '\\"city\\"' not in rendered
    assert (arguments in rendered) != object_arguments and ('{"city": "Paris"}' in rendered) == object_arguments
