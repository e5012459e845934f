"""The fused all-layer C++ decode step computes exactly what the per-op path computes."""

import pytest

from tokios.engine import LLM
from tokios.model.kernels import load_extension
from tokios.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(load_extension() is None, reason="C++ kernel could not be built on this machine")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Zażółć gęślą jaźń to", "東京は"]


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_fused_and_per_op_decode_agree_bit_for_bit(dtype):
    # No prefix caching: the second run must prefill exactly as the first, so that only the
    # decode path differs between the two.
    llm = LLM(dtype=dtype, enable_prefix_caching=False)
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
