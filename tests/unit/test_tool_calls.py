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
    assert content == "Checking."  # the space before the call is its separator
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Par}is", "n": {"a": [1, {"b": "}\\n"}]}}'), ("get_time", "{}")]
    assert [c["id"] for c in calls] == [c["id"] for c in parser.tool_calls()]
    assert json.loads(calls[0]["arguments"])["n"]["a"][1]["b"] == "}\n"
    # No delta ever held call text in content.
    assert all("<tool" not in delta.content for delta in deltas)


def test_text_that_only_looks_like_a_tag_stays_content():
    parser = ToolCallParser()
    assert parser.feed("a < b and <tool").content == "a < b and"  # the space waits: a call's separator?
    assert parser.feed("kit> done").content == " <toolkit> done"
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


# Texts as the grammar writes them, and as other servers' models write the same format.
SPLIT_CASES = {
    "a call after text": (
        "Let me check.\n" + call_text("get_weather", '{"city": "Oslo"}'),
        "Let me check.", [("get_weather", '{"city": "Oslo"}')]),
    "parallel calls": (
        call_text("get_weather", '{"city": "Oslo"}') + "\n" + call_text("get_time", "{}"),
        "", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    "nested JSON": (
        call_text("f", '{"a": {"b": [1, {"c": []}], "d": {}}, "e": [[{}]]}'),
        "", [("f", '{"a": {"b": [1, {"c": []}], "d": {}}, "e": [[{}]]}')]),
    "escaped quotes and backslashes": (
        call_text("f", r'{"q": "say \"}\" and \\", "r": "\\\"{"}'),
        "", [("f", r'{"q": "say \"}\" and \\", "r": "\\\"{"}')]),
    "tags inside string arguments": (
        call_text("f", '{"x": "</tool_call>", "y": "}\\n</tool_call>\\n<tool_call>", "z": "<tool_call>"}'),
        "", [("f", '{"x": "</tool_call>", "y": "}\\n</tool_call>\\n<tool_call>", "z": "<tool_call>"}')]),
    "unicode": (
        "Vérifions ☀️ — " + call_text("météo", '{"ville": "Zürich 東京 🌧", "ß": "\\u00e9"}'),
        "Vérifions ☀️ —", [("météo", '{"ville": "Zürich 東京 🌧", "ß": "\\u00e9"}')]),
    "text only, with a lookalike tag": (
        "a <tool_c and <b> then </tool_call> end \n", "a <tool_c and <b> then </tool_call> end \n", []),
    "a tag with no call after it": ("see <tool_call> here", "see <tool_call> here", []),
}


def _parse_in_pieces(text: str, cuts: tuple[int, ...]):
    parser, deltas, start = ToolCallParser(), [], 0
    for cut in (*cuts, len(text)):
        deltas.append(parser.feed(text[start:cut]))
        start = cut
    deltas.append(parser.finish())
    content, calls = _reassemble(deltas)
    whole_calls = [(call["function"]["name"], call["function"]["arguments"]) for call in parser.tool_calls()]
    assert [(c["name"], c["arguments"]) for c in calls] == whole_calls  # the deltas add up to the calls
    assert content == parser.content
    return content, whole_calls


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_every_split_gives_the_answer_the_whole_text_gives(name):
    """Fed whole, at every single split, and at every pair of split points: the same content
    and calls, so a streamed answer equals the non-streamed one whatever the deltas are."""
    text, expected_content, expected_calls = SPLIT_CASES[name]
    assert _parse_in_pieces(text, ()) == (expected_content, expected_calls)
    for calls in expected_calls:
        json.loads(calls[1])
    for first in range(len(text) + 1):
        for second in range(first, len(text) + 1):
            assert _parse_in_pieces(text, (first, second)) == (expected_content, expected_calls), (first, second)


def test_parallel_calls_have_distinct_indexes_and_ids():
    text = SPLIT_CASES["parallel calls"][0]
    parser = ToolCallParser()
    firsts = [call for position in range(len(text)) for call in parser.feed(text[position]).tool_calls
              if call.id is not None]
    assert [call.index for call in firsts] == [0, 1] and len({call.id for call in firsts}) == 2


# llama.cpp's expected parses (tests/test-chat.cpp) of the `<tool_call>` JSON form of Hermes 2 Pro,
# Hermes 3, Qwen 2.5, MiMo-VL, Granite 4 and Reka Edge; those with reasoning are the reasoning
# parser's. Arguments compare as JSON, as llama.cpp's do (it re-serializes them).
LLAMA_CPP_CASES = [
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
     "", [("special_function", {"arg1": 1})]),
    ('Hello, world!\nWhat\'s up?<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
     "Hello, world!\nWhat's up?", [("special_function", {"arg1": 1})]),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
     "", [("special_function", {"arg1": 1})]),
    ('Hello, world!\nWhat\'s up?\n<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
     "Hello, world!\nWhat's up?", [("special_function", {"arg1": 1})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"city": "XYZCITY"}}</tool_call>',
     "", [("get_time", {"city": "XYZCITY"})]),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'
     '<tool_call>\n{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}</tool_call>',
     "", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}\n</tool_call>',
     "", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ('<tool_call>\n{"name": "empty_args", "arguments": {}}</tool_call>', "", [("empty_args", {})]),
    ("Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
]


