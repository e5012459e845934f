"""The roofline model: roofs, measured points, their regime and the one-line verdict.

Owns `Roofs` (a machine's peak bandwidth and peak FLOP/s for one dtype), `RooflinePoint` (one
measured prefill or decode step: FLOPs, bytes, seconds), `classify` and `decode_regime` (which
roof limits a given amount of work), and `verdict`. Pure arithmetic (no torch) over
tools/plan/formulas.py; tools/roofline/measure.py makes the points, tools/roofline/chart.py draws
them, tools/roofline/cli.py prints them.

A point is bandwidth-bound when its arithmetic intensity (FLOPs per byte moved) is below the
ridge, peak FLOP/s / peak bytes/s: there, even a perfect kernel waits on memory.
"""

from __future__ import annotations

import dataclasses

from tokios.errors import InvalidRequestError
from tokios.model.shape import ModelShape
from tokios.tools.plan import formulas

BANDWIDTH_BOUND = "bandwidth-bound"
COMPUTE_BOUND = "compute-bound"


@dataclasses.dataclass(frozen=True)
class Roofs:
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s for `dtype`
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for field in ("memory_bandwidth", "peak_flops"):
            value = getattr(self, field)
            if not value > 0:
                raise InvalidRequestError(f"{field}: {value!r} must be > 0", param=field)

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte at which the two roofs meet."""
        return self.peak_flops / self.memory_bandwidth

    def attainable_flops(self, intensity: float) -> float:
        return min(self.peak_flops, intensity * self.memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class Regime:
    regime: str  # BANDWIDTH_BOUND or COMPUTE_BOUND
    arithmetic_intensity: float  # FLOPs per byte
    ridge_intensity: float
    bound_seconds: float  # the roofline's lower bound on the time of this work


def classify(flops: float, bytes_moved: float, roofs: Roofs) -> Regime:
    if flops < 0 or bytes_moved <= 0:
        raise InvalidRequestError(
            f"flops {flops!r} must be >= 0 and bytes_moved {bytes_moved!r} > 0", param="bytes_moved")
    intensity = flops / bytes_moved
    regime = BANDWIDTH_BOUND if intensity < roofs.ridge_intensity else COMPUTE_BOUND
    bound = max(flops / roofs.peak_flops, bytes_moved / roofs.memory_bandwidth)
    return Regime(regime, intensity, roofs.ridge_intensity, bound)


def decode_regime(model: ModelShape, roofs: Roofs, *, batch_size: int, context_len: float,
                  step_weight_bytes: float, kv_bytes_per_token: float, expert_weight_bytes: float = 0.0) -> Regime:
    """Which roof limits one decode step of `batch_size` requests at `context_len` tokens.
    `step_weight_bytes` is what a one-token step reads; a mixture of experts' batch reads more
    of its `expert_weight_bytes` (formulas.weight_bytes_read)."""
    if batch_size < 1:
        raise InvalidRequestError(f"batch_size: {batch_size!r} must be >= 1", param="batch_size")
    flops = formulas.decode_step_flops(model, batch_size, context_len)
    weights = formulas.weight_bytes_read(model, step_weight_bytes, expert_weight_bytes, batch_size)
    bytes_moved = formulas.decode_step_bytes(weights, kv_bytes_per_token, batch_size, context_len)
    return classify(flops, bytes_moved, roofs)


@dataclasses.dataclass(frozen=True)
class RooflinePoint:
    """One measured step. `phase` is "prefill" or "decode"; for decode `num_tokens` is the batch
    size (tokens per step), for prefill the prompt length."""

    phase: str
    batch_size: int
    num_tokens: int
    context_len: float
    flops: float
    bytes_moved: float
    seconds: float
    # Weight bytes per step: what the engine's kernels counted reading (None: not counted, then
    # bytes_moved holds the estimate), and the estimate from the model's shape (a mixture of
    # experts: the dense part plus the experts its tokens chose).
    weight_bytes_counted: float | None = None
    weight_bytes_estimated: float | None = None

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def achieved_flops(self) -> float:
        return self.flops / self.seconds

    @property
    def achieved_bandwidth(self) -> float:
        return self.bytes_moved / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def label(self) -> str:
        if self.phase == "decode":
            return f"decode at batch {self.batch_size}"
        return f"prefill of {self.num_tokens} tokens"

    def summary(self, roofs: Roofs) -> dict:
        regime = classify(self.flops, self.bytes_moved, roofs)
        return {
            "phase": self.phase, "batch_size": self.batch_size, "num_tokens": self.num_tokens,
            "context_len": self.context_len, "flops": self.flops, "bytes_moved": self.bytes_moved,
            "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
            "arithmetic_intensity": self.arithmetic_intensity,
            "achieved_flops": self.achieved_flops, "achieved_bandwidth": self.achieved_bandwidth,
            "percent_of_peak_flops": 100 * self.achieved_flops / roofs.peak_flops,
            "percent_of_peak_bandwidth": 100 * self.achieved_bandwidth / roofs.memory_bandwidth,
            "percent_of_roofline": 100 * self.achieved_flops / roofs.attainable_flops(
                self.arithmetic_intensity),
            "regime": regime.regime, "verdict": verdict(self, roofs),
            "weight_bytes_counted": self.weight_bytes_counted, "weight_bytes_estimated": self.weight_bytes_estimated,
        }


def verdict(point: RooflinePoint, roofs: Roofs) -> str:
    """e.g. 'decode at batch 1: bandwidth-bound, 61% of peak bandwidth'."""
    regime = classify(point.flops, point.bytes_moved, roofs)
    if regime.regime == BANDWIDTH_BOUND:
        share = f"{100 * point.achieved_bandwidth / roofs.memory_bandwidth:.0f}% of peak bandwidth"
    else:
        share = f"{100 * point.achieved_flops / roofs.peak_flops:.0f}% of peak {roofs.dtype} FLOP/s"
    counted = ""
    if point.weight_bytes_counted is not None and point.weight_bytes_estimated:
        counted = (f"; the kernels read {point.weight_bytes_counted / 1e6:,.1f} MB of weights a step, "
                   f"{point.weight_bytes_counted / point.weight_bytes_estimated:.2f}x the "
                   f"{point.weight_bytes_estimated / 1e6:,.1f} MB its shape says")
    return f"{point.label}: {regime.regime}, {share}{counted}"
