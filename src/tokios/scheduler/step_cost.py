"""What a step costs, measured as the engine runs: the time of a decode step, and what each prefill
token adds to a step at the context the prompts are at now.

Pure Python. The scheduler uses it to size prefill chunks so a step that also carries decodes
stays within a latency budget (fair chunked prefill): one long prompt then slows the other
streams by a bounded factor instead of freezing them for whole seconds.

Two running estimates, both exponentially weighted so they follow the machine (another process
taking a core, a GPU, a different thread count) and the prompt (a token late in a long prompt
attends to more keys than an early one, and the runner switches a chunk's attention kernel as
its query x context product grows, runner/model_runner.py):

- decode_s: a step of only decodes (a weights read, bandwidth-bound, about the same for a few
  more or fewer rows);
- seconds_per_prefill_token: (step time - decode_s) / prompt tokens in the step, over recent
  steps that carried both. A long prompt's context grows by one chunk a step, so the last few
  steps predict the next one well; the weight on each new step (0.3) lets a kernel switch be
  followed within a few steps.

Not a global least-squares fit of step time on rows and attention pairs: while the streams
decode, every step has nearly the same rows, so the fixed and per-row costs cannot be told apart
and such a fit drifts to predictions off by 2-3x (measured on SmolLM2 with 4 streams
and a 2,000-token prompt).
"""

from __future__ import annotations

import math

_DECODE_WEIGHT = 0.2
_PREFILL_WEIGHT = 0.3
# A prefill token never costs less than this in the estimate (noise can make a step with a
# chunk measure faster than the decode estimate).
_MIN_SECONDS_PER_TOKEN = 1e-6


class StepCostModel:
    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.seconds_per_prefill_token: float | None = None

    @property
    def is_calibrated(self) -> bool:
        return self.decode_s is not None and self.seconds_per_prefill_token is not None

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step's measured time, with its rows split into decodes (one token of a request
        past its prompt, or a verify of proposed tokens) and prompt tokens."""
        if not math.isfinite(seconds) or seconds < 0 or num_decode_rows + num_prefill_tokens == 0:
            return
        if num_prefill_tokens == 0:
            self.decode_s = _blend(self.decode_s, seconds, _DECODE_WEIGHT)
            return
        if num_decode_rows == 0:
            # A prompt alone: the whole step is its cost (the fixed part spread over a large chunk).
            per_token = seconds / num_prefill_tokens
        elif self.decode_s is None:
            return
        else:
            per_token = (seconds - self.decode_s) / num_prefill_tokens
        self.seconds_per_prefill_token = _blend(self.seconds_per_prefill_token,
                                                max(_MIN_SECONDS_PER_TOKEN, per_token), _PREFILL_WEIGHT)

    def max_prefill_tokens(self, seconds: float) -> int:
        """Prompt tokens that add at most `seconds` to a step (0 when uncalibrated)."""
        if not self.is_calibrated or seconds <= 0:
            return 0
        return int(seconds / self.seconds_per_prefill_token)


def _blend(previous: float | None, value: float, weight: float) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