@pytest.mark.parametrize("text, expected_content, expected_calls", LLAMA_CPP_CASES)
def test_llama_cpp_hermes_cases(text, expected_content, expected_calls):
    for cut in range(len(text) + 1):
        content, calls = _parse_in_pieces(text, (cut,))
        assert content == expected_content
        assert [(name, json.loads(arguments)) for name, arguments in calls] == expected_calls


def test_llama_cpp_partial_calls_keep_their_partial_arguments():
    """llama.cpp's partial parses: a call cut inside its arguments is a call with what arrived."""
    for text, arguments in [('<tool_call>\n{"name": "special_function", "arguments": {"arg1":', '{"arg1":'),
                            ('<tool_call>\n{"name": "special_function", "arguments": {"arg', '{"arg')]:
        parser = ToolCallParser()
        parser.feed(text)
        parser.finish()
        assert parser.tool_calls()[0]["function"] == {"name": "special_function", "arguments": arguments}
        assert parser.has_open_call and parser.content == ""
    whole = call_text("f", '{"a": 1}')
    for cut in range(len(whole)):  # cut anywhere: open exactly while the arguments are
        parser = ToolCallParser()
        parser.feed(call_text("g", "{}") + "\n" + whole[:cut])
        parser.finish()
        arguments_start, arguments_end = whole.index('{"a"'), whole.index("}") + 1
        assert parser.has_open_call is (arguments_start <= cut < arguments_end), cut
        assert len(parser.calls) == 1 + (cut >= arguments_start), cut


# ---- Anthropic's tool_choice ------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice, mode, forced_name, parallel", [
    (None, "auto", None, True),
    ({"type": "auto"}, "auto", None, True),
    ({"type": "any"}, "required", None, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ({"type": "tool", "name": "get_time"}, "function", "get_time", True),
    ({"type": "none"}, "none", None, True),
])
def test_anthropic_tool_choice_maps_onto_the_tool_set(tool_choice, mode, forced_name, parallel):
    from tokios.server.dialects.anthropic import CountTokensRequest, to_toolset

    tools = [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]} for tool in (WEATHER, TIME)]
    body = CountTokensRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                              tool_choice=tool_choice)
    tool_set = to_toolset(body)
    assert (tool_set.mode, tool_set.forced_name, tool_set.parallel) == (mode, forced_name, parallel)


def test_ollama_format_schemas_are_closed_like_tool_parameters():
    from tokios.server.dialects.ollama import _format

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "pet": {"type": "object", "properties": {"kind": {"type": "string"}}},
                                               "extra": {"type": "object", "properties": {},
                                                         "additionalProperties": {"type": "integer"}}},
              "required": ["name"]}
    closed = json.loads(_format(schema).source)
    assert closed["additionalProperties"] is False and closed["properties"]["pet"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}
    assert schema.get("additionalProperties") is None  # the caller's schema is left as given
    assert json.loads(_format({"type": "object"}).source) == {"type": "object"}  # lists nothing: open


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
