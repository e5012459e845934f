"""Gemma 3 270M (Q4_K_M GGUF, the pretrained model) against transformers float32 on the same file.

transformers' results are read from the golden file tests/data/golden/gemma3.json (golden.py,
make_golden.py, which loads transformers on this file in about 30 s). The live transformers
comparison of the architecture is the tiny Gemma 3 converted by llama.cpp's own script in
test_families.py, on every run.

- Greedy continuations of 24 tokens for 10 raw-completion prompts are identical to transformers'
  in float32, and the logits at every position of prompt plus continuation agree within
  LOGITS_ATOL. The prompts were chosen so that no continuation position is a near-tie: of 20
  candidates, those whose smallest top-two logit gap over the 24 positions was under 0.05 were
  dropped ("The capital of France is" has 0.012 at token 15, "Die Hauptstadt von Deutschland
  ist" 0.002); the smallest gap of those kept (0.062) is asserted and printed.
- A 1,400-token prompt (well past the 512-token window; chunked prefill of 256-token chunks, so
  chunks straddle window edges) has logits equal to the reference at every position; then it
  decodes past the window and matches transformers' greedy tokens.
- The tokenizer gives transformers' ids on a multilingual corpus, adds BOS as the file says,
  and streams UTF-8-safe text over byte-fallback pieces.
- Perplexity on the ~1,000-token text: float32 matches to 1e-4, the file's own blocks within 1%.
- The KV cache frees sliding-layer blocks out of the window during a long request, and an agent's
  conversation re-sent every turn (tokios/tools/bench/agent_session.py, the built-in gemma
  template) still hits the cache: the next turn needs the sliding groups' last window only.

"""

from __future__ import annotations

import pytest
import torch

from golden import largest_summary_difference, load_golden
from reference import engine_perplexity, engine_prompt_logits
from test_perplexity import TEXT_PATH
from test_tokenizer_parity import CORPUS
from tokios.model_files import gemma3_model_path
from tokios.sampling_params import SamplingParams
from tokios.tokenizer.detokenizer import IncrementalDetokenizer

NUM_TOKENS = 24
LONG_PROMPT_TOKENS = 1400
# Measured here: largest difference 2.9e-4 over all prompts (logits up to ~40 in magnitude).
LOGITS_ATOL = 3e-3
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Water boils at a temperature of",
    "東京は日本の首都で、",
    "1, 2, 3, 4, 5, 6,",
    "The chemical symbol for gold is",
    "The quick brown fox jumps over",
    "In 1969, Neil Armstrong became",
    "import numpy as np\n\nx = np.",
    "<html>\n<head>\n<title>",
    "The largest planet in the solar system is",
]
GEMMA_CORPUS = CORPUS + [
    "<start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after an explicit BOS",
    "रिश्ते 😀 한국어 ğüşöç ¿Qué? «ça» — “quotes” …",
    "x = [i**2 for i in range(10)]  # squares\n\t\treturn {'a': 1}",
    "\u200b\u200d\ufeff zero-width and BOM",
    "unmapped byte fallback: \U0001fae8 \U000e0041 \u0fff",
]


@pytest.fixture(scope="module")
def gemma_path():
    return gemma3_model_path()


@pytest.fixture(scope="module")
def gemma_golden(gemma_path):
    return load_golden("gemma3", gemma_path)


def long_prompt_text() -> str:
    text = TEXT_PATH.read_text(encoding="utf-8")
    return text + "\n\n" + text


