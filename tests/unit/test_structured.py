"""Constrained decoding without the model: compiling (errors, cache), the matcher's masks over the
real SmolLM2 tokenizer, the bitmask applied to logits, and the tool-call grammar's language."""

from __future__ import annotations

import json

import pytest
import torch

from tokios.errors import InvalidRequestError
from tokios.model_files import default_model_path
from tokios.structured import GrammarCompiler, StructuredOutput
from tokios.structured.bitmask import GrammarBitmask
from tokios.tokenizer import load_tokenizer
from tokios.tool_calls import ToolSet
from tokios.tool_calls.call_format import call_text
from tokios.tool_calls.grammar import tool_call_grammar


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 49152)


def accepts(compiler, tokenizer, spec: StructuredOutput, text: str, complete: bool = True) -> bool:
    """Whether the grammar takes `text` token by token (and, if `complete`, may end after it)."""
    matcher = compiler.compile(spec).new_matcher()
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not matcher._matcher.consume_token(token_id):
            return False
    return matcher.is_accepting or not complete


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("spec, param", [
    (StructuredOutput.json({"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (StructuredOutput.grammar("start: foo("), "structured_outputs.grammar"),
    (StructuredOutput.grammar('root ::= "a" | ('), "structured_outputs.grammar"),
    (StructuredOutput.regex("(unclosed"), "structured_outputs.regex"),
    (StructuredOutput.json({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 5,
                            "additionalProperties": False}), "structured_outputs.json"),
])
def test_what_does_not_compile_is_a_400_naming_the_field(compiler, spec, param):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == param and info.value.status == 400 and info.value.message.startswith(param)


def test_compiled_grammars_are_cached_by_content(compiler):
    spec = StructuredOutput.regex("[a-c]{3}")
    first = compiler.compile(spec)
    hits = compiler.num_cache_hits
    assert compiler.compile(StructuredOutput.regex("[a-c]{3}")) is first
    assert compiler.num_cache_hits == hits + 1
    assert compiler.compile(StructuredOutput.regex("[a-c]{4}")) is not first


def test_each_kind_accepts_its_language_only(compiler, tokenizer):
    schema = StructuredOutput.json({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert accepts(compiler, tokenizer, schema, '{"n": 42}')
    assert not accepts(compiler, tokenizer, schema, '{"n": "42"}')
    assert not accepts(compiler, tokenizer, schema, '{ "n":42}')  # compact form only
    assert accepts(compiler, tokenizer, StructuredOutput.json_object(), '{"any": [1, {"x": null}]}')
    assert not accepts(compiler, tokenizer, StructuredOutput.json_object(), '[1]')
    assert accepts(compiler, tokenizer, StructuredOutput.choice(["red", "green"]), "green")
    assert not accepts(compiler, tokenizer, StructuredOutput.choice(["red", "green"]), "blue")
    assert accepts(compiler, tokenizer, StructuredOutput.regex(r"\d{3}-\d{4}"), "555-1234")
    assert not accepts(compiler, tokenizer, StructuredOutput.regex(r"\d{3}-\d{4}"), "555-12345", complete=False)
    lark = StructuredOutput.grammar('start: "say " WORD\nWORD: /[a-z]+/')
    assert accepts(compiler, tokenizer, lark, "say hello")
    gbnf = StructuredOutput.grammar('root ::= "yes" | "no"')
    assert accepts(compiler, tokenizer, gbnf, "no") and not accepts(compiler, tokenizer, gbnf, "maybe")


def test_eos_is_allowed_exactly_when_the_grammar_can_end(compiler, tokenizer):
    eos = tokenizer.eos_token_ids
    matcher = compiler.compile(StructuredOutput.regex("[0-9]+")).new_matcher()
    bitmask = torch.zeros((1, (49152 + 31) // 32), dtype=torch.int32)
    matcher.fill_mask(bitmask, 0)
    assert not eos & allowed_tokens(bitmask[0], 49152)
    matcher.accept(tokenizer.encode("12", add_special_tokens=False)[0])
    matcher.fill_mask(bitmask, 0)
    assert eos <= allowed_tokens(bitmask[0], 49152)
    assert not matcher.is_finished  # more digits may follow
    choice = compiler.compile(StructuredOutput.choice(["ok"])).new_matcher()
    for token_id in tokenizer.encode("ok", add_special_tokens=False):
        choice.accept(token_id)
    assert choice.is_finished


def test_verify_rows_are_masked_after_their_proposals_and_the_matcher_is_left_as_it_was(compiler, tokenizer):
    spec = StructuredOutput.json({"type": "object", "properties": {"word": {"enum": ["alpha", "beta"]}},
                                  "additionalProperties": False})
    text_ids = tokenizer.encode('{"word": "beta"}', add_special_tokens=False)
    proposals = text_ids[:4]
    matcher = compiler.compile(spec).new_matcher()
    rows = torch.zeros((len(proposals) + 1, (49152 + 31) // 32), dtype=torch.int32)
    assert matcher.fill_mask(rows, 0, proposals) == len(proposals) + 1
    reference = compiler.compile(spec).new_matcher()
    one = torch.zeros((1, rows.shape[1]), dtype=torch.int32)
    for j in range(len(proposals) + 1):
        reference.fill_mask(one, 0)
        assert torch.equal(rows[j], one[0]), j
        if j < len(proposals):
            reference.accept(proposals[j])
    # The proposals were rolled back: the first row's mask again.
    matcher.fill_mask(one, 0)
    assert torch.equal(one[0], rows[0])
    # A refused proposal: its row and the rows after it carry the refusing row's mask.
    refused = [text_ids[0], tokenizer.encode("zzz", add_special_tokens=False)[0], text_ids[1]]
    assert matcher.valid_prefix(refused) == refused[:1]
    rows = torch.zeros((4, one.shape[1]), dtype=torch.int32)
    matcher.fill_mask(rows, 0, refused)
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])
    assert refused[1] not in allowed_tokens(rows[1], 49152)


def test_the_bitmask_sets_forbidden_logits_to_minus_infinity():
    bitmask = GrammarBitmask(70, torch.device("cpu"))
    masks = torch.zeros((2, 3), dtype=torch.int32)
    masks[0, 0] = 1 << 5
    masks[1, 2] = 1 << 3  # token 67
    logits = torch.randn(3, 70)
    original = logits.clone()
    bitmask.apply(logits, [0, 2], masks)
    assert torch.equal(logits[1], original[1])  # the unconstrained row
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [67]


def test_the_tool_call_grammar_admits_calls_under_each_schema_and_nothing_else(compiler, tokenizer):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "get_time"}}
    call = call_text("get_weather", '{"city": "Oslo"}')
    required = tool_call_grammar(ToolSet.from_request([weather, clock], "required", True))
    assert accepts(compiler, tokenizer, required, call)
    assert accepts(compiler, tokenizer, required, call + "\n" + call_text("get_time", "{}"))
    assert not accepts(compiler, tokenizer, required, "Sure! " + call, complete=False)
    assert not accepts(compiler, tokenizer, required, call_text("get_weather", '{"town": "Oslo"}'), complete=False)
    assert not accepts(compiler, tokenizer, required, call_text("get_time", '{"x": 1}'), complete=False)
    single = tool_call_grammar(ToolSet.from_request([weather, clock], "required", False))
    assert not accepts(compiler, tokenizer, single, call + "\n" + call, complete=False)
    named = tool_call_grammar(ToolSet.from_request([weather, clock], {"type": "function",
                                                                    "function": {"name": "get_time"}}, None))
    assert not accepts(compiler, tokenizer, named, call, complete=False)
    auto = tool_call_grammar(ToolSet.from_request([weather, clock], "auto", None))
    assert accepts(compiler, tokenizer, auto, "No tool needed: it is 4 o'clock.")
    assert accepts(compiler, tokenizer, auto, "Let me look. " + call)
    # Once the model opens a call, the call is under the grammar: free text is refused.
    assert not accepts(compiler, tokenizer, auto, "Let me look. <tool_call>\nhello", complete=False)
    json.loads(call[len("<tool_call>\n"):-len("\n</tool_call>")])  # the call body is itself JSON


def test_without_parallel_calls_the_grammar_ends_the_turn_after_one_call(compiler, tokenizer):
    """parallel_tool_calls false (Anthropic's disable_parallel_tool_use): once the call is
    written only EOS remains, so a model cannot repeat it until max_tokens."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = call_text("get_weather", '{"city": "Oslo"}')
    for tool_choice, parallel, is_finished in [("required", False, True), ("auto", False, True),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True, True),
                                              ("required", True, False), ("auto", True, False)]:
        matcher = compiler.compile(tool_call_grammar(ToolSet.from_request([weather], tool_choice, parallel))).new_matcher()
        text = "Sure. " + call if tool_choice == "auto" else call
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept(token_id)
        assert matcher.is_finished is is_finished, (tool_choice, parallel)
