"""Greedy tokens must not depend on how the engine schedules them (float32, the real model).

Sixteen different prompts, run one by one (the reference), all together, with a 32-token step
budget (16 on the tiny Qwen3, whose chat template makes shorter prompts; either way prompts are
prefilled in chunks and share steps with decodes), with a hot prefix cache (the same batch
again: blocks are reused, checked through stats()), and under forced preemption (a KV cache of
a few blocks, checked through stats()). Every scenario must give
exactly the reference token ids, and leave the block pool idle and consistent.

Each of those runs on the default model and on the tiny Qwen3 that test_families.py converts
(random weights: its logits spread over tens of units, so its greedy choices are no near-ties),
in float32, and on the tiny Qwen3-MoE requantized as Q4_K_M and run as stored (auto): its experts on
the packed kernel, whose rows, as every quantized product's, do not depend on the batch (float32
KV cache).

Also here: a request that could never fit (past the model's context, or larger than the whole
KV cache) fails at once with ContextLengthExceededError and leaves nothing queued.

Lower precisions (bfloat16, and the default `auto`: int4 on a CPU today) are held to a weaker rule,
because there the batch shape changes the rounding: oneDNN picks a different blocking (so a
different summation order) for a 1-row and a 16-row matrix product, and bfloat16 keeps 8
mantissa bits, so a logit near 30 moves by up to ~0.1 between the two. Tokens must then be
identical except where greedy decoding was nearly undecided: at the first differing position
the one-by-one run's top two candidates must be within NEAR_TIE_NATS, and before it the chosen
tokens' log-probabilities must agree within MAX_LOGPROB_DRIFT_NATS. Measured here (16 prompts,
16 tokens, 32-token chunks): bfloat16 14 of 16 identical, the other two part at tokens 4 and 5
where the top two were 0.06 and 0.13 nats apart, with at most 0.05 nats of drift before;
int8 and int4 (float32 activations and KV cache) 16 of 16 identical; an int8 KV cache quantizes
each token's heads on their own, so it keeps that.
"""

from __future__ import annotations

import pytest

from reference import prompt_token_ids
from tokios.errors import ContextLengthExceededError
from tokios.sampling_params import SamplingParams

MAX_TOKENS = 16
NEAR_TIE_NATS = 0.5
MAX_LOGPROB_DRIFT_NATS = 0.25
NUM_PREEMPTION_BLOCKS = 8  # 128 tokens: every request fits alone, two or three at once

