"""Reasoning and tool-call markers as special tokens, on the tiny Qwen3 (`<think>`, `</think>`,
`<tool_call>`, `</tool_call>`, Qwen3-0.6B's template) and the tiny gpt-oss (harmony's markers, its
template), converted by llama.cpp's script (converted.py; no vocabulary file here has them).

The random models never write a marker themselves, so the tests drive them: the thinking budget
(`max_thinking_tokens`) forces the close of the thinking as the markers' special ids, and
tool_choice `required` makes the grammar write the call; the server (in process, through the
OpenAI chat endpoint) then splits the decoded text into reasoning and a call, streamed and whole
alike. The prompt side: each marker the template writes encodes to its one id, and the request's
effort and thinking switch reach the templates.
"""

from __future__ import annotations

import functools
import json
import time

import pytest

from converted import converted_model, family_tokenizer
from test_families import FAMILIES, QWEN3_MARKERS
from test_gpt_oss import FAMILY as GPT_OSS, HARMONY_MARKERS
from tokios.reasoning import HARMONY, THINK, ThinkingRequest, plan_thinking

FAMILY_TO_MARKERS = {"qwen3": QWEN3_MARKERS, "gpt-oss": HARMONY_MARKERS}
UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "Sets the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Use Fahrenheit."},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants F.", "thinking": "The user wants F.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "set_unit", "arguments": {"unit": "f"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    {"role": "user", "content": "Thanks!"},
]
NUM_THINKING_TOKENS = 4


def _family(name: str):
    return GPT_OSS if name == "gpt-oss" else FAMILIES[name]


@pytest.fixture(scope="module", params=["qwen3", "gpt-oss"])
def served(request, tmp_path_factory):
    """(family name, a TestClient of the server on the family's tiny model)."""
    from starlette.testclient import TestClient

    from tokios.config import EngineConfig
    from tokios.engine.async_engine import AsyncEngine
    from tokios.server.app import create_app
    from tokios.server.serving import ServerSettings

    path = str(converted_model(_family(request.param), tmp_path_factory).gguf_path)
    app = create_app(ServerSettings(), engine_loader=lambda: AsyncEngine(
        EngineConfig.from_options(model=path, dtype="float32", kv_cache_memory="64MiB")))
    with TestClient(app) as client:
        while client.get("/health").json()["status"] == "loading":
            time.sleep(0.05)
        assert client.get("/health").json()["status"] == "ok"
        yield request.param, client


@functools.lru_cache(maxsize=None)
def _tokenizer(path):
    """Our tokenizer from the file (read once per file: a 150k-token vocabulary takes seconds)."""
    from tokios.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf_file(str(path))


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss"])
def test_the_prompt_encodes_each_marker_as_its_one_special_id(name, tmp_path_factory):
    tiny = converted_model(_family(name), tmp_path_factory)
    tokenizer = _tokenizer(tiny.gguf_path)
    rendered = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tools=[UNIT])
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids == family_tokenizer(tiny.family)(rendered, add_special_tokens=False).input_ids
    for marker in FAMILY_TO_MARKERS[name]:
        (marker_id,) = tokenizer.encode(marker, add_special_tokens=False)
        assert marker_id in tokenizer.all_special_ids
        assert ids.count(marker_id) == rendered.count(marker), marker
    written = [marker for marker in FAMILY_TO_MARKERS[name] if marker in rendered]
    # Qwen3's template writes the past call in its tags; gpt-oss's writes every marker but
    # <|return|> (the end of a final answer, never an input) and <|constrain|> (it renders a
    # past call's format as plain "json").
    assert len(written) == (2 if name == "qwen3" else 5), written


def test_the_effort_and_the_thinking_switch_reach_the_templates(tmp_path_factory):
    """What Serving.start_chat passes the template (reasoning/request.py's plan): gpt-oss's
    template writes the effort into its system turn; Qwen3's closes the thinking in the
    generation prompt when it is off."""
    gpt_oss = _tokenizer(converted_model(GPT_OSS, tmp_path_factory).gguf_path)
    for effort, expected in [("low", "low"), ("minimal", "low"), ("high", "high")]:
        plan = plan_thinking(ThinkingRequest.from_effort(effort), HARMONY, gpt_oss.chat_template_variables)
        rendered = gpt_oss.apply_chat_template(CONVERSATION[:2], **plan.template_kwargs)
        system_turn = rendered[:rendered.index("<|end|>")]
        assert f"Reasoning: {expected}" in system_turn and rendered.count("Reasoning:") == 1
    qwen3 = _tokenizer(converted_model(FAMILIES["qwen3"], tmp_path_factory).gguf_path)
    for effort, ending in [("none", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                           ("low", "<|im_start|>assistant\n")]:
        plan = plan_thinking(ThinkingRequest.from_effort(effort), THINK, qwen3.chat_template_variables)
        assert qwen3.apply_chat_template(CONVERSATION[:2], **plan.template_kwargs).endswith(ending)


def _chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(client, **body) -> tuple[str, str, list[dict], str]:
    """(reasoning, content, tool calls, finish reason) from the streamed deltas, concatenated."""
    response = client.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "temperature": 0,
                                                          "stream": True, **body})
    assert response.status_code == 200, response.text
    reasoning, content, index_to_call, finish_reason = "", "", {}, None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning_content") == delta.get("reasoning")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = index_to_call.setdefault(call["index"], {"name": None, "arguments": ""})
                entry["name"] = call["function"].get("name") or entry["name"]
                entry["arguments"] += call["function"]["arguments"]
            finish_reason = choice["finish_reason"] or finish_reason
    return reasoning, content, [index_to_call[index] for index in sorted(index_to_call)], finish_reason


