"""SamplingParams: how one request wants its tokens drawn, validated once at the door.

Owns the per-request sampling knobs (OpenAI / vLLM semantics) and their validation. The server's
protocol layer builds one from a request body, the engine stores it on the request, and the model
runner turns the params of the requests in a batch into tensors (tokios.sampler). Every bad value
raises tokios.errors.InvalidRequestError whose `param` is the field name and whose message states
the allowed range; nothing downstream re-checks these values.

Token ids in `logit_bias` and `stop_token_ids` can only be range-checked once the vocabulary is
known: the engine calls `validate_for_vocab(vocab_size)` when the request arrives.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass

from tokios.config import check_num_speculative_tokens, check_speculative_method
from tokios.errors import InvalidRequestError
from tokios.reasoning.budget import ThinkingBudget
from tokios.structured.spec import StructuredOutput

MAX_N = 128
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_FREQUENCY_PRESENCE_PENALTY = 2.0
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
MAX_TOP_K = 2**31 - 1
# Below this temperature a request is sampled greedily: dividing logits by a near-zero
# temperature overflows float32 to inf (and inf - inf = nan in softmax), and the
# distribution is indistinguishable from argmax long before that (vLLM uses the same cut).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class SpeculativeParams:
    """A request's choice of speculative decoding: method (None turns speculation off for it;
    "default" or a missing key takes the engine's SpeculativeConfig) and k (None: the engine's)."""

    method: str | None = "default"
    num_tokens: int | None = None

    @classmethod
    def from_value(cls, value: object) -> SpeculativeParams | None:
        """Accepts None, a SpeculativeParams, or the API body's {"method": ..., "num_tokens": ...}."""
        if value is None or isinstance(value, SpeculativeParams):
            return value
        if not isinstance(value, dict) or set(value) - {"method", "num_tokens"}:
            raise InvalidRequestError(
                f"speculative must be an object with keys method and num_tokens, got {value!r}", param="speculative")
        method = "default" if value.get("method", "default") == "default" else check_speculative_method(
            value["method"], "speculative.method")
        num_tokens = value.get("num_tokens")
        if num_tokens is not None:
            num_tokens = check_num_speculative_tokens(num_tokens, "speculative.num_tokens")
        return cls(method, num_tokens)


def _is_integer(value: object) -> bool:
    # bool is an int subclass; `"n": true` in JSON is a client bug, not the number 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value: object, allowed: str, low: int, high: int | None = None) -> int:
    if not _is_integer(value) or value < low or (high is not None and value > high):
        raise InvalidRequestError(f"{name} must be an integer {allowed}, got {value!r}", param=name)
    return int(value)


def _check_float(
    name: str,
    value: object,
    allowed: str,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = True,
) -> float:
    if not _is_real(value) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number {allowed}, got {value!r}", param=name)
    value = float(value)
    below = value < low if low_inclusive else value <= low
    if below or value > high:
        raise InvalidRequestError(f"{name} must be a finite number {allowed}, got {value!r}", param=name)
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean (true or false), got {value!r}", param=name)
    return value


def _check_token_id(name: str, value: object) -> int:
    # JSON object keys are strings, so logit_bias arrives as {"50256": -100}.
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if not _is_integer(value) or value < 0:
        raise InvalidRequestError(f"{name} token ids must be integers >= 0, got {value!r}", param=name)
    return int(value)


