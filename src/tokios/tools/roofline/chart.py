"""The roofline chart: a log-log PNG of the machine's roofs and the measured points.

Owns `draw_roofline_chart(roofs_list, points, path)`, called by tools/roofline/cli.py. x is
arithmetic intensity (FLOPs per byte), y achieved FLOP/s; each roof is min(peak, x * bandwidth)
for one dtype; prefill and decode points are marked differently and labelled. matplotlib runs
on the Agg backend (no display needed) and is imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokios.tools.charts import pyplot, save_png
from tokios.tools.roofline.roofs import Roofs, RooflinePoint


def draw_roofline_chart(roofs_list: Sequence[Roofs], points: Sequence[RooflinePoint],
                        path: str | Path, *, title: str = "Roofline") -> Path:
    import numpy as np

    plt = pyplot()

    intensities = [p.arithmetic_intensity for p in points] + [r.ridge_intensity for r in roofs_list]
    low = min(intensities) / 4
    high = max(intensities) * 4
    x = np.logspace(np.log10(low), np.log10(high), 256)
    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
    roof_colors = ("tab:blue", "tab:green", "tab:cyan", "tab:olive")
    for roofs, color in zip(roofs_list, roof_colors * len(roofs_list)):
        axes.plot(x, np.minimum(roofs.peak_flops, x * roofs.memory_bandwidth) / 1e9,
                  label=f"{roofs.dtype} roof: {roofs.peak_flops / 1e9:,.0f} GFLOP/s, "
                        f"{roofs.memory_bandwidth / 1e9:,.1f} GB/s", color=color)
        axes.axvline(roofs.ridge_intensity, linestyle=":", linewidth=0.8, color="grey")
    for phase, marker, color in (("prefill", "s", "tab:red"), ("decode", "o", "tab:purple")):
        chosen = [p for p in points if p.phase == phase]
        if not chosen:
            continue
        axes.scatter([p.arithmetic_intensity for p in chosen], [p.achieved_flops / 1e9 for p in chosen],
                     marker=marker, color=color, zorder=3, label=f"{phase} (measured)")
        for point in chosen:
            tag = f"b{point.batch_size}" if phase == "decode" else f"p{point.num_tokens}"
            axes.annotate(tag, (point.arithmetic_intensity, point.achieved_flops / 1e9),
                          textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    axes.set_ylabel("GFLOP/s")
    axes.set_title(title)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8, loc="lower right")
    return save_png(figure, path)
