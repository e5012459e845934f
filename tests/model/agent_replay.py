"""Replays the scripted agent session (tokios/tools/bench/agent_session.py) on an engine: each
turn's conversation rendered with the engine's chat template and the session's tools, generated
greedily (its answer dropped, as the script replaces it), the interrupted turn aborted after a
few tokens. Reports per turn what the prefix cache saved, the tokens after the longest common
prefix with what the engine computed before, and the bound the benchmark holds it to."""

from __future__ import annotations

from dataclasses import dataclass

from tokios.sampling_params import SamplingParams
from tokios.server.generation import ChatTurn
from tokios.tool_calls import ToolSet
from tokios.tools.bench.agent_session import (INTERRUPTED, TOOLS, agent_session, common_prefix_length,
                                              recompute_bound)



@dataclass(frozen=True)
class TurnCache:
    index: int
    kind: str
    num_prompt_tokens: int
    num_cached_tokens: int  # the engine's own count (RequestOutput.metrics)
    max_recomputed_tokens: int  # agent_session.recompute_bound
    # The tokens after the longest common prefix with what the engine computed before (at least
    # one: the last prompt token is always computed, for its logits).
    num_new_tokens: int

    @property
    def num_recomputed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens


def replay_agent_session(llm, num_turns: int, num_answer_tokens: int, tokenizer=None) -> list[TurnCache]:
    """Each answer is num_answer_tokens long (the interrupted one is stopped halfway); the longer
    they are, the further a sliding window moves past what the next turn needs. tokenizer:
    renders and encodes the conversations (default: the engine's, with its template)."""
    tokenizer = tokenizer or llm.tokenizer
    tools = ToolSet.from_request(TOOLS, "auto", True)
    params = SamplingParams(max_tokens=num_answer_tokens, temperature=0.0, ignore_eos=True)
    block_size = llm.core.kv.block_size
    computed: list[list[int]] = []  # every request's tokens whose K/V the engine wrote
    rows = []
    for turn in agent_session(num_turns):
        prompt_ids = ChatTurn(turn.messages, {}, tools=tools).prompt_ids(tokenizer)
        bound = recompute_bound(prompt_ids, computed, block_size)
        longest = max((common_prefix_length(prompt_ids, ids) for ids in computed), default=0)
        if turn.kind == INTERRUPTED:
            num_cached, computed_ids = _interrupted(llm, f"agent-{turn.index}", prompt_ids, params)
        else:
            output = llm.generate([prompt_ids], params)[0]
            num_cached = output.metrics.num_cached_prompt_tokens
            computed_ids = prompt_ids + output.outputs[0].token_ids[:-1]  # the last one was never run
        computed.append(computed_ids)
        rows.append(TurnCache(turn.index, turn.kind, len(prompt_ids), num_cached, bound,
                              max(1, len(prompt_ids) - longest)))
    llm.check_invariants()
    return rows


def _interrupted(llm, request_id: str, prompt_ids: list[int], params: SamplingParams) -> tuple[int, list[int]]:
    """A request aborted once it has streamed a few tokens, as the server aborts one whose
    client went away: (its cached prompt tokens, the tokens it computed)."""
    core = llm.core
    (request,) = core.make_requests(request_id, prompt_ids, params)
    core.add_requests([request])
    while request.num_output_tokens < params.max_tokens // 2:
        core.step()
    core.abort([request_id])
    return request.num_cached_tokens, list(request.all_token_ids[:request.num_computed_tokens])


def cache_table(rows: list[TurnCache]) -> str:
    lines = ["turn kind          prompt cached recomputed bound"]
    lines += [f"{r.index:4} {r.kind:12} {r.num_prompt_tokens:7} {r.num_cached_tokens:6} "
              f"{r.num_recomputed_tokens:10} {r.max_recomputed_tokens:5}" for r in rows]
    return "\n".join(lines)
