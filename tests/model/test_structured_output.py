"""Constrained decoding on the real model: every output matches its schema, regex, choice or
grammar, at temperature 0 and 1; outputs cut by max_tokens say `length`; a grammar that cannot end
before min_tokens fails its own request only."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError
from tokios.sampling_params import SamplingParams
from tokios.structured import StructuredOutput

from structured_schemas import instances, schemas

NUM_SCHEMAS = 8
NUM_EXAMPLES = 4


@pytest.fixture(scope="module")
def llm():
    from tokios.engine import LLM

    return LLM(kv_cache_memory="128MiB")


def chat_prompt(llm, schema) -> list[int]:
    messages = [{"role": "user", "content": f"Reply with a JSON value for this schema: {json.dumps(schema)}"}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def grammar_accepts(llm, spec: StructuredOutput, text: str) -> bool:
    matcher = llm.core.grammars.compile(spec).new_matcher()
    return all(matcher._matcher.consume_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting


def test_every_output_validates_against_its_generated_schema(llm):
    collected: list[str] = []

    # Each example is one list of schemas, run as one batch; no shrinking (each attempt would
    # rerun the model). The first example hypothesis draws is the simplest; the others vary.
    @settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(schemas, min_size=NUM_SCHEMAS, max_size=NUM_SCHEMAS), st.data())
    def check(drawn_schemas, data):
        specs = [StructuredOutput.json(schema) for schema in drawn_schemas]
        # Completeness, on instances drawn from the schema (leaves by hypothesis-jsonschema): the
        # grammar refuses no valid value written compactly, the form our grammars generate.
        for schema, spec in zip(drawn_schemas, specs):
            instance = data.draw(instances(schema))
            jsonschema.validate(instance, schema)
            text = json.dumps(instance, ensure_ascii=False)
            assert grammar_accepts(llm, spec, text), (schema, text)
        prompts = [chat_prompt(llm, schema) for schema in drawn_schemas]
        for temperature in (0.0, 1.0):
            params = [SamplingParams(temperature=temperature, seed=index, max_tokens=400, structured_output=spec)
                      for index, spec in enumerate(specs)]
            for schema, output in zip(drawn_schemas, llm.generate(prompts, params)):
                choice = output.outputs[0]
                assert choice.finish_reason == "stop", (schema, choice.text)
                jsonschema.validate(json.loads(choice.text), schema)
                collected.append(choice.text)

    check()
    assert len(set(collected)) > 2 * NUM_SCHEMAS  # real, varied answers: the test can fail
    llm.check_invariants()


def test_regex_choice_and_lark_grammars_on_plain_prompts(llm):
    cases = [
        (StructuredOutput.regex(r"\(\d{3}\) \d{3}-\d{4}"), "Call us at", re.compile(r"\(\d{3}\) \d{3}-\d{4}")),
        (StructuredOutput.choice(["Paris", "London", "Berlin"]), "The capital of France is",
         re.compile(r"Paris|London|Berlin")),
        (StructuredOutput.grammar('start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'), "Q: 6 x 7?\nA:",
         re.compile(r"The answer is [0-9]{1,3}\.")),
        (StructuredOutput.grammar('root ::= ("yes" | "no") " because " [a-z ]{1,30} "."'), "Is water wet?",
         re.compile(r"(yes|no) because [a-z ]{1,30}\.")),
    ]
    for temperature in (0.0, 1.0):
        prompts = [llm.tokenizer.encode(prompt) for _, prompt, _ in cases]
        params = [SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_output=spec)
                  for spec, _, _ in cases]
        for (_, _, pattern), output in zip(cases, llm.generate(prompts, params)):
            assert output.outputs[0].finish_reason == "stop"
            assert pattern.fullmatch(output.outputs[0].text), output.outputs[0].text
    greedy = SamplingParams(temperature=0, max_tokens=10, structured_output=cases[1][0])
    assert llm.generate(prompts[1:2], greedy)[0].outputs[0].text == "Paris"  # and right, too


def test_a_structure_cut_by_max_tokens_finishes_with_length(llm):
    spec = StructuredOutput.json({"type": "object", "properties": {"story": {"type": "string"}},
                                  "required": ["story"]})
    output = llm.generate([llm.tokenizer.encode("Tell me a story.")],
                          SamplingParams(temperature=0, max_tokens=8, structured_output=spec))[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 8
    assert output.text.startswith('{"story": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_min_tokens_past_the_grammars_end_fails_that_request_alone(llm):
    choice = StructuredOutput.choice(["yes"])
    prompts = [llm.tokenizer.encode("Say yes."), llm.tokenizer.encode("Say anything.")]
    # The grammar can end only with EOS after "yes", and min_tokens forbids EOS: nothing to sample.
    stuck = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, structured_output=choice)
    with pytest.raises(InvalidRequestError, match="no token"):
        llm.generate(prompts[:1], stuck)
    fine = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=5))
    assert len(fine[0].outputs[0].token_ids) == 5
    llm.check_invariants()