@pytest.fixture(scope="module")
def gemma_float32(gemma_path):
    from tokios.engine import LLM

    return LLM(model=str(gemma_path), dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def gemma_stored(gemma_path):
    from tokios.engine import LLM

    return LLM(model=str(gemma_path), kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def continuations(gemma_float32):
    token_ids = [gemma_float32.tokenizer.encode(prompt) for prompt in PROMPTS]
    outputs = gemma_float32.generate(token_ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                               ignore_eos=True))
    gemma_float32.check_invariants()
    return [(ids, output.outputs[0].token_ids) for ids, output in zip(token_ids, outputs)]


def golden_sequences(gemma_golden, continuations) -> list[dict]:
    """The golden sequence of each prompt, checked to start with the engine's prompt ids."""
    sequences = [gemma_golden["sequences"][str(index)] for index in range(len(PROMPTS))]
    assert len(gemma_golden["sequences"]) == len(PROMPTS), "PROMPTS changed: regenerate gemma3.json"
    for index, ((prompt_ids, _), golden) in enumerate(zip(continuations, sequences)):
        assert prompt_ids == golden["prompt_ids"], f"prompt {index} changed: regenerate gemma3.json"
    return sequences


def test_greedy_continuations_match_transformers(continuations, gemma_golden):
    """transformers' greedy continuation of each prompt (golden) is ours, and no position of it is a near-tie."""
    smallest_gap = float("inf")
    for index, ((prompt_ids, ours), golden) in enumerate(zip(continuations, golden_sequences(gemma_golden,
                                                                                              continuations))):
        top_two = torch.tensor(golden["top_logits"])[len(prompt_ids) - 1:-1, :2]
        smallest_gap = min(smallest_gap, (top_two[:, 0] - top_two[:, 1]).min().item())
        assert ours == golden["greedy_ids"], f"prompt {index} {PROMPTS[index]!r}"
    print(f"\nsmallest top-two logit gap over the continuations: {smallest_gap:.3f}")
    assert smallest_gap > 0.05, "a prompt sits on a near-tie; pick another"


def test_logits_at_every_position_match_transformers(continuations, gemma_golden, gemma_float32):
    """At every position of prompt plus continuation: the golden top-k logits and the logsumexp
    (the whole-vocabulary comparison with live transformers is test_families.py's, on a tiny
    Gemma 3)."""
    largest = 0.0
    for (prompt_ids, continuation), golden in zip(continuations, golden_sequences(gemma_golden, continuations)):
        token_ids = prompt_ids + continuation
        ours = engine_prompt_logits(gemma_float32, token_ids)
        assert ours.shape == (len(token_ids), 262144)
        largest = max(largest, largest_summary_difference(ours, golden, same_argmax=False))
    print(f"\nlargest logit difference: {largest:.2e}")
    assert largest <= LOGITS_ATOL


@pytest.fixture(scope="module")
def long_prompt(gemma_float32, gemma_golden):
    token_ids = gemma_float32.tokenizer.encode(long_prompt_text())[:LONG_PROMPT_TOKENS]
    assert len(token_ids) == LONG_PROMPT_TOKENS
    assert token_ids == gemma_golden["long_prompt"]["prompt_ids"], "the long prompt changed: regenerate gemma3.json"
    return token_ids


def test_long_prompt_past_the_window_matches_at_every_position(long_prompt, gemma_float32, gemma_golden):
    """Through the engine's own chunked prefill (256-token chunks over the paged, windowed KV
    cache): the prompt logprobs at every position, then greedy decoding past the window."""
    golden = gemma_golden["long_prompt"]
    (output,) = gemma_float32.generate([long_prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                     prompt_logprobs=0))
    ours = [entry[token_id].logprob for entry, token_id in zip(output.prompt_logprobs[1:], long_prompt[1:])]
    expected = torch.tensor(golden["next_token_logits"]) - torch.tensor(golden["logsumexp"][:-1])
    difference = (torch.tensor(ours) - expected).abs()
    print(f"\nlargest prompt-logprob difference over 1,400 positions: {difference.max().item():.2e}")
    assert difference.max().item() <= LOGITS_ATOL
    assert output.outputs[0].token_ids == golden["greedy_ids"]
    gemma_float32.check_invariants()


def test_engine_logits_of_the_long_prompt_in_one_pass(long_prompt, gemma_float32, gemma_golden):
    """The same positions in one causal pass with an independently built window mask (catches a
    window off-by-one that the runner and the model could share): at every position the next
    token's logit, the largest logit and the logsumexp over the whole vocabulary."""
    golden = gemma_golden["long_prompt"]
    ours = engine_prompt_logits(gemma_float32, long_prompt)  # reduced in float32, as in golden.py
    next_ids = torch.tensor(long_prompt[1:])[:, None]
    differences = [ours[:-1].gather(1, next_ids).squeeze(1).double() - torch.tensor(golden["next_token_logits"]),
                   ours.max(-1).values.double() - torch.tensor(golden["top_logits"]),
                   torch.logsumexp(ours, dim=-1).double() - torch.tensor(golden["logsumexp"])]
    assert max(difference.abs().max().item() for difference in differences) <= LOGITS_ATOL


def test_tokenizer_ids_equal_transformers(gemma_float32, gemma_golden):
    reference = gemma_golden["tokenizer"]
    assert [entry["text"] for entry in reference] == GEMMA_CORPUS, "GEMMA_CORPUS changed: regenerate gemma3.json"
    ours = gemma_float32.tokenizer
    for entry in reference:
        text = entry["text"]
        assert ours.encode(text) == entry["ids"], repr(text)
        assert ours.encode(text, add_special_tokens=False) == entry["ids_without_special_tokens"]
    assert ours.encode("hi")[0] == ours.bos_token_id == 2
    assert ours.decode(ours.encode(GEMMA_CORPUS[-1]), skip_special_tokens=True) == GEMMA_CORPUS[-1]


def test_streaming_detokenization_is_utf8_safe_over_byte_pieces(gemma_float32):
    tokenizer = gemma_float32.tokenizer
    for text in GEMMA_CORPUS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        deltas = [detokenizer.add_tokens([token_id]) for token_id in ids] + [detokenizer.flush()]
        assert "".join(deltas) == tokenizer.decode(ids), repr(text)
        assert not any(delta.endswith("\ufffd") for delta in deltas if "\ufffd" not in text)


@pytest.fixture(scope="module")
def text_ids(gemma_float32):
    token_ids = gemma_float32.tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"))
    assert 900 <= len(token_ids) <= 1100
    return token_ids


@pytest.fixture(scope="module")
def reference_text_perplexity(gemma_golden, text_ids):
    assert text_ids == gemma_golden["perplexity"]["token_ids"], "the text's ids changed: regenerate gemma3.json"
    return gemma_golden["perplexity"]["value"]


@pytest.mark.parametrize("engine_name, max_gap", [("gemma_float32", 1e-4), ("gemma_stored", 0.01)])
def test_perplexity_matches_transformers(engine_name, max_gap, request, text_ids, reference_text_perplexity):
    llm = request.getfixturevalue(engine_name)
    ours = engine_perplexity(llm, text_ids)
    gap = abs(ours - reference_text_perplexity) / reference_text_perplexity
    print(f"\nGemma 3 perplexity ({engine_name}): engine {ours:.4f}, transformers float32 "
          f"{reference_text_perplexity:.4f}, gap {gap:.3%}")
    assert gap <= max_gap
    assert 1.5 < reference_text_perplexity < 60


def test_long_request_frees_sliding_blocks_out_of_the_window(gemma_stored, long_prompt):
    """While a 1,400-token request decodes, the full group holds a block per 16 tokens and each of
    the 5 sliding groups only its 512-token window (plus the block being written)."""
    core = gemma_stored.core
    kv = core.kv
    (request,) = core.make_requests("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0))
    core.add_requests([request])
    peak_sliding = 0
    while core.has_unfinished:
        core.step()
        tables = kv.block_tables(request.request_id)
        if tables[0]:
            peak_sliding = max(peak_sliding, *(len([b for b in table if b >= 0]) for table in tables[1:]))
            assert len(tables[0]) * kv.block_size >= request.num_computed_tokens
    window_blocks = 512 // kv.block_size
    chunk_blocks = core.config.scheduler.max_num_batched_tokens // kv.block_size
    # The window plus one chunk being written, at most: never the whole 1,400-token context.
    assert window_blocks <= peak_sliding <= window_blocks + chunk_blocks + 1 < len(long_prompt) // kv.block_size
    kv.check_invariants(expect_idle=True)


def test_agent_turns_hit_the_cache_past_the_sliding_window(gemma_stored):
    """Every turn of the agent session is past the 512-token window; each recomputes exactly the
    tokens after what the engine already computed (tests/model/test_agent_cache.py for the
    full-attention model)."""
    from agent_replay import cache_table, replay_agent_session
    from test_agent_cache import NUM_TURNS
    from tokios.tokenizer.chat_template import resolve_chat_template

    tokenizer = gemma_stored.tokenizer.with_chat_template(resolve_chat_template("gemma"))
    # 24-token answers: the window moves a block or two past where the next turn's prompt parts from
    # the last one, so that turn needs sliding blocks freed while the answer was generated.
    rows = replay_agent_session(gemma_stored, NUM_TURNS, num_answer_tokens=24, tokenizer=tokenizer)
    print("\n" + cache_table(rows))
    assert rows[0].num_prompt_tokens > 512
    for row in rows:
        assert row.num_recomputed_tokens <= row.max_recomputed_tokens, row
        assert row.num_recomputed_tokens <= row.num_new_tokens, row
    # The first turn may find a token or two of earlier tests' prompts; each later one, exactly
    # what the session computed before.
    for row in rows[1:]:
        assert row.num_recomputed_tokens == row.num_new_tokens, row
    assert sum(row.num_cached_tokens for row in rows) > 0.8 * sum(row.num_prompt_tokens for row in rows[1:])


# ---- scheduling invariance and speculative decoding on Gemma 3 ------------------------------
def greedy(max_tokens: int = 16, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def invariance_prompts(gemma_float32, long_prompt):
    # Six of the prompts (the suite's time budget), one of them past the window so that chunks and
    # cache hits straddle it.
    short = [gemma_float32.tokenizer.encode(prompt) for prompt in PROMPTS[:5]]
    return short + [long_prompt[:700]]


@pytest.fixture(scope="module")
def one_by_one(gemma_float32, invariance_prompts):
    return [gemma_float32.generate([ids], greedy())[0].outputs[0].token_ids for ids in invariance_prompts]


def test_batched_chunked_and_prefix_cached_equal_one_by_one(gemma_path, invariance_prompts, one_by_one):
    from tokios.engine import LLM

    llm = LLM(model=str(gemma_path), dtype="float32", max_num_batched_tokens=96, kv_cache_memory="256MiB")
    for _ in range(2):  # cold, then the same batch over a hot prefix cache
        outputs = llm.generate(invariance_prompts, greedy())
        assert [o.outputs[0].token_ids for o in outputs] == one_by_one
        llm.check_invariants()
    assert llm.stats().prefix_cache_hits >= sum(len(p) for p in invariance_prompts) // 2
    assert llm.stats().num_blocks_used == 0


def test_forced_preemption_equals_one_by_one(gemma_path, gemma_float32, invariance_prompts, one_by_one):
    from tokios.engine import LLM

    layout_block = gemma_float32.kv_bytes_per_token() // 18 * 3 * 16  # a block of one KV group
    llm = LLM(model=str(gemma_path), dtype="float32", kv_cache_memory=36 * layout_block)
    short = invariance_prompts[:-1]
    outputs = llm.generate(short, greedy())
    assert [o.outputs[0].token_ids for o in outputs] == one_by_one[:-1]
    assert llm.stats().num_preemptions > 0
    llm.check_invariants()


def test_stored_blocks_part_from_one_by_one_only_at_near_ties(gemma_stored, invariance_prompts):
    from test_engine_invariance import assert_parts_only_at_near_ties

    params = greedy(logprobs=2)
    alone = [gemma_stored.generate([ids], params)[0].outputs[0] for ids in invariance_prompts]
    together = [o.outputs[0] for o in gemma_stored.generate(invariance_prompts, params)]
    gemma_stored.check_invariants()
    num_identical = assert_parts_only_at_near_ties(together, alone, "gemma3 stored")
    print(f"\nGemma 3 as stored: {num_identical} of {len(invariance_prompts)} prompts identical batched")


@pytest.fixture(scope="module")
def speculative_engine(gemma_path, invariance_prompts):
    """The file as stored with speculation configured, and its plain greedy tokens for three
    prompts (one past the window), one request at a time."""
    from tokios.engine import LLM
    from tokios.config import SpeculativeConfig

    # No prefix cache: a repeated prompt would then compute its tail as decode rows instead of one
    # span, which rounds differently in the file's blocks (speculation is not what differs).
    llm = LLM(model=str(gemma_path), kv_cache_memory="256MiB", max_num_batched_tokens=2048,
              enable_prefix_caching=False, speculative_config=SpeculativeConfig(num_speculative_tokens=3, enable_adaptive=False,
                                                   self_draft_num_layers=6))
    prompts = invariance_prompts[:2] + invariance_prompts[-1:]
    plain = [llm.generate([ids], greedy(24))[0].outputs[0].token_ids for ids in prompts]
    yield llm, prompts, plain
    llm.close()


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_speculative_decoding_is_lossless(speculative_engine, method):
    llm, prompts, plain = speculative_engine
    drafts_before = llm.stats().spec_num_drafts
    params = greedy(24, speculative={"method": method, "num_tokens": 3})
    assert [llm.generate([ids], params)[0].outputs[0].token_ids for ids in prompts] == plain
    assert llm.stats().spec_num_drafts > drafts_before
    llm.check_invariants()


def test_a_prompt_prefilled_in_layer_slices_gives_the_tokens_of_whole_chunks(gemma_stored, invariance_prompts):
    """The file's own blocks: the 700-token prompt, after its first chunk, goes through the 18
    layers one a step beside three decoding streams, its chunks crossing the 512-token window;
    every request's tokens must equal the run where its chunks stay whole."""
    from test_engine_invariance import generate_beside_a_sliced_prompt

    streams, long_prompt = invariance_prompts[:3], invariance_prompts[-1]
    sliced_tokens, slices = generate_beside_a_sliced_prompt(gemma_stored, streams, long_prompt, stream_tokens=200)
    whole_tokens, _ = generate_beside_a_sliced_prompt(gemma_stored, streams, long_prompt, stream_tokens=200,
                                                      layer_slices=False)
    assert sum(s.stop - s.start == 1 for s in slices) >= 10 * gemma_stored.model_config.num_layers
    assert sliced_tokens == whole_tokens
