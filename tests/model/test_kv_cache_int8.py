"""The int8 KV cache (--kv-cache-dtype int8, kv_cache/dtypes.py) on the real model: what it
holds in a fixed memory against bfloat16, how closely its greedy tokens follow bfloat16's at
4,000 tokens of context, and that the prefix cache's disk tier keeps its scales across a
restart (and never serves another format's blocks). The perplexity gate is in test_perplexity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokios.engine import LLM
from tokios.errors import ContextLengthExceededError
from tokios.sampling_params import SamplingParams

DATA = Path(__file__).parent.parent / "data"
# Measured over four questions of 64 tokens each: 245 of 256 (95.7%) on an AVX-512 host; 249 (97.3%)
# and, after the register-blocked attention (a different summation order, which moves bfloat16's
# own reference reply from its 9th token on), 241 (94.1%) on an AVX2 one. Fewer tokens made the
# share a coin toss: 2 questions of 32 gave 62/64, then 57/64, for those same two builds.
MIN_TEACHER_FORCED_AGREEMENT = 0.90


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_int8_holds_1_9x_the_tokens_of_bfloat16_in_the_same_memory():
    bf16 = LLM(kv_cache_memory="32MiB", kv_cache_dtype="bfloat16")
    int8 = LLM(kv_cache_memory="32MiB", kv_cache_dtype="int8")
    assert int8.kv_bytes_per_token() == 2 * 30 * 3 * (64 + 4)  # a float32 scale per token and head
    blocks = bf16.stats().num_blocks_total, int8.stats().num_blocks_total
    assert blocks[1] / blocks[0] == pytest.approx(128 / 68, rel=0.01)
    # A prompt that only the int8 cache can hold is refused by bfloat16 and served by int8.
    prompt = int8.tokenizer.encode((DATA / "long_context_text.txt").read_text(encoding="utf-8"))[:2000]
    assert blocks[0] * 16 < len(prompt) + 8 <= blocks[1] * 16
    with pytest.raises(ContextLengthExceededError):
        bf16.generate([prompt], greedy(8))
    (output,) = int8.generate([prompt], greedy(8))
    assert len(output.outputs[0].token_ids) == 8
    int8.check_invariants()


@pytest.fixture(scope="module")
def long_conversations() -> list[list[dict]]:
    document = "\n\n".join((DATA / name).read_text(encoding="utf-8")
                           for name in ("long_context_text.txt", "perplexity_text.txt"))
    return [[{"role": "user", "content": f"{document}\n\n{question}"}]
            for question in ("Who was the engineer of the canal, and what did he think of locks?",
                             "Who steered the last commercial cargo, and when?",
                             "Summarise the history of the canal in three sentences.",
                             "What happened to the canal after the railways came?")]


def test_long_context_greedy_tokens_follow_bfloat16(long_conversations):
    """At 4,000+ tokens of context, int8's greedy choice after each prefix of bfloat16's own
    greedy reply (teacher-forced, so one early near-tie does not decide every later position)
    agrees with bfloat16's for at least MIN_TEACHER_FORCED_AGREEMENT of the tokens."""
    # The conversations share their document: one alone first puts it in the prefix cache, so
    # the four together prefill it once, not four times (about 20 s of the test on 2 cores).
    bf16 = LLM(kv_cache_memory="256MiB", kv_cache_dtype="bfloat16")
    bf16.chat(long_conversations[:1], greedy(1))
    references = bf16.chat(long_conversations, greedy(64))
    bf16.close()
    int8 = LLM(kv_cache_memory="256MiB", kv_cache_dtype="int8")
    int8.chat(long_conversations[:1], greedy(1))
    agreed = total = 0
    for reference in references:
        prompt, tokens = list(reference.prompt_token_ids), reference.outputs[0].token_ids
        assert len(prompt) >= 4000
        forced = int8.generate([prompt + tokens[:k] for k in range(len(tokens))], greedy(1))
        agreed += sum(output.outputs[0].token_ids[0] == token for output, token in zip(forced, tokens))
        total += len(tokens)
    int8.check_invariants()
    print(f"\nteacher-forced agreement with bfloat16 at {len(prompt)} tokens: {agreed}/{total} = {agreed / total:.1%}")
    assert agreed / total >= MIN_TEACHER_FORCED_AGREEMENT


def test_the_disk_tier_keeps_int8_blocks_across_a_restart_and_never_serves_another_format(tmp_path):
    prompt = (DATA / "perplexity_text.txt").read_text(encoding="utf-8")[:1500]
    plain = LLM(kv_cache_memory="64MiB", kv_cache_dtype="int8")
    expected = plain.generate(prompt, greedy(12))[0].outputs[0].token_ids
    plain.close()
    first = LLM(kv_cache_memory="64MiB", kv_cache_dtype="int8", kv_cache_disk=str(tmp_path))
    assert first.generate(prompt, greedy(12))[0].outputs[0].token_ids == expected
    first.close()
    restarted = LLM(kv_cache_memory="64MiB", kv_cache_dtype="int8", kv_cache_disk=str(tmp_path))
    assert restarted.generate(prompt, greedy(12))[0].outputs[0].token_ids == expected
    assert restarted.stats().disk_cache_hit_tokens >= 16 * 10
    restarted.check_invariants()
    restarted.close()
    # The directory holds int8 blocks: a bfloat16 engine over it finds none of its own.
    other = LLM(kv_cache_memory="64MiB", kv_cache_dtype="bfloat16", kv_cache_disk=str(tmp_path))
    other.generate(prompt, greedy(2))
    assert other.stats().disk_cache_hit_tokens == 0 and other.stats().disk_cache_rejected == 0
    other.close()
