"""The simulated workload: when requests arrive, how long their prompts and outputs are, and
which of them start with one of K shared system prompts.

Owns `LengthDistribution` (fixed, uniform, lognormal; the fixed and uniform forms are
tools/bench/prompts.py's `LengthSpec`, the syntax `tokios bench serve` takes), `WorkloadSpec`
(validated; bad input raises InvalidRequestError naming the field) and `Workload`, the requests
as parallel lists that every routing policy is run on, made by `make_workload`.

Arrivals (why these two): Poisson is the textbook open-loop load (exponential gaps). Bursty
arrivals draw gamma-distributed gaps with the same mean and shape `burstiness`, as
`vllm bench serve --burstiness` does: 1 is Poisson, below 1 the gaps' squared coefficient of
variation is 1 / burstiness (0.25: requests come in clumps, then pause).

Each aspect (gaps, lengths, prefix choice) draws from its own seeded generator, so changing,
say, the shared-prefix share leaves the arrival times as they were.
"""

from __future__ import annotations

import dataclasses
import math
import random

from tokios.errors import InvalidRequestError
from tokios.tools.bench.prompts import LengthSpec

ARRIVAL_KINDS = ("poisson", "bursty")
NO_PREFIX = -1  # prefix id of a request that shares no system prompt


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: `N` (fixed), `LOW:HIGH` (uniform, inclusive) or
    `lognormal:MEDIAN:SIGMA[:MAX]` (median exp(mu), shape sigma, clipped to 1..MAX)."""

    kind: str  # "fixed", "uniform" or "lognormal"
    low: int = 1
    high: int = 1
    median: float = 1.0
    sigma: float = 0.0
    max_len: int | None = None

    @classmethod
    def parse(cls, text: str, *, field_name: str) -> "LengthDistribution":
        parts = str(text).strip().split(":")
        if parts[0].lower() != "lognormal":
            spec = LengthSpec.parse(text, field_name=field_name)
            return cls("fixed" if spec.low == spec.high else "uniform", low=spec.low, high=spec.high)
        try:
            median, sigma = float(parts[1]), float(parts[2])
            max_len = int(parts[3]) if len(parts) == 4 else None
            is_valid = len(parts) in (3, 4) and median >= 1 and sigma >= 0 and (max_len is None or max_len >= 1)
        except (IndexError, ValueError):
            is_valid = False
        if not is_valid:
            raise InvalidRequestError(
                f"{field_name} must be N, LOW:HIGH or lognormal:MEDIAN:SIGMA[:MAX] with MEDIAN >= 1, "
                f"SIGMA >= 0 and MAX >= 1, got {text!r}", param=field_name)
        return cls("lognormal", median=median, sigma=sigma, max_len=max_len)

    @property
    def min_len(self) -> int:
        return 1 if self.kind == "lognormal" else self.low

    @property
    def upper_len(self) -> int | None:
        """The longest length it can draw (None: unbounded)."""
        return self.max_len if self.kind == "lognormal" else self.high

    @property
    def mean(self) -> float:
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma ** 2 / 2)  # before clipping
        return (self.low + self.high) / 2

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        value = max(1, round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return value if self.max_len is None else min(value, self.max_len)

    def __str__(self) -> str:
        if self.kind == "lognormal":
            tail = f":{self.max_len}" if self.max_len is not None else ""
            return f"lognormal:{self.median:g}:{self.sigma:g}{tail}"
        return str(LengthSpec(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    rate: float  # requests per second
    num_requests: int
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape of the gaps (bursty only); 1 is Poisson
    shared_prefix_share: float = 0.0  # share of requests that start with a shared system prompt
    num_shared_prefixes: int = 1
    shared_prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0):
            raise InvalidRequestError(f"rate: {self.rate!r} must be a finite number of requests/s > 0",
                                      param="rate")
        _check_int("num_requests", self.num_requests, 1, 10**8)
        if self.arrival not in ARRIVAL_KINDS:
            raise InvalidRequestError(f"arrival: {self.arrival!r} must be one of {', '.join(ARRIVAL_KINDS)}",
                                      param="arrival")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise InvalidRequestError(f"burstiness: {self.burstiness!r} must be > 0 (1 is Poisson, "
                                      "smaller is burstier)", param="burstiness")
        if not 0 <= self.shared_prefix_share <= 1:
            raise InvalidRequestError(f"shared_prefix_share: {self.shared_prefix_share!r} must be within [0, 1]",
                                      param="shared_prefix_share")
        _check_int("num_shared_prefixes", self.num_shared_prefixes, 1, 10**6)
        _check_int("shared_prefix_len", self.shared_prefix_len, 0, 10**7)
        if self.shared_prefix_share > 0:
            if self.shared_prefix_len < 1:
                raise InvalidRequestError("shared_prefix_len: must be >= 1 when shared_prefix_share > 0",
                                          param="shared_prefix_len")
            if self.prompt_len.kind != "lognormal" and self.prompt_len.min_len <= self.shared_prefix_len:
                raise InvalidRequestError(
                    f"shared_prefix_len: {self.shared_prefix_len} must be shorter than every prompt "
                    f"(prompt_len {self.prompt_len}): the system prompt is the start of the prompt",
                    param="shared_prefix_len")

    @property
    def uses_shared_prefixes(self) -> bool:
        return self.shared_prefix_share > 0


def _check_int(field: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError(f"{field}: {value!r} must be an integer within [{low}, {high}]", param=field)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests, in arrival order, as parallel lists (index = request id)."""

    spec: WorkloadSpec
    arrival_s: list[float]
    prompt_lens: list[int]
    output_lens: list[int]
    prefix_ids: list[int]  # NO_PREFIX, or which shared system prompt the prompt starts with

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.arrival_s[-1] if self.arrival_s else 0.0


def make_workload(spec: WorkloadSpec) -> Workload:
    """Draw the requests. A sharing request's prompt starts with its system prompt; a drawn
    length (lognormal only; the fixed and uniform forms are validated) that leaves no token
    after it is raised to shared_prefix_len + 1."""
    gap_rng = random.Random(f"{spec.seed}:arrivals")
    length_rng = random.Random(f"{spec.seed}:lengths")
    prefix_rng = random.Random(f"{spec.seed}:prefixes")
    arrival_s, prompt_lens, output_lens, prefix_ids = [], [], [], []
    now = 0.0
    shape = spec.burstiness if spec.arrival == "bursty" else 1.0
    scale = 1.0 / (spec.rate * shape)
    for _ in range(spec.num_requests):
        now += gap_rng.gammavariate(shape, scale) if shape != 1.0 else gap_rng.expovariate(spec.rate)
        prompt_len = spec.prompt_len.draw(length_rng)
        output_len = spec.output_len.draw(length_rng)
        prefix_id = NO_PREFIX
        if spec.uses_shared_prefixes and prefix_rng.random() < spec.shared_prefix_share:
            prefix_id = prefix_rng.randrange(spec.num_shared_prefixes)
            prompt_len = max(prompt_len, spec.shared_prefix_len + 1)
        arrival_s.append(now)
        prompt_lens.append(prompt_len)
        output_lens.append(output_len)
        prefix_ids.append(prefix_id)
    return Workload(spec, arrival_s, prompt_lens, output_lens, prefix_ids)