def test_a_spent_budget_closes_the_thinking_with_its_special_ids_and_the_grammar_writes_the_call(served):
    name, client = served
    body = dict(tools=[UNIT], tool_choice="required", max_thinking_tokens=NUM_THINKING_TOKENS, max_tokens=80,
                logprobs=True)
    whole = _chat(client, **body)
    (choice,) = whole["choices"]
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    if name == "qwen3":
        # <think>, the budget's tokens, then the forced "\n</think>\n\n", then the call in its tags.
        assert tokens[0] == "<think>" and tokens[1 + NUM_THINKING_TOKENS:][:3] == ["\n", "</think>", "\n\n"]
        assert "<tool_call>" in tokens and tokens[-1] == "</tool_call>"
    else:
        # The analysis opened, the budget's tokens, then the forced close and the next message's
        # header; the grammar writes the call, and <|call|> ends the output.
        assert tokens[:3] == ["<|channel|>", "analysis", "<|message|>"]
        assert tokens[3 + NUM_THINKING_TOKENS:][:4] == ["<|end|>", "<|start|>", "assistant", "<|channel|>"]
        assert tokens[tokens.index("<|constrain|>"):][:3] == ["<|constrain|>", "json", "<|message|>"]
        assert tokens[-1] == "<|call|>"
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["reasoning_content"] == message["reasoning"]
    assert message["reasoning_content"].strip() and "<|" not in message["reasoning_content"]
    assert "<think>" not in message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "set_unit" and json.loads(call["function"]["arguments"])["unit"] in "cf"
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    reasoning, content, calls, finish_reason = _streamed(client, **body)
    assert (reasoning, content, finish_reason) == (message["reasoning_content"], "", "tool_calls")
    assert calls == [{"name": "set_unit", "arguments": call["function"]["arguments"]}]


def test_a_spent_budget_without_a_required_call_leads_to_an_answer(served):
    """`auto`: gpt-oss's forced end opens the final channel, Qwen3's closes the thinking; the
    model then answers (the random model's text, or a call the grammar completes)."""
    name, client = served
    body = dict(tools=[UNIT], max_thinking_tokens=NUM_THINKING_TOKENS, max_tokens=24)
    (choice,) = _chat(client, **body)["choices"]
    message = choice["message"]
    assert message["reasoning_content"].strip() and "<|" not in message["reasoning_content"]
    assert (message["content"] or "").strip() or message.get("tool_calls")
    assert "<|" not in (message["content"] or "") and "<think>" not in (message["content"] or "")
    reasoning, content, calls, finish_reason = _streamed(client, **body)
    assert (reasoning, content, finish_reason) == (message["reasoning_content"], message["content"] or "",
                                                   choice["finish_reason"])


def test_the_harmony_grammar_admits_its_messages_only(tmp_path_factory):
    """Over the tiny gpt-oss's vocabulary (the markers as their special ids): the analysis first,
    then under `auto` a final answer or a call, under `required` a call only, under a named
    tool_choice a call of that function only, each call's arguments under its schema."""
    from tokios.reasoning.harmony_grammar import MARKERS, harmony_tool_call_grammar
    from tokios.structured import GrammarCompiler
    from tokios.tool_calls import ToolSet

    tokenizer = _tokenizer(converted_model(GPT_OSS, tmp_path_factory).gguf_path)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    marker_to_id = {marker: tokenizer.single_token_id(marker) for marker in MARKERS}
    clock = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
        "type": "object", "properties": {}}}}

    def accepts(tool_choice, text: str) -> bool:
        grammar = harmony_tool_call_grammar(ToolSet.from_request([UNIT, clock], tool_choice, None), marker_to_id)
        matcher = compiler.compile(grammar).new_matcher()
        return all(matcher._matcher.consume_token(token_id)
                   for token_id in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting

    analysis = "<|channel|>analysis<|message|>Need the unit.<|end|><|start|>assistant"
    call = '<|channel|>commentary to=functions.set_unit <|constrain|>json<|message|>{"unit": "f"}<|call|>'
    final = "<|channel|>final<|message|>It is done.<|return|>"
    assert accepts("auto", analysis + call) and accepts("auto", analysis + final)
    assert accepts("required", analysis + call) and not accepts("required", analysis + final)
    assert not accepts("auto", call) and not accepts("auto", final)  # the analysis comes first
    assert not accepts("auto", analysis + call.replace('"f"', '"k"'))
    assert not accepts("auto", analysis + call.replace("<|call|>", "<|end|>"))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert not accepts(named, analysis + call)
    assert accepts(named, analysis + call.replace("set_unit", "get_time").replace('{"unit": "f"}', "{}"))
