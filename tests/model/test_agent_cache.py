"""An agent's conversation re-sent every turn hits the prefix cache (SmolLM2; Gemma 3's sliding
window in test_gemma3.py): the scripted agent session (system prompt with tool schemas, tool
calls and results, a regenerated turn, an interrupted turn and the turn after it) replayed on the
engine. Per turn the prompt tokens the engine computed (prompt minus its own cached count) are
exactly the tokens after the longest common prefix with what it already computed (so within the
benchmark's bound: those rounded up to a block, plus a block). The regenerated turn recomputes
only its last token."""

from __future__ import annotations

from agent_replay import cache_table, replay_agent_session
from tokios.sampling_params import SamplingParams
from tokios.tools.bench.agent_session import REGENERATED

# Through the turn after the interrupted one (turn 6): every kind of turn, at a third of the
# session's cost.
NUM_TURNS = 7


def test_every_turn_recomputes_at_most_the_new_tokens_and_a_block(engine_float32):
    rows = replay_agent_session(engine_float32, NUM_TURNS, num_answer_tokens=4)
    print("\n" + cache_table(rows))
    for row in rows:
        assert row.num_recomputed_tokens <= row.max_recomputed_tokens, row
        assert row.num_recomputed_tokens <= row.num_new_tokens, row
    # After the first turn (which may find the start of earlier tests' prompts), exactly the
    # tokens after the first one that differs from what the session computed: full blocks, and
    # the part of a block before the difference (a finished turn's unfilled last block included).
    for row in rows[1:]:
        assert row.num_recomputed_tokens == row.num_new_tokens, row
    # A regenerated turn was computed whole: only its last token is computed again.
    (regenerated,) = [row for row in rows if row.kind == REGENERATED]
    assert regenerated.num_recomputed_tokens == 1


def test_n_samples_report_their_shared_prompt_hit_once(engine_float32):
    prompt_ids = engine_float32.tokenizer.encode("Name the planets of the solar system in order from the sun. " * 4)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine_float32.generate([prompt_ids], params)
    (output,) = engine_float32.generate([prompt_ids], SamplingParams(n=2, max_tokens=2, temperature=0.8, seed=1))
    # The first request's prompt and first token were computed: all but the last prompt token hit.
    assert output.metrics.num_cached_prompt_tokens == len(prompt_ids) - 1
