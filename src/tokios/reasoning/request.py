"""What a request asks of the model's thinking, and how that reaches the template and the sampler.

Every dialect says it differently (OpenAI `reasoning_effort` and `chat_template_kwargs`,
Responses `reasoning.effort`, Anthropic `thinking: {type, budget_tokens}`, Ollama `think`); each
translates into one `ThinkingRequest`. `plan_thinking` resolves it against the model's reasoning
format and its template:

- thinking on (any effort, `think: true`, `thinking.type: enabled`) or unsaid: the template's
  `enable_thinking` is set true where the template reads it (some templates, such as llama.cpp's
  QwQ copy, close `<think>` at once unless it is set), and its `reasoning_effort` where it reads
  that (gpt-oss writes "Reasoning: low|medium|high" into its system turn);
- thinking off: `enable_thinking` false where the template reads it; where it does not, a budget
  of zero tokens, so the sampler closes the thinking at once;
- a budget: the stated tokens, or the effort's (EFFORT_TO_MAX_THINKING_TOKENS), none when unsaid.

A model without a reasoning format asked to think is a 400 naming the field: nothing would think.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokios.errors import InvalidRequestError
from tokios.reasoning.formats import ReasoningFormat

# The thinking budget each effort stands for, in tokens (docs/apis.md).
EFFORT_TO_MAX_THINKING_TOKENS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
EFFORTS = ("none", *EFFORT_TO_MAX_THINKING_TOKENS)
# gpt-oss's template knows three efforts.
_TEMPLATE_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "high"}


@dataclass(frozen=True)
class ThinkingRequest:
    is_enabled: bool | None = None  # None: the request does not say
    effort: str | None = None  # one of EFFORT_TO_MAX_THINKING_TOKENS
    max_thinking_tokens: int | None = None
    param: str = "reasoning_effort"  # the field an error names

    def __post_init__(self) -> None:
        if self.effort is not None and self.effort not in EFFORT_TO_MAX_THINKING_TOKENS:
            raise InvalidRequestError(f"{self.param} must be one of {list(EFFORTS)}, got {self.effort!r}",
                                      param=self.param)
        if self.max_thinking_tokens is not None and (
                not isinstance(self.max_thinking_tokens, int) or self.max_thinking_tokens < 0):
            raise InvalidRequestError(f"{self.param}: the thinking budget must be an integer >= 0, got "
                                      f"{self.max_thinking_tokens!r}", param=self.param)

    @classmethod
    def from_effort(cls, effort: Any, param: str = "reasoning_effort",
                    max_thinking_tokens: int | None = None) -> ThinkingRequest:
        """An effort as OpenAI names them ("none" turns thinking off); None says nothing."""
        if effort is None:
            return cls(None, None, max_thinking_tokens, param)
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise InvalidRequestError(f"{param} must be one of {list(EFFORTS)}, got {effort!r}", param=param)
        if effort == "none":
            if max_thinking_tokens:
                raise InvalidRequestError(f"{param} 'none' turns thinking off: a thinking budget cannot go with it",
                                          param=param)
            return cls(False, None, None, param)
        return cls(True, effort, max_thinking_tokens, param)

    def with_template_switch(self, template_kwargs: dict[str, Any]) -> ThinkingRequest:
        """`chat_template_kwargs: {"enable_thinking": ...}` as a request to think or not; a
        contradiction with the effort is a 400."""
        switch = template_kwargs.get("enable_thinking")
        if switch is None:
            return self
        if not isinstance(switch, bool):
            raise InvalidRequestError("chat_template_kwargs.enable_thinking must be true or false",
                                      param="chat_template_kwargs")
        if self.is_enabled is not None and self.is_enabled != switch:
            raise InvalidRequestError(f"chat_template_kwargs.enable_thinking={str(switch).lower()} contradicts "
                                      f"{self.param}", param="chat_template_kwargs")
        return ThinkingRequest(switch, self.effort if switch else None,
                               self.max_thinking_tokens if switch else None, self.param)


@dataclass
class ThinkingPlan:
    """A request's thinking, resolved: the template's variables and the budget (None: unlimited)."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_thinking_tokens: int | None = None
    is_enabled: bool = False


def plan_thinking(request: ThinkingRequest, reasoning_format: ReasoningFormat | None,
                  template_variables: frozenset[str]) -> ThinkingPlan:
    if reasoning_format is None:
        if request.is_enabled or request.max_thinking_tokens:
            raise InvalidRequestError(
                f"{request.param}: this model has no reasoning format (its chat template and vocabulary show no "
                "reasoning markers), so it cannot think; start tokios with --reasoning-format if it does",
                param=request.param)
        return ThinkingPlan()
    is_enabled = request.is_enabled is not False
    plan = ThinkingPlan(is_enabled=is_enabled)
    if "enable_thinking" in template_variables:
        plan.template_kwargs["enable_thinking"] = is_enabled
    elif not is_enabled:
        plan.max_thinking_tokens = 0  # the template cannot turn it off: close it at once
    if is_enabled:
        if request.effort is not None and "reasoning_effort" in template_variables:
            plan.template_kwargs["reasoning_effort"] = _TEMPLATE_EFFORT[request.effort]
        if request.max_thinking_tokens is not None:
            plan.max_thinking_tokens = request.max_thinking_tokens
        elif request.effort is not None:
            plan.max_thinking_tokens = EFFORT_TO_MAX_THINKING_TOKENS[request.effort]
    return plan
