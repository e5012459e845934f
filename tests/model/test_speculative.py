"""Speculative decoding on the real model: lossless under greedy, with every proposer.

- Greedy outputs with speculation equal those without, for 16 prompts, for n-gram, self-draft
  (early exit) and a draft model, one request at a time and all 16 batched, in the default
  dtype (int4 kernels: verify rows are decode rows, so they run the very kernels plain decoding
  runs); float32 runs them on the tiny Qwen3 below, and the chaos test runs the real model in
  float32.
- A chaos proposer that proposes the true continuation corrupted at random positions, under
  concurrent load with a KV cache small enough to preempt: outputs equal, KV invariant holds.
- Penalties, min_tokens and logprobs: the same tokens and logprobs with and without speculation.
- Draft = target in float32: every proposal is accepted under greedy.
- A draft whose tokenizer differs is refused with a clear error.

All of it also runs on the tiny Qwen3 that test_families.py converts (float32, the file as its
own draft model, self-draft from its first two layers), and on the tiny Qwen3-MoE requantized as
Q4_K_M, as stored: its experts on the packed kernel, in the fused decode step and the verify rows
alike.

The default-dtype engine runs without prefix caching: a prefix hit changes how a prompt was
prefilled, which can move low-order bits in that dtype (docs/architecture.md), and that is not
what these tests are about.
"""

from __future__ import annotations

import random

import pytest

from tokios.config import SpeculativeConfig
from tokios.errors import InvalidRequestError
from tokios.model_files import default_model_path
from tokios.sampling_params import SamplingParams
from tokios.speculative.proposers import check_tokenizers_compatible

MAX_TOKENS = 16
K = 4
CODE = "def area(width, height):\n    result = width * height\n    return result\n"
PROMPTS = [
    "Repeat this code with the variable result renamed to size:\n" + CODE,
    "Copy this sentence exactly: the cat sat on the mat and the cat sat on the hat.",
    "List: apple, banana, cherry, apple, banana, cherry, apple,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Say it again: hello world, hello world, hello",
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "The three primary colours are red,",
    "Kraków leży nad rzeką",
    "The quick brown fox",
    "In the year 1969, the first humans",
    "Name three colours.",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "<html><body><p>one</p><p>two</p><p>",
]
METHODS = ["ngram", "self_draft", "draft_model"]


def greedy(method: str | None = None) -> SamplingParams:
    speculative = {"method": method or "none"}
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, speculative=speculative)


def make_engine(dtype: str, kv_cache_memory: str = "64MiB", model: str | None = None, self_draft_num_layers: int = 20,
                **kwargs):
    """An engine on `model` (None: the default model) whose draft model is that same file."""
    from tokios.engine import LLM

    config = SpeculativeConfig(num_speculative_tokens=K, draft_model=model or str(default_model_path()),
                               draft_dtype=dtype, enable_adaptive=False, self_draft_num_layers=self_draft_num_layers)
    return LLM(model, dtype=dtype, enable_prefix_caching=dtype == "float32", kv_cache_memory=kv_cache_memory,
               max_num_batched_tokens=2048, speculative_config=config, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


# The tiny Qwen3 runs the first 4 prompts one by one (code to copy, a sentence to copy, two
# repeating lists), and all 16 batched; the stored format runs every prompt both ways.
NUM_SINGLE_PROMPTS = {"auto": len(PROMPTS), "qwen3": 4, "qwen3moe": 4}


@pytest.fixture(scope="module", params=["auto", "qwen3", "qwen3moe"])
def engine(request, tmp_path_factory):
    from converted import converted_model, quantized_model
    from test_families import FAMILIES

    if request.param == "qwen3":
        path = str(converted_model(FAMILIES["qwen3"], tmp_path_factory).gguf_path)
        llm = make_engine("float32", model=path, self_draft_num_layers=2)
    elif request.param == "qwen3moe":
        path = str(quantized_model(FAMILIES["qwen3moe"], tmp_path_factory))
        llm = make_engine("auto", model=path, self_draft_num_layers=2, kv_cache_dtype="float32")
    else:
        llm = make_engine(request.param)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    plain_batched = token_ids(llm.generate(prompts, greedy()))
    plain_single = [token_ids(llm.generate([p], greedy()))[0] for p in prompts[:NUM_SINGLE_PROMPTS[request.param]]]
    return llm, prompts, plain_single, plain_batched


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_speculation_equals_greedy_without(engine, method):
    llm, prompts, plain_single, plain_batched = engine
    before = llm.stats()
    single = [token_ids(llm.generate([p], greedy(method)))[0] for p in prompts[:len(plain_single)]]
    batched = token_ids(llm.generate(prompts, greedy(method)))
    assert single == plain_single
    assert batched == plain_batched
    after = llm.stats()
    assert after.spec_num_drafts > before.spec_num_drafts  # speculation really ran
    llm.check_invariants()


def test_penalties_min_tokens_and_logprobs_speculate_with_plain_decoding_results(engine):
    # An oracle proposes the true penalized continuation. Verify row j must count the proposals
    # before j (penalties, output length for min_tokens): then every proposal is accepted and the
    # tokens and logprobs equal plain decoding; with the counts wrong, strong penalties move the
    # argmax of later rows and proposals get rejected.
    llm, prompts, _, _ = engine

    def params(method: str) -> SamplingParams:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                              presence_penalty=0.5, min_tokens=MAX_TOKENS, logprobs=3,
                              speculative={"method": method})

    plain = llm.generate(prompts, params("none"))
    ngram = llm.core.speculator.proposers["ngram"]
    llm.core.speculator.proposers["ngram"] = ChaosProposer(
        {tuple(p): output.outputs[0].token_ids for p, output in zip(prompts, plain)}, seed=0, corruption=0.0)
    try:
        before = llm.stats()
        speculated = llm.generate(prompts, params("ngram"))
        after = llm.stats()
    finally:
        llm.core.speculator.proposers["ngram"] = ngram
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0 and after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == drafted
    for a, b in zip(plain, speculated):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == len(a.outputs[0].logprobs) == MAX_TOKENS
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            for token_id in step_a:
                assert step_b[token_id].rank == step_a[token_id].rank
                assert step_b[token_id].logprob == pytest.approx(step_a[token_id].logprob, abs=1e-4)
    llm.check_invariants()