@dataclass
class SamplingParams:
    """Sampling settings of one request. See docs/sampling.md for the order they apply in."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Speculative decoding for this request: {"method": ..., "num_tokens": ...} (docs/speculative.md).
    speculative: SpeculativeParams | dict | None = None
    # Constrained decoding (docs/structured.md): the output must match this schema / regex /
    # choice / grammar; tokios.structured.StructuredOutput, built by the server from
    # response_format, structured_outputs or the tools.
    structured_output: StructuredOutput | None = None
    # A reasoning model's thinking budget (tokios.reasoning.ThinkingBudget, built by the server):
    # once spent, the sampler writes the end of the thinking so that an answer follows.
    thinking_budget: ThinkingBudget | None = None
    # "mean" or "last": also return the prompt's final hidden states pooled over its positions
    # (the embedding routes; docs/apis.md). The request computes its whole prompt (no prefix hit).
    pooling: str | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, f"in [1, {MAX_N}]", 1, MAX_N)
        self.temperature = _check_float("temperature", self.temperature, ">= 0 (0 means greedy)", 0.0)
        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]", 0.0, 1.0, low_inclusive=False)
        if not _is_integer(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}", param="top_k"
            )
        # -1 (vLLM) and 0 (OpenAI-style clients) both mean "disabled"; one spelling downstream.
        # A top_k past any vocabulary keeps every token, as one of the vocabulary's size does; capped so
        # that it packs into the sampler's int64 row tensor (a larger one crashed the engine step).
        self.top_k = min(max(int(self.top_k), 0), MAX_TOP_K)
        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]", 0.0, 1.0)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, "> 0 (1 means no penalty)", 0.0, low_inclusive=False
        )
        limit = MAX_ABS_FREQUENCY_PRESENCE_PENALTY
        for name in ("frequency_penalty", "presence_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name), f"in [-{limit:g}, {limit:g}]", -limit, limit))
        self.logit_bias = self._checked_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, f"in [{MIN_SEED}, {MAX_SEED}]", MIN_SEED, MAX_SEED)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, ">= 1", 1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, ">= 0", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", param="min_tokens"
            )
        self.stop = self._checked_stop(self.stop)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
                raise InvalidRequestError(
                    f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}",
                    param="stop_token_ids",
                )
            self.stop_token_ids = [_check_token_id("stop_token_ids", token_id) for token_id in self.stop_token_ids]
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            setattr(self, name, _check_bool(name, getattr(self, name)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _check_int(name, value, f"in [0, {MAX_LOGPROBS}]", 0, MAX_LOGPROBS))
        if self.pooling not in (None, "mean", "last"):
            raise InvalidRequestError(f"pooling must be 'mean' or 'last', got {self.pooling!r}", param="pooling")
        self.speculative = SpeculativeParams.from_value(self.speculative)
        if self.thinking_budget is not None and not isinstance(self.thinking_budget, ThinkingBudget):
            raise InvalidRequestError("thinking_budget must be a tokios.reasoning.ThinkingBudget, got "
                                      f"{type(self.thinking_budget).__name__}", param="max_thinking_tokens")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a tokios.structured.StructuredOutput, got "
                                      f"{type(self.structured_output).__name__}", param="structured_outputs")

    @staticmethod
    def _checked_logit_bias(logit_bias: object) -> dict[int, float] | None:
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, dict):
            raise InvalidRequestError(
                f"logit_bias must be a map of token id to a bias in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}], got {logit_bias!r}",
                param="logit_bias",
            )
        token_id_to_bias: dict[int, float] = {}
        for key, bias in logit_bias.items():
            token_id = _check_token_id("logit_bias", key)
            token_id_to_bias[token_id] = _check_float(
                "logit_bias",
                bias,
                f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] for each token id",
                -MAX_ABS_LOGIT_BIAS,
                MAX_ABS_LOGIT_BIAS,
            )
        return token_id_to_bias

    @staticmethod
    def _checked_stop(stop: object) -> list[str] | None:
        if stop is None:
            return None
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(
                f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}", param="stop"
            )
        return list(stop)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Range-check the token ids this request names, once the model's vocabulary is known."""
        allowed = f"in [0, {vocab_size - 1}]"
        for token_id in self.logit_bias or ():
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token ids must be {allowed}, got {token_id}", param="logit_bias"
                )
        for token_id in self.stop_token_ids or ():
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids must be {allowed}, got {token_id}", param="stop_token_ids"
                )

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax (after penalties and bias); no randomness."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_frequency_presence_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def has_penalties(self) -> bool:
        return self.has_repetition_penalty or self.has_frequency_presence_penalty

    def clone(self) -> SamplingParams:
        """A deep copy: the engine may adjust a copy (e.g. resolve max_tokens) without aliasing."""
        return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params of the `index`-th of `n` sequences: n=1, and seed + index when seeded, so that the
        n samples differ from each other yet stay reproducible (vLLM does the same)."""
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = (self.seed + index - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED
        return child