PROMPTS = [
    [{"role": "user", "content": "What is gravity?"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write about rain."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
    [{"role": "user", "content": "Jak się masz?"}],
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colours are red,",
    "日本の首都は",
    "Kraków leży nad rzeką",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants it generally involves",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "In the year 1969, the first humans",
]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_together(llm, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy())
    llm.check_invariants()
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_blocks_used == 0
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module", params=["default", "qwen3", "qwen3moe"])
def scenario(request, tmp_path_factory) -> tuple[str | None, dict]:
    """The model the scheduling scenarios run on (None: the default model; else a converted tiny
    one) and the engine options it runs with."""
    if request.param == "default":
        return None, dict(dtype="float32")
    from converted import converted_model, quantized_model
    from test_families import FAMILIES

    if request.param == "qwen3moe":
        return str(quantized_model(FAMILIES["qwen3moe"], tmp_path_factory)), dict(dtype="auto",
                                                                                   kv_cache_dtype="float32")
    return str(converted_model(FAMILIES[request.param], tmp_path_factory).gguf_path), dict(dtype="float32")


@pytest.fixture(scope="module")
def model_path(scenario) -> str | None:
    return scenario[0]


@pytest.fixture(scope="module")
def engine_options(scenario) -> dict:
    return scenario[1]


@pytest.fixture(scope="module")
def chunk_tokens(model_path) -> int:
    """The chunked scenario's step budget, below the longest prompt's length."""
    return 32 if model_path is None else 16


@pytest.fixture(scope="module")
def plain_engine(model_path, engine_options):
    from tokios.engine import LLM

    return LLM(model_path, enable_prefix_caching=False, kv_cache_memory="64MiB", **engine_options)


@pytest.fixture(scope="module")
def prompts(plain_engine, chunk_tokens) -> list[list[int]]:
    token_ids = [prompt_token_ids(plain_engine.tokenizer, p) for p in PROMPTS]
    assert len({tuple(t) for t in token_ids}) == len(PROMPTS)
    assert max(len(t) for t in token_ids) > chunk_tokens  # at least one prompt spans several chunks
    return token_ids


@pytest.fixture(scope="module")
def reference_token_ids(plain_engine, prompts) -> list[list[int]]:
    """One request at a time: no batching, no chunking, no prefix cache."""
    result = []
    for token_ids in prompts:
        (output,) = plain_engine.generate([token_ids], greedy())
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        result.append(output.outputs[0].token_ids)
    plain_engine.check_invariants()
    return result


def test_all_together_equals_one_by_one(plain_engine, prompts, reference_token_ids):
    assert run_together(plain_engine, prompts) == reference_token_ids


def test_chunked_prefill_then_hot_prefix_cache_equal_one_by_one(model_path, engine_options, chunk_tokens, prompts,
                                                               reference_token_ids):
    from tokios.engine import LLM

    llm = LLM(model_path, max_num_batched_tokens=chunk_tokens, kv_cache_memory="64MiB", **engine_options)
    assert run_together(llm, prompts) == reference_token_ids  # cold cache, chunked
    hits_after_cold = llm.stats().prefix_cache_hits
    assert run_together(llm, prompts) == reference_token_ids  # the same batch again: a hot cache
    assert llm.stats().prefix_cache_hits > hits_after_cold
    assert llm.stats().num_blocks_cached > 0


@pytest.fixture(scope="module")
def tight_engine(model_path, engine_options, plain_engine):
    from tokios.engine import LLM

    block_bytes = plain_engine.kv_bytes_per_token() * 16
    return LLM(model_path, kv_cache_memory=NUM_PREEMPTION_BLOCKS * block_bytes, block_size=16, **engine_options)


def test_forced_preemption_equals_one_by_one(tight_engine, prompts, reference_token_ids):
    assert tight_engine.stats().num_blocks_total == NUM_PREEMPTION_BLOCKS
    assert run_together(tight_engine, prompts) == reference_token_ids
    assert tight_engine.stats().num_preemptions > 0


def test_request_larger_than_the_whole_kv_cache_fails_at_once(tight_engine, prompts):
    capacity = NUM_PREEMPTION_BLOCKS * 16
    too_long = prompts[0] + [prompts[0][-1]] * capacity
    with pytest.raises(ContextLengthExceededError, match=f"KV cache holds {capacity} tokens"):
        tight_engine.generate([too_long], greedy(1))
    with pytest.raises(ContextLengthExceededError) as raised:
        tight_engine.core.make_requests("never-fits", prompts[0], greedy(capacity))
    assert raised.value.code == "context_length_exceeded" and "\n" not in raised.value.message
    stats = tight_engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    (output,) = tight_engine.generate([prompts[1]], greedy(2))  # the queue is not blocked
    assert len(output.outputs[0].token_ids) == 2
    tight_engine.check_invariants()


def test_request_past_the_model_context_fails_at_once(plain_engine, prompts):
    limit = plain_engine.model_config.max_model_len
    with pytest.raises(ContextLengthExceededError, match=f"maximum context length is {limit} tokens"):
        plain_engine.generate([prompts[0]], greedy(limit))
    stats = plain_engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    plain_engine.check_invariants()


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("bfloat16", "auto"), ("auto", "auto"), ("auto", "int8")])
def test_low_precision_parts_from_one_by_one_only_at_near_ties(dtype, kv_cache_dtype):
    from tokios.engine import LLM

    llm = LLM(dtype=dtype, max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_memory="64MiB",
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    token_ids = [prompt_token_ids(llm.tokenizer, p) for p in PROMPTS]
    alone = [llm.generate([t], params)[0].outputs[0] for t in token_ids]
    together = [o.outputs[0] for o in llm.generate(token_ids, params)]
    llm.check_invariants()
    num_identical = assert_parts_only_at_near_ties(together, alone, dtype)
    print(f"\n{dtype} ({llm.core.weight_format}, KV {kv_cache_dtype}): {num_identical} of {len(PROMPTS)} "
          "prompts identical")


def assert_parts_only_at_near_ties(outputs, references, label: str, *, near_tie_nats: float = NEAR_TIE_NATS,
                                   max_drift_nats: float = MAX_LOGPROB_DRIFT_NATS) -> int:
    """Each output's tokens equal its reference's up to a position where the reference's top two
    candidates were within near_tie_nats, with the chosen tokens' log-probabilities within
    max_drift_nats before it (both generated with logprobs=2). Returns how many were
    identical throughout."""
    num_identical = 0
    for index, (ours, reference) in enumerate(zip(outputs, references)):
        assert len(ours.token_ids) == len(reference.token_ids)
        parted_at = next((i for i, (a, b) in enumerate(zip(ours.token_ids, reference.token_ids)) if a != b), None)
        num_identical += parted_at is None
        agreed = len(ours.token_ids) if parted_at is None else parted_at
        for position in range(agreed):
            token_id = reference.token_ids[position]
            drift = abs(ours.logprobs[position][token_id].logprob - reference.logprobs[position][token_id].logprob)
            assert drift <= max_drift_nats, (index, position, drift)
        if parted_at is not None:
            top_two = sorted((lp.logprob for lp in reference.logprobs[parted_at].values()), reverse=True)[:2]
            gap = top_two[0] - top_two[1]
            print(f"\n{label}: prompt {index} parts at token {parted_at}, top-two gap {gap:.3f} nats")
            assert gap <= near_tie_nats, f"prompt {index} parts at token {parted_at} with a clear winner ({gap:.2f} nats)"
    return num_identical


def generate_beside_a_sliced_prompt(llm, streams: list[list[int]], long_prompt: list[int], stream_tokens: int,
                                    layer_slices: bool = True, long_tokens: int = MAX_TOKENS):
    """Greedy outputs of `streams` (stream_tokens each) and `long_prompt` (long_tokens) run
    together with 256-token steps under a 1 ms step budget: after the first step (no decodes,
    no budget) the budget never holds the floor of whole-model tokens, so with layer slices on
    every later chunk of the long prompt runs one layer a step while the streams decode (off:
    4-token whole chunks). The step cost model is calibrated first by the streams alone. The
    prefix cache is out of play (else a second run would reuse the first one's KV, or a shared
    engine the KV of earlier tests); the engine's settings are put back after. Returns (token
    ids per prompt, layer slices)."""
    scheduler, kv = llm.core.scheduler, llm.core.kv
    settings = scheduler.max_step_s, scheduler.num_sliceable_layers, scheduler.max_num_batched_tokens
    prefix_caching = kv.enable_prefix_caching
    scheduler.max_step_s, scheduler.max_num_batched_tokens = 0.001, 256
    kv.enable_prefix_caching = False
    scheduler.num_sliceable_layers = llm.model_config.num_layers if layer_slices else None
    slices = []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        slices.extend(s.layer_slice for s in output.scheduled if s.layer_slice is not None)
        return output

    try:
        llm.generate(streams, greedy(4))
        assert scheduler.step_cost.is_calibrated
        scheduler.schedule = recording_schedule
        outputs = llm.generate([*streams, long_prompt], [greedy(stream_tokens)] * len(streams) + [greedy(long_tokens)])
    finally:
        scheduler.__dict__.pop("schedule", None)
        scheduler.max_step_s, scheduler.num_sliceable_layers, scheduler.max_num_batched_tokens = settings
        kv.enable_prefix_caching = prefix_caching
    llm.check_invariants()
    assert llm.stats().num_blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs], slices


def test_a_prompt_prefilled_in_layer_slices_gives_the_tokens_of_whole_chunks():
    """The default weights (int4 on the C++ kernels): a 700-token prompt, after its first
    chunk, goes through the layers one a step beside three decoding streams; every request's
    tokens must equal the run where its chunks stay whole (--no-prefill-layer-slices)."""
    from tokios.engine import LLM

    llm = LLM(kv_cache_memory="64MiB")
    text = llm.tokenizer.encode(PROMPTS[12] * 20)
    streams = [prompt_token_ids(llm.tokenizer, p) for p in PROMPTS[:3]]
    sliced_tokens, slices = generate_beside_a_sliced_prompt(llm, streams, text[:700], stream_tokens=200)
    whole_tokens, no_slices = generate_beside_a_sliced_prompt(llm, streams, text[:700], stream_tokens=200,
                                                              layer_slices=False)
    assert not no_slices
    # One layer a step while the streams decode (once they end, a step has no budget and the
    # chunk in flight finishes its layers at once).
    assert sum(s.stop - s.start == 1 for s in slices) >= 4 * llm.model_config.num_layers
    assert sliced_tokens == whole_tokens