# float32 only: there the draft's steps are exactly the target's.
@pytest.mark.parametrize("engine", ["qwen3"], indirect=True)
def test_draft_equal_to_target_in_float32_accepts_everything(engine):
    llm, prompts, plain_single, _ = engine
    assert llm.core.weight_format == "float32"
    before = llm.stats()
    outputs = token_ids(llm.generate(prompts[:4], greedy("draft_model")))
    assert outputs == plain_single[:4]
    after = llm.stats()
    num_drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert num_drafted > 0
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == num_drafted


class ChaosProposer:
    """Proposes the true greedy continuation, corrupted at random positions (seeded)."""

    method = "ngram"

    def __init__(self, prompt_to_expected: dict[tuple, list[int]], seed: int, corruption: float = 0.3):
        self.prompt_to_expected = prompt_to_expected
        self.random = random.Random(seed)
        self.corruption = corruption

    def propose(self, requests, num_tokens, block_ids):
        proposals = []
        for request, k in zip(requests, num_tokens):
            expected = self.prompt_to_expected[tuple(request.prompt_token_ids)]
            done = request.num_output_tokens
            proposal = list(expected[done:done + k])
            for index in range(len(proposal)):
                if self.random.random() < self.corruption:
                    proposal[index] = self.random.randrange(1000, 40000)
            proposals.append(proposal)
        return proposals

    def on_verified(self, request):
        pass

    def drop(self, request_id):
        pass


def test_chaos_rejections_under_concurrent_load_keep_outputs_and_the_kv_invariant():
    # float32, because a recompute after preemption is exact only there (docs/architecture.md).
    # 46,080 bytes per token: 9 MB is 12 blocks of 16 tokens for 16 requests of about 3 blocks
    # each, so requests are preempted and recomputed.
    llm = make_engine("float32", kv_cache_memory="9MB", max_num_seqs=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = token_ids(llm.generate(prompts, greedy()))
    llm.core.speculator.proposers["ngram"] = ChaosProposer(
        {tuple(p): e for p, e in zip(prompts, expected)}, seed=1234)
    before = llm.stats()
    outputs = token_ids(llm.generate(prompts, greedy("ngram")))
    assert outputs == expected
    after = llm.stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert 0 < accepted < drafted  # both acceptances and rejections happened
    assert after.num_preemptions > before.num_preemptions
    llm.check_invariants()
    assert after.num_blocks_used == 0


def test_a_draft_with_another_tokenizer_is_refused():
    class FakeTokenizer:
        def __init__(self, tokens):
            self.tokens = tokens

        def convert_ids_to_tokens(self, ids):
            return [self.tokens[i] for i in ids]

    target = FakeTokenizer(["a", "b", "c", "d"])
    check_tokenizers_compatible(target, FakeTokenizer(["a", "b", "c"]), 4, 3, "draft.gguf")
    with pytest.raises(InvalidRequestError, match="incompatible tokenizer: token id 1 is 'x'"):
        check_tokenizers_compatible(target, FakeTokenizer(["a", "x", "c", "d"]), 4, 4, "draft.gguf")
    with pytest.raises(InvalidRequestError, match="larger than the target"):
        check_tokenizers_compatible(target, FakeTokenizer(["a"] * 5), 4, 5, "draft.gguf")


GRAMMAR_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                                   "confidence": {"enum": ["low", "medium", "high"]}},
                  "required": ["answer", "confidence"], "additionalProperties": False}


