"""Speculative decoding settings: the engine's (SpeculativeConfig, from --speculative-method and
friends) and a request's own (SpeculativeParams, the `speculative: {method, num_tokens}` body
field). Both validate themselves and raise InvalidRequestError naming the field.

Talks to: tokios.config (EngineConfig holds a SpeculativeConfig), sampling_params (holds a
SpeculativeParams), speculative/speculator.py (reads both).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokios.errors import InvalidRequestError

SPECULATIVE_METHODS = ("ngram", "self_draft", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 16


def _check_method(method: object, param: str) -> str | None:
    if method in (None, "none", "off"):
        return None
    if method not in SPECULATIVE_METHODS:
        raise InvalidRequestError(f"{param} must be one of {('none',) + SPECULATIVE_METHODS}, got {method!r}",
                                  param=param)
    return method


def _check_num_tokens(value: object, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise InvalidRequestError(f"{param} must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {value!r}",
                                  param=param)
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # the default for requests that do not choose; None: off
    num_speculative_tokens: int = 4  # k: proposed tokens per verification, the most a request may ask
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    self_draft_num_layers: int = 6  # early exit after this many of the target's layers
    draft_model: str | None = None  # path of a separate draft model (method draft_model)
    draft_dtype: str = "auto"
    enable_adaptive: bool = True  # adapt k to the acceptance rate; switch off below break-even
    # Cost of one extra verify row, as a fraction of a plain decode step (the c of the break-even
    # formula adds the draft's measured cost to it). benchmarks/speculative_speed.py measures it
    # for the fused kernels alone: 0.18-0.25 (default model, int4, 2 cores). The default is a
    # little below that because whole engine steps also pay a fixed per-step cost that
    # speculation amortizes, so a whole step's c is lower than its kernels' (0.26 against
    # 0.31-0.41 where both were measured).
    verify_token_cost: float = 0.15

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", _check_method(self.method, "speculative_method"))
        _check_num_tokens(self.num_speculative_tokens, "num_speculative_tokens")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise InvalidRequestError(f"ngram sizes must satisfy 1 <= ngram_min_n <= ngram_max_n, got "
                                      f"{self.ngram_min_n} and {self.ngram_max_n}", param="ngram_max_n")
        if self.self_draft_num_layers < 1:
            raise InvalidRequestError(f"self_draft_num_layers must be >= 1, got {self.self_draft_num_layers}",
                                      param="self_draft_num_layers")
        if self.method == "draft_model" and not self.draft_model:
            raise InvalidRequestError("speculative_method draft_model needs --draft-model PATH", param="draft_model")
        if not 0.0 <= self.verify_token_cost < 1.0:
            raise InvalidRequestError(f"verify_token_cost must be in [0, 1), got {self.verify_token_cost}",
                                      param="verify_token_cost")


@dataclass(frozen=True)
class SpeculativeParams:
    """A request's choice: method (None turns speculation off for it; "default" or a missing key
    takes the engine's) and k (None: the engine's)."""

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
        method = "default" if value.get("method", "default") == "default" else _check_method(
            value["method"], "speculative.method")
        num_tokens = value.get("num_tokens")
        if num_tokens is not None:
            num_tokens = _check_num_tokens(num_tokens, "speculative.num_tokens")
        return cls(method, num_tokens)
