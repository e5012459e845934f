"""How many backends a rate needs: the smallest fleet that meets a latency SLO, and its curve.

Owns `FleetSearch` (one policy at one rate: the answer and every size tried) and
`find_fleet_size`, which simulates fleets of 1, 2, 4, ... backends until one meets the SLO, then
bisects between the last that failed and the first that met it; and `sweep_rates`, which does
that for each request rate (the same seeded workload, its gaps rescaled) and each policy: the
fleet-size curves. Bisection assumes more backends never hurt; each size tried is reported, so
a case where that fails would show.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from tokios.errors import InvalidRequestError
from tokios.gateway.router import PrefixPolicy
from tokios.tools.simulate.engine import MAX_BACKENDS, FleetSpec, simulate
from tokios.tools.simulate.report import PolicyReport, Slo, summarize
from tokios.tools.simulate.backend import ServiceModel
from tokios.tools.simulate.workload import WorkloadSpec, make_workload


@dataclasses.dataclass(frozen=True)
class FleetSearch:
    policy: str
    rate: float
    num_backends: int | None  # None: even max_backends misses the SLO
    report: PolicyReport | None  # at num_backends
    size_to_meets: dict[int, bool]  # every fleet size simulated, and whether it met the SLO

    def to_dict(self) -> dict:
        return {"policy": self.policy, "rate": self.rate, "num_backends": self.num_backends,
                "report": self.report.to_dict() if self.report else None,
                "sizes_tried": {str(size): meets for size, meets in sorted(self.size_to_meets.items())}}


def find_fleet_size(workload_spec: WorkloadSpec, service: ServiceModel, policy: str, slo: Slo, *,
                    max_backends: int = 10_000, prefix_options: PrefixPolicy = PrefixPolicy(),
                    min_backends: int = 1, progress: Callable[[str], None] | None = None) -> FleetSearch:
    if not slo.is_set:
        raise InvalidRequestError("slo_ttft_p99: finding a fleet size needs --slo-ttft-p99 and/or --slo-tpot-p99",
                                  param="slo_ttft_p99")
    if not isinstance(max_backends, int) or not 1 <= max_backends <= MAX_BACKENDS:
        raise InvalidRequestError(f"max_backends: {max_backends!r} must be an integer within [1, {MAX_BACKENDS}]",
                                  param="max_backends")
    workload = make_workload(workload_spec)
    size_to_report: dict[int, PolicyReport] = {}

    def meets(num_backends: int) -> bool:
        if num_backends not in size_to_report:
            result = simulate(workload, FleetSpec(num_backends, service), policy,
                              prefix_options=prefix_options, seed=workload_spec.seed)
            size_to_report[num_backends] = summarize(result)
            if progress is not None:
                report = size_to_report[num_backends]
                progress(f"{policy} at {workload_spec.rate:g} req/s, {num_backends:,} backends: TTFT p99 "
                         f"{report.ttft.p99_s:.3f} s, TPOT p99 {report.tpot.p99_s * 1e3:.1f} ms "
                         f"({report.wall_s:.1f} s)")
        return slo.meets(size_to_report[num_backends])

    low = 0  # the largest size known to miss (0: none; a start above 1 that meets at once bisects down)
    high = max(1, min(min_backends, max_backends))
    while not meets(high):
        if high >= max_backends:
            return FleetSearch(policy, workload_spec.rate, None, None,
                               {size: slo.meets(report) for size, report in size_to_report.items()})
        low, high = high, min(2 * high, max_backends)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return FleetSearch(policy, workload_spec.rate, high, size_to_report[high],
                       {size: slo.meets(report) for size, report in size_to_report.items()})


def sweep_rates(workload_spec: WorkloadSpec, rates: list[float], policies: list[str], service: ServiceModel,
                slo: Slo, *, duration_s: float | None = None, max_backends: int = 10_000,
                prefix_options: PrefixPolicy = PrefixPolicy(),
                progress: Callable[[str], None] | None = None) -> list[FleetSearch]:
    """One FleetSearch per (rate, policy). With `duration_s` each rate gets rate x duration
    requests (at least 1), so every rate is simulated over the same stretch of time. The search at
    a higher rate starts from the size the previous rate needed (assuming more requests per second
    never need fewer backends); if that size already meets the SLO it bisects down from it."""
    searches = []
    policy_to_floor = {policy: 1 for policy in policies}
    for rate in sorted(rates):
        num_requests = max(1, math.ceil(rate * duration_s)) if duration_s else workload_spec.num_requests
        spec = dataclasses.replace(workload_spec, rate=rate, num_requests=num_requests)
        for policy in policies:
            search = find_fleet_size(spec, service, policy, slo, max_backends=max_backends,
                                     prefix_options=prefix_options, min_backends=policy_to_floor[policy],
                                     progress=progress)
            searches.append(search)
            if search.num_backends is not None:
                policy_to_floor[policy] = search.num_backends
    return searches