# The stored format only: exactness under a grammar does not depend on the precision (the
# float32 engine's steps cost several times more and run every other speculation test here).
@pytest.mark.parametrize("engine", ["auto"], indirect=True)
def test_a_grammar_with_speculation_gives_the_greedy_output_without(engine):
    # Lossless under a grammar: proposals the grammar refuses are cut before verification, and
    # verify row j is masked as the grammar stands after the first j proposals. Every method,
    # and an oracle whose proposals are corrupted at random (mostly into tokens the grammar
    # refuses), must give exactly plain constrained decoding's tokens.
    from tokios.structured import StructuredOutput

    llm, prompts, _, _ = engine
    prompts = prompts[:8]

    def params(method: str) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.json(GRAMMAR_SCHEMA),
                              speculative={"method": method})

    plain = token_ids(llm.generate(prompts, params("none")))
    assert all(output.startswith('{"answer": "') for output in
               (llm.tokenizer.decode(ids) for ids in plain))
    ngram = llm.core.speculator.proposers["ngram"]
    llm.core.speculator.proposers["ngram"] = ChaosProposer(
        {tuple(p): ids for p, ids in zip(prompts, plain)}, seed=3, corruption=0.3)
    try:
        before = llm.stats()
        assert token_ids(llm.generate(prompts, params("ngram"))) == plain
        after = llm.stats()
    finally:
        llm.core.speculator.proposers["ngram"] = ngram
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    for method in ("ngram", "self_draft"):
        assert token_ids(llm.generate(prompts, params(method))) == plain, method
    llm.check_invariants()


def test_a_thinking_budget_with_speculation_gives_the_greedy_output_without(engine):
    # The budget forces the end of the thinking at its token count: verify row j must be masked
    # as the budget stands after j proposals (a proposal past the budget that is not the forced
    # id is cut), and EOS is never sampled inside the thinking. An oracle corrupting the true
    # continuation at random, and the real proposers, must give plain decoding's tokens.
    from tokios.reasoning import THINK, ThinkingBudget

    llm, prompts, _, _ = engine
    prompts = prompts[:6]
    tokenizer = llm.tokenizer
    forced_ids = tuple(tokenizer.encode(THINK.forced_end, add_special_tokens=False))
    budget = ThinkingBudget(5, tuple(tokenizer.encode(THINK.start, add_special_tokens=False)),
                            tuple(tokenizer.encode(THINK.end, add_special_tokens=False)), forced_ids,
                            starts_inside=True, stop_ids=tuple(sorted(tokenizer.eos_token_ids)))

    def params(method: str) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.0, thinking_budget=budget, speculative={"method": method})

    plain = token_ids(llm.generate(prompts, params("none")))
    for ids in plain:  # the models never close a thinking block themselves: the budget does
        assert tuple(ids[5:5 + len(forced_ids)]) == forced_ids
        assert not set(ids[:5]) & set(tokenizer.eos_token_ids)
    ngram = llm.core.speculator.proposers["ngram"]
    llm.core.speculator.proposers["ngram"] = ChaosProposer(
        {tuple(p): ids for p, ids in zip(prompts, plain)}, seed=5, corruption=0.3)
    try:
        assert token_ids(llm.generate(prompts, params("ngram"))) == plain
    finally:
        llm.core.speculator.proposers["ngram"] = ngram
    for method in ("ngram", "self_draft"):
        assert token_ids(llm.generate(prompts, params(method))) == plain, method
    llm.check_invariants()
