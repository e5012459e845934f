"""The fused all-layer C++ decode step computes exactly what the per-op path computes."""

import math

import pytest

from tokios.engine import LLM
from tokios.model.kernels import load_extension
from tokios.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(load_extension() is None, reason="C++ kernel could not be built on this machine")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Zażółć gęślą jaźń to", "東京は"]


@pytest.fixture(params=["default", "qwen3"])
def model_path(request, tmp_path_factory) -> str | None:
    """The default model (None), or the tiny Qwen3 that test_families.py converts: its per-head
    q/k norms are a part of the fused step that Llama-shaped layers do not reach."""
    if request.param == "default":
        return None
    from converted import converted_model
    from test_families import FAMILIES

    return str(converted_model(FAMILIES[request.param], tmp_path_factory).gguf_path)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_fused_and_per_op_decode_agree_bit_for_bit(dtype, model_path):
    # No prefix caching: the second run must prefill exactly as the first, so that only the
    # decode path differs between the two.
    llm = LLM(model_path, dtype=dtype, enable_prefix_caching=False)
    assert llm.core.model.can_fuse_decode
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    fused = llm.generate(PROMPTS, params)
    llm.core.model.can_fuse_decode = False
    per_op = llm.generate(PROMPTS, params)
    for a, b in zip(fused, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{k: v.logprob for k, v in step.items()} for step in a.outputs[0].logprobs] == \
               [{k: v.logprob for k, v in step.items()} for step in b.outputs[0].logprobs]
    llm.check_invariants()


def test_short_prompt_chunks_run_as_decode_rows_as_close_to_float32_as_spans(engine_float32):
    """A short prompt chunk is laid out as one decode row per token (C++ decode attention, the
    fused step when every row is such); a long one as a span (SDPA). The two differ in float
    rounding, which 8-bit activation rounding can amplify (measured: up to 0.3 nats on one
    position of 40, mean 0.04), so each is held to the float32 engine instead: both layouts
    must be as close to it as int4 is (mean 0.05 nats here); a wrong context would be nats off."""
    llm = LLM(dtype="int4", enable_prefix_caching=False)
    runner = llm.core.runner
    long_len = math.isqrt(runner.MAX_DECODE_ROW_PAIRS) + 1  # the shortest fresh prompt laid out as a span
    short, long = llm.core.make_requests("short", list(range(100, 140)), SamplingParams())[0], \
        llm.core.make_requests("long", [100 + i % 300 for i in range(long_len)], SamplingParams())[0]
    long_blocks = list(range(3, 3 + -(-long_len // llm.core.config.cache.block_size)))
    batch = runner.build_batch([(short, 40, [[0, 1, 2]]), (long, long_len, [long_blocks])])
    assert batch.metadata.num_decode_tokens == 40 and [s.query_len for s in batch.metadata.spans] == [long_len]
    assert batch.entry_rows[0] == list(range(40))

    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def prompt_logprobs(engine) -> list[float]:
        (output,) = engine.generate([prompt], params)
        return [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]

    reference = prompt_logprobs(engine_float32)
    as_decode_rows = prompt_logprobs(llm)
    runner.MAX_DECODE_ROW_PAIRS = 0  # every chunk a span
    as_span = prompt_logprobs(llm)
    for ours in (as_decode_rows, as_span):
        assert sum(abs(a - b) for a, b in zip(ours, reference)) / len(reference) < 0.1
    llm.check_invariants()
