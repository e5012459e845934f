"""A measured backend: this machine's roofs and the engine's efficiencies, from `tokios roofline --json`.

Owns `RooflineMeasurement` (read by `load_roofline_json`: the roofs that tools/roofline_bench.py
measured and the engine's prefill and decode points, tools/roofline_measure.py) and
`fit_efficiency`, which finds the Efficiency (cost_model.py: share of the FLOP/s roof, share of
the bandwidth roof, fixed seconds per step) under which the simulator's step formula,
overhead + max(FLOPs / (e_c x peak), bytes / (e_b x bandwidth)), best predicts the measured steps.

Why fit, and how: the roofline is a floor; on a 2-core CPU the engine's decode reaches a fraction
of the bandwidth roof and its prefill a fraction of the matmul roof, and every step pays Python
and scheduling time. The three numbers are chosen to minimise the squared log error over all
points (so a 5 ms decode step counts as much as a 2 s prefill), by a grid search refined twice
around its best cell: deterministic, no dependency. `Calibration.residuals` lists each point's
prediction against its measurement, so the fit can be judged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from tokios.errors import InvalidRequestError
from tokios.tools.hardware import HardwareSpec, spec_from_measurement
from tokios.tools.simulate.cost_model import Efficiency


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
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
        steps = [MeasuredStep(_label(point), float(point["flops"]), float(point["bytes_moved"]), float(point["seconds"]))
                 for point in record.get("points", [])]
        roof_dtype, engine_dtype = str(record["roof_dtype"]), str(record.get("engine_dtype", ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(f"roofline_json: cannot read {path} as the output of `tokios roofline --json` "
                                  f"({exc})", param="roofline_json") from None
    phases = {step.label.split()[0] for step in steps}
    if not {"prefill", "decode"} <= phases:
        raise InvalidRequestError(f"roofline_json: {path} needs both prefill and decode points (run "
                                  "`tokios roofline --json` without --skip-engine)", param="roofline_json")
    return RooflineMeasurement(hardware, roof_dtype, engine_dtype, steps)


def _label(point: dict) -> str:
    if point["phase"] == "decode":
        return f"decode at batch {point['batch_size']}"
    return f"prefill of {point['num_tokens']} tokens"


@dataclasses.dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    residuals: list[tuple[str, float, float]]  # (point, predicted seconds, measured seconds)

    @property
    def rms_log_error(self) -> float:
        return math.sqrt(sum(math.log(p / m) ** 2 for _, p, m in self.residuals) / len(self.residuals))

    def to_dict(self) -> dict:
        return {"compute_efficiency": self.efficiency.compute, "bandwidth_efficiency": self.efficiency.bandwidth,
                "step_overhead_s": self.efficiency.step_overhead_s,
                "points": [{"point": label, "predicted_s": predicted, "measured_s": measured}
                           for label, predicted, measured in self.residuals]}


def predicted_seconds(step: MeasuredStep, peak_flops: float, bandwidth: float, efficiency: Efficiency) -> float:
    return efficiency.step_overhead_s + max(step.flops / (efficiency.compute * peak_flops),
                                            step.bytes_moved / (efficiency.bandwidth * bandwidth))


def fit_efficiency(measurement: RooflineMeasurement) -> Calibration:
    steps = measurement.steps
    peak, bandwidth = measurement.peak_flops, measurement.hardware.memory_bandwidth
    compute_times = [step.flops / peak for step in steps]
    memory_times = [step.bytes_moved / bandwidth for step in steps]
    logs_measured = [math.log(step.seconds) for step in steps]

    def loss(compute: float, bw: float, overhead: float) -> float:
        return sum((math.log(overhead + max(c / compute, m / bw)) - logged) ** 2
                   for c, m, logged in zip(compute_times, memory_times, logs_measured))

    shortest = min(step.seconds for step in steps)
    # Grids: efficiencies log-spaced over [0.01, 4]; overhead 0 or log-spaced below the shortest step.
    compute_grid = _geometric(0.01, 4.0, 40)
    bandwidth_grid = _geometric(0.01, 4.0, 40)
    overhead_grid = [0.0] + _geometric(shortest * 1e-3, shortest * 0.95, 20)
    best = min(((loss(c, b, o), c, b, o) for c in compute_grid for b in bandwidth_grid for o in overhead_grid))
    for span in (1.3, 1.04):  # refine around the best cell, each time finer
        _, c0, b0, o0 = best
        compute_grid = _geometric(max(0.01, c0 / span), min(4.0, c0 * span), 15)
        bandwidth_grid = _geometric(max(0.01, b0 / span), min(4.0, b0 * span), 15)
        overhead_grid = sorted({0.0, *(_geometric(o0 / span, min(shortest * 0.95, o0 * span), 15) if o0 else [])})
        best = min(best, *((loss(c, b, o), c, b, o) for c in compute_grid for b in bandwidth_grid for o in overhead_grid))
    _, compute, bw, overhead = best
    efficiency = Efficiency(compute=compute, bandwidth=bw, step_overhead_s=overhead)
    residuals = [(step.label, predicted_seconds(step, peak, bandwidth, efficiency), step.seconds) for step in steps]
    return Calibration(efficiency, residuals)


def _geometric(low: float, high: float, count: int) -> list[float]:
    if count == 1 or high <= low:
        return [low]
    ratio = (high / low) ** (1 / (count - 1))
    return [low * ratio ** i for i in range(count)]
