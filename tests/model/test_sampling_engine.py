"""Sampling, n > 1 and stop conditions through the real engine (issue: sampling and streaming)."""

import pytest

from tokios.engine import LLM
from tokios.sampling_params import SamplingParams

PROMPTS = [f"Write one sentence about topic number {i}:" for i in range(16)]


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the default dtype


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.2, top_k=40, max_tokens=20),
              SamplingParams(temperature=0.7, min_p=0.1, seed=7, max_tokens=9, presence_penalty=0.5),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, max_tokens=14)]
    batch_params = [seeded] + [others[i % len(others)] for i in range(15)]
    in_batch = llm.generate(PROMPTS, batch_params)[0].outputs[0].token_ids
    assert in_batch == alone
    llm.check_invariants()


def test_greedy_equals_temperature_zero_and_top_k_one(llm):
    greedy = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=12))
    top_k_one = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.8, top_k=1, max_tokens=12, seed=3))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top_k_one]


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = "The history of the printing press begins " * 6  # several full blocks
    before = llm.stats().prefix_cache_hits
    (output,) = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
    assert len(output.outputs) == 4 and all(len(o.token_ids) == 8 for o in output.outputs)
    assert len({tuple(o.token_ids) for o in output.outputs}) > 1  # seed + index: different samples
    # The forked samples did not look the prompt up again: they share the first sample's blocks.
    assert llm.stats().prefix_cache_hits == before
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in output.outputs]
    llm.check_invariants()


def test_stop_string_spanning_tokens_is_not_emitted(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    full = llm.generate("def fibonacci(n):", params)[0].outputs[0].text
    stop = full[8:14]  # a piece of text in the middle, whatever tokens it spans
    stopped = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
    completion = stopped[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[:full.index(stop)]
    kept = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                                             include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_min_tokens_and_stop_token_ids(llm):
    eos = sorted(llm.tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25)
    (output,) = llm.chat([{"role": "user", "content": "Say hi."}], params)
    assert len(output.outputs[0].token_ids) >= 25
    assert not set(output.outputs[0].token_ids[:25]) & set(eos)
    first = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].token_ids
    stopped = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[first[2]]))
    assert stopped[0].outputs[0].token_ids == first[:3]
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == first[2]
