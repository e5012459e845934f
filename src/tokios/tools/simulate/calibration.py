"""A measured backend: this machine's roofs and the engine's efficiencies, from `tokios roofline --json`.

Owns `RooflineMeasurement` (read by `load_roofline_json`: the roofs that tools/roofline/microbench.py
measured and the engine's prefill and decode points, tools/roofline/measure.py) and
`fit_efficiency`, which finds the Efficiency (cost_model.py: the share of the FLOP/s roof that
prompt tokens and that decode rows attain, the share of the bandwidth roof, fixed seconds per
step) under which the simulator's step formula,
overhead + max(FLOPs / (efficiency x peak), bytes / (efficiency x bandwidth)), best predicts the
measured steps.

Why fit, and how: the roofline is a floor; on a 2-core CPU the engine's decode reaches a fraction
of the bandwidth roof and its prefill a fraction of the matmul roof, and every step pays Python
and scheduling time. The four numbers minimise the squared log error over all points (so a 5 ms
decode step counts as much as a 2 s prefill), by coordinate descent over log-spaced grids that
narrow each round, from four starts (an overhead of 0 to 90% of the shortest step, the rest read
off the points: prefill points as compute-bound, the smallest decode batch as bandwidth-bound, the
largest as compute-bound), keeping the best: deterministic, no dependency.
`Calibration.residuals` lists each point's prediction against its measurement, so the fit can be
judged; points need both phases, and two decode batch sizes at least, for the four to be told apart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from tokios.errors import InvalidRequestError
from tokios.tools.plan.hardware import HardwareSpec, spec_from_measurement
from tokios.tools.simulate.cost_model import Efficiency


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
    phase: str  # "prefill" or "decode"
    label: str  # "prefill of 256 tokens", "decode at batch 4"
    flops: float
    bytes_moved: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class RooflineMeasurement:
    hardware: HardwareSpec
    roof_dtype: str
    engine_dtype: str
    steps: list[MeasuredStep]

    @property
    def peak_flops(self) -> float:
        return self.hardware.peak_flops(self.roof_dtype)


def load_roofline_json(path: str | Path) -> RooflineMeasurement:
    try:
        record = json.loads(Path(path).read_text())
        hardware = spec_from_measurement(record["measurement"])
        steps = [MeasuredStep(str(point["phase"]), _label(point), float(point["flops"]), float(point["bytes_moved"]), float(point["seconds"]))
                 for point in record.get("points", [])]
        roof_dtype, engine_dtype = str(record["roof_dtype"]), str(record.get("engine_dtype", ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(f"roofline_json: cannot read {path} as the output of `tokios roofline --json` "
                                  f"({exc})", param="roofline_json") from None
    num_prefills = sum(1 for step in steps if step.phase == "prefill")
    if num_prefills < 1 or len(steps) - num_prefills < 2:
        raise InvalidRequestError(f"roofline_json: {path} needs a prefill point and two decode batch sizes at least "
                                  "(run `tokios roofline --json` without --skip-engine)", param="roofline_json")
    return RooflineMeasurement(hardware, roof_dtype, engine_dtype, steps)


def _label(point: dict) -> str:
    if point["phase"] == "decode":
        return f"decode at batch {point['batch_size']}"
    return f"prefill of {point['num_tokens']} tokens"


@dataclasses.dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    residuals: list[tuple[str, float, float]]  # (point, predicted seconds, measured seconds)
    is_fitted: bool = True  # False: the efficiency was given (flags), the points only judge it

    @property
    def rms_log_error(self) -> float:
        return math.sqrt(sum(math.log(p / m) ** 2 for _, p, m in self.residuals) / len(self.residuals))

    def to_dict(self) -> dict:
        return {"prefill_compute_efficiency": self.efficiency.prefill_compute,
                "decode_compute_efficiency": self.efficiency.decode_compute,
                "bandwidth_efficiency": self.efficiency.bandwidth,
                "step_overhead_s": self.efficiency.step_overhead_s,
                "points": [{"point": label, "predicted_s": predicted, "measured_s": measured}
                           for label, predicted, measured in self.residuals]}


def predicted_seconds(step: MeasuredStep, peak_flops: float, bandwidth: float, efficiency: Efficiency) -> float:
    compute = efficiency.decode_compute if step.phase == "decode" else efficiency.prefill_compute
    return efficiency.step_overhead_s + max(step.flops / (compute * peak_flops),
                                            step.bytes_moved / (efficiency.bandwidth * bandwidth))


_MIN_EFFICIENCY, _MAX_EFFICIENCY = 1e-3, 4.0
_SPANS = (8.0, 2.0, 1.25, 1.05, 1.01)  # each round searches value / span .. value * span
_GRID_SIZE = 41
_SWEEPS_PER_SPAN = 4
_OVERHEAD_START_SHARES = (0.0, 0.3, 0.6, 0.9)  # of the shortest measured step


def fit_efficiency(measurement: RooflineMeasurement) -> Calibration:
    steps = measurement.steps
    peak, bandwidth = measurement.peak_flops, measurement.hardware.memory_bandwidth
    shortest = min(step.seconds for step in steps)

    def loss(params: list[float]) -> float:
        efficiency = _efficiency(params)
        return sum(math.log(predicted_seconds(step, peak, bandwidth, efficiency) / step.seconds) ** 2
                   for step in steps)

    prefills = [s for s in steps if s.phase == "prefill"]
    decodes = sorted((s for s in steps if s.phase == "decode"), key=lambda s: s.flops)
    best_loss, best_params = math.inf, None
    # Several starts, one per guess of the overhead: with max() in the formula a single descent can
    # stop on a ridge (e.g. no overhead, a low bandwidth share) far from the best fit.
    for overhead_share in _OVERHEAD_START_SHARES:
        overhead = overhead_share * shortest
        params = [  # prefill compute, decode compute, bandwidth, overhead
            _clip(statistics.median(s.flops / peak / (s.seconds - overhead) for s in prefills)),
            _clip(decodes[-1].flops / peak / (decodes[-1].seconds - overhead)),
            _clip(decodes[0].bytes_moved / bandwidth / (decodes[0].seconds - overhead)),
            overhead,
        ]
        current = loss(params)
        for span in _SPANS:
            for _ in range(_SWEEPS_PER_SPAN):
                for index in range(len(params)):
                    for candidate in _candidates(index, params[index], span, shortest):
                        trial = params[:index] + [candidate] + params[index + 1:]
                        trial_loss = loss(trial)
                        if trial_loss < current:
                            current, params = trial_loss, trial
        if current < best_loss:
            best_loss, best_params = current, params
    params = best_params
    return evaluate_efficiency(measurement, _efficiency(params))


def evaluate_efficiency(measurement: RooflineMeasurement, efficiency: Efficiency, *,
                        is_fitted: bool = True) -> Calibration:
    """Each measured step against what `efficiency` predicts for it."""
    peak, bandwidth = measurement.peak_flops, measurement.hardware.memory_bandwidth
    residuals = [(step.label, predicted_seconds(step, peak, bandwidth, efficiency), step.seconds)
                 for step in measurement.steps]
    return Calibration(efficiency, residuals, is_fitted)


def _efficiency(params: list[float]) -> Efficiency:
    return Efficiency(prefill_compute=params[0], decode_compute=params[1], bandwidth=params[2],
                      step_overhead_s=params[3])


def _clip(efficiency: float) -> float:
    return min(_MAX_EFFICIENCY, max(_MIN_EFFICIENCY, efficiency))


def _candidates(index: int, value: float, span: float, shortest_s: float) -> list[float]:
    if index < 3:
        return _geometric(_clip(value / span), _clip(value * span), _GRID_SIZE)
    # The overhead: 0, or up to 95% of the shortest measured step.
    ceiling = 0.95 * shortest_s
    if value == 0.0:
        return [0.0] + _geometric(ceiling * 1e-3, ceiling, _GRID_SIZE)
    return [0.0] + _geometric(max(ceiling * 1e-4, value / span), min(ceiling, value * span), _GRID_SIZE)


def _geometric(low: float, high: float, count: int) -> list[float]:
    if count == 1 or high <= low:
        return [low]
    ratio = (high / low) ** (1 / (count - 1))
    return [low * ratio ** i for i in range(count - 1)] + [high]  # the ends exact: no rounding past a bound
