"""The thinking budget: once a request has thought for its budget of tokens, the sampler writes
the end of the thinking for it, so that an answer always follows.

`ThinkingBudget` is what a request asks for, in token ids (the engine sees no text): the ids that
open the thinking in the output (when the prompt has not opened it already), the ids that close
it, the ids forced when the budget is spent (the close, and for gpt-oss the switch to the final
channel), and the budget. `BudgetMatcher` enforces it: it stands where a grammar matcher stands
(Request.grammar: the scheduler feeds it every appended token, the runner asks it for token masks,
the speculator for the proposals it accepts), wrapping the request's grammar when it has one, so
a budget works under a tool-call grammar and with speculation. While the model thinks within its
budget the mask is the grammar's (or every token) less the stop ids; after the thinking it is
the grammar's; once the budget is spent, the mask admits only the next forced id. A response
format's grammar is the answer's: behind a thinking the prompt opened it starts at the answer's
first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokios.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

OUTSIDE, THINKING, FORCING, DONE = range(4)


@dataclass(frozen=True)
class ThinkingBudget:
    max_thinking_tokens: int | None  # None: no budget (the thinking still may not end the answer)
    start_ids: tuple[int, ...]  # what opens the thinking in the output
    end_ids: tuple[int, ...]  # what closes it when the model closes it itself
    forced_ids: tuple[int, ...]  # what the sampler writes when the budget is spent
    starts_inside: bool  # the prompt opened the thinking (the output starts in it)
    # The ids that end a request (EOS): not sampled while thinking, so that a model cannot stop
    # in its thinking and leave no answer (it thinks on until it closes the thinking, its budget
    # closes it, or max_tokens ends the request: a "length" finish).
    stop_ids: tuple[int, ...] = ()
    # The request's grammar is its answer's (a response format): it applies from the end of a
    # thinking the prompt opened, as the answer starts. (A tool-call grammar lets the thinking
    # through itself, reasoning/grammar.py, and applies from the first token.)
    grammar_after_thinking: bool = False

    def __post_init__(self) -> None:
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise InvalidRequestError(f"the thinking budget must be >= 0, got {self.max_thinking_tokens}",
                                      param="max_thinking_tokens")
        if not self.end_ids or not self.forced_ids or not self.start_ids:
            raise ValueError("a thinking budget needs the start, end and forced token ids")


@dataclass
class _State:
    phase: int
    num_thinking_tokens: int = 0
    num_forced: int = 0  # forced ids written so far
    recent: tuple[int, ...] = ()  # the last few ids, to see a start or end sequence complete


class BudgetMatcher:
    """A request's thinking budget over its grammar matcher (or over no grammar)."""

    def __init__(self, budget: ThinkingBudget, inner=None):
        self.budget = budget
        self.inner = inner  # a structured.matcher.GrammarMatcher, or None
        self.description = f"thinking budget ({inner.description})" if inner is not None else "thinking budget"
        self._window = max(len(budget.start_ids), len(budget.end_ids))
        self._state = _State(THINKING if budget.starts_inside else OUTSIDE)
        self._check_forcing(self._state)
        # The inner grammar sees only the tokens after the thinking (the answer's).
        self._is_gated = inner is not None and budget.grammar_after_thinking and budget.starts_inside

    # ---- the state machine on ids ---------------------------------------------------------------
    def _check_forcing(self, state: _State) -> None:
        limit = self.budget.max_thinking_tokens
        if state.phase == THINKING and limit is not None and state.num_thinking_tokens >= limit:
            state.phase = FORCING

    def _advance(self, state: _State, token_id: int) -> _State:
        budget = self.budget
        recent = (state.recent + (token_id,))[-self._window:]
        state = _State(state.phase, state.num_thinking_tokens, state.num_forced, recent)
        if state.phase == OUTSIDE:
            if recent[-len(budget.start_ids):] == budget.start_ids:
                state.phase, state.recent = THINKING, ()
        elif state.phase == THINKING:
            state.num_thinking_tokens += 1
            if recent[-len(budget.end_ids):] == budget.end_ids:
                state.phase = DONE
        elif state.phase == FORCING:
            state.num_forced += 1
            if state.num_forced == len(budget.forced_ids):
                state.phase = DONE
        self._check_forcing(state)
        return state

    def _forced_id(self, state: _State) -> int | None:
        return self.budget.forced_ids[state.num_forced] if state.phase == FORCING else None

    @property
    def is_thinking(self) -> bool:
        return self._state.phase in (THINKING, FORCING)

    @property
    def num_thinking_tokens(self) -> int:
        return self._state.num_thinking_tokens

    # ---- what a GrammarMatcher offers ------------------------------------------------------------
    def _inner_sees(self, state: _State) -> bool:
        """Whether the token that follows `state` is the inner grammar's."""
        return self.inner is not None and (not self._is_gated or state.phase == DONE)

    def accept(self, token_id: int) -> bool:
        inner_sees = self._inner_sees(self._state)
        self._state = self._advance(self._state, token_id)
        return self.inner.accept(token_id) if inner_sees else True

    @property
    def is_finished(self) -> bool:
        return self._inner_sees(self._state) and self.inner.is_finished

    @property
    def is_accepting(self) -> bool:
        return self.inner is None or (self._inner_sees(self._state) and self.inner.is_accepting)

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of proposals that both the budget and the grammar admit."""
        state, num_valid, num_before_inner = self._state, 0, 0
        for token_id in token_ids:
            if not self._inner_sees(state):
                num_before_inner += 1
            forced = self._forced_id(state)
            if forced is not None and token_id != forced:
                break
            if state.phase == THINKING and token_id in self.budget.stop_ids:
                break
            state = self._advance(state, token_id)
            num_valid += 1
        prefix = list(token_ids[:num_valid])
        if self.inner is None:
            return prefix
        num_before_inner = min(num_before_inner, num_valid)
        return prefix[:num_before_inner] + self.inner.valid_prefix(prefix[num_before_inner:])

    def fill_mask(self, bitmask: torch.Tensor, row: int, proposals: list[int] = ()) -> int:
        """Rows row .. row + len(proposals), as GrammarMatcher.fill_mask: the grammar's masks (every
        token without one), narrowed to the forced id on the rows where the budget is spent."""
        num_rows = len(proposals) + 1
        # Rows before the inner grammar's first token are every token's; from there, its own.
        num_before_inner, state = 0, self._state
        while num_before_inner < num_rows and not self._inner_sees(state):
            if num_before_inner < len(proposals):
                state = self._advance(state, proposals[num_before_inner])
            num_before_inner += 1
        bitmask[row:row + num_before_inner] = -1
        if num_before_inner < num_rows:
            self.inner.fill_mask(bitmask, row + num_before_inner, list(proposals[num_before_inner:]))
        state = self._state
        for j in range(num_rows):
            forced = self._forced_id(state)
            if state.phase == THINKING:
                target = bitmask[row + j]
                for stop_id in self.budget.stop_ids:
                    word = stop_id // 32
                    target[word] = int(target[word].item()) & ~_bit(stop_id % 32)
            elif forced is not None:
                target = bitmask[row + j]
                allowed = bool(target[forced // 32].item() >> (forced % 32) & 1)
                target.zero_()
                if allowed or self.inner is None:
                    target[forced // 32] = _bit(forced % 32)
            if j < len(proposals):
                state = self._advance(state, proposals[j])
        return num_rows


def _bit(position: int) -> int:
    """The int32 word with one bit set (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position
