"""The simulator's PNG charts, drawn with matplotlib on the Agg backend (no display needed).

Owns `draw_policy_chart` (one simulation per policy: TTFT and TPOT percentiles side by side,
throughput and cache hit rate in the legend) and `draw_fleet_chart` (the fleet-size curves:
backends needed against request rate, one line per policy, and the cache hit rate at that
size). Called by cli.py; matplotlib comes from tools/charts.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokios.tools.charts import pyplot, save_png
from tokios.tools.simulate.fleet_search import FleetSearch
from tokios.tools.simulate.report import PolicyReport, Slo

POLICY_TO_COLOR = {"rr": "tab:blue", "least-busy": "tab:green", "prefix": "tab:red"}


def draw_policy_chart(reports: Sequence[PolicyReport], path: str | Path, *, title: str) -> Path:
    plt = pyplot()
    figure, (ttft_axes, tpot_axes) = plt.subplots(1, 2, figsize=(9, 4), dpi=100)
    percentiles = ("p50", "p90", "p99")
    width = 0.8 / max(1, len(reports))
    for index, report in enumerate(reports):
        offsets = [i + (index - (len(reports) - 1) / 2) * width for i in range(len(percentiles))]
        label = (f"{report.policy}: {report.output_tokens_per_s:,.0f} out tok/s, "
                 f"cache hit {100 * report.cache_hit_rate:.0f}%")
        color = POLICY_TO_COLOR.get(report.policy)
        ttft_axes.bar(offsets, [getattr(report.ttft, f"{p}_s") for p in percentiles], width, label=label, color=color)
        tpot_axes.bar(offsets, [1e3 * getattr(report.tpot, f"{p}_s") for p in percentiles], width, color=color)
    for axes, name, unit in ((ttft_axes, "TTFT", "s"), (tpot_axes, "TPOT", "ms")):
        axes.set_xticks(range(len(percentiles)), percentiles)
        axes.set_ylabel(f"{name} ({unit})")
        axes.set_title(name)
        axes.grid(True, axis="y", linewidth=0.3)
    ttft_axes.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    return save_png(figure, path)


def draw_fleet_chart(searches: Sequence[FleetSearch], slo: Slo, path: str | Path, *, title: str) -> Path:
    plt = pyplot()
    figure, (size_axes, hit_axes) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    policies = list(dict.fromkeys(search.policy for search in searches))
    for policy in policies:
        found = [s for s in searches if s.policy == policy and s.num_backends is not None]
        if not found:
            continue
        color = POLICY_TO_COLOR.get(policy)
        size_axes.plot([s.rate for s in found], [s.num_backends for s in found], marker="o", label=policy, color=color)
        hit_axes.plot([s.rate for s in found], [100 * s.report.cache_hit_rate for s in found], marker="o",
                      label=policy, color=color)
    size_axes.set_xlabel("request rate (req/s)")
    size_axes.set_ylabel("backends needed")
    size_axes.set_title(f"fewest backends meeting {slo}", fontsize=9)
    hit_axes.set_xlabel("request rate (req/s)")
    hit_axes.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    hit_axes.set_title("cache hit rate at that fleet size", fontsize=9)
    hit_axes.set_ylim(bottom=0)
    for axes, corner in ((size_axes, "upper left"), (hit_axes, "lower left")):
        axes.grid(True, linewidth=0.3)
        axes.legend(fontsize=8, loc=corner)
    figure.suptitle(title, fontsize=9)
    return save_png(figure, path)
