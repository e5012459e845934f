"""Reasoning models: which format a model thinks in, the split of its output into reasoning and
answer, what a request asks of the thinking, and the thinking budget the sampler enforces."""

from tokios.reasoning.answer import AnswerParser, answer_parser
from tokios.reasoning.budget import BudgetMatcher, ThinkingBudget
from tokios.reasoning.formats import (FORMAT_CHOICES, HARMONY, THINK, ReasoningFormat, detect_reasoning_format,
                                      resolve_reasoning_format)
from tokios.reasoning.request import EFFORT_TO_MAX_THINKING_TOKENS, ThinkingPlan, ThinkingRequest, plan_thinking

__all__ = ["AnswerParser", "BudgetMatcher", "EFFORT_TO_MAX_THINKING_TOKENS", "FORMAT_CHOICES", "HARMONY",
           "ReasoningFormat", "THINK", "ThinkingBudget", "ThinkingPlan", "ThinkingRequest",
           "answer_parser", "detect_reasoning_format", "plan_thinking", "resolve_reasoning_format"]
