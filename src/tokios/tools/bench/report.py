"""Benchmark output: Markdown tables, JSON files, PNG plots, and sections of docs/benchmarks.md.

Every bench command prints through here, so the table shapes stay the same across commands.
`update_docs_section` rewrites one `## ` section of the benchmarks page in place and leaves the
sections other engineers own untouched. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

from tokios.tools.bench.stats import ServeSummary
from tokios.tools.charts import pyplot, save_png

DOCS_TITLE = "# Benchmarks"


def fmt(value: float, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


_LATENCY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency"))
_LATENCY_STATS = (("mean_ms", "mean"), ("median_ms", "p50"), ("p90_ms", "p90"), ("p95_ms", "p95"),
                  ("p99_ms", "p99"))


def serve_rows(summary: ServeSummary) -> list[tuple[str, str]]:
    """(metric, value) pairs in the order `vllm bench serve` prints them."""
    rows = [
        ("completed / failed", f"{summary.num_completed} / {summary.num_failed}"),
        ("duration (s)", fmt(summary.duration_s, 2)),
        ("input / output tokens", f"{summary.total_input_tokens} / {summary.total_output_tokens}"),
        ("request throughput (req/s)", fmt(summary.request_throughput, 2)),
        ("output token throughput (tok/s)", fmt(summary.output_throughput)),
        ("total token throughput (tok/s)", fmt(summary.total_token_throughput)),
        ("peak concurrency", str(summary.peak_concurrency)),
    ]
    for attr, name in _LATENCY_METRICS:
        latency = getattr(summary, attr)
        for stat_attr, stat_name in _LATENCY_STATS:
            rows.append((f"{name} {stat_name} (ms)", fmt(getattr(latency, stat_attr))))
    return rows


def serve_table(summaries: list[ServeSummary], *, title: str = "") -> str:
    """One column per load level, one row per metric."""
    per_level = [serve_rows(s) for s in summaries]
    rows = [[name] + [level[i][1] for level in per_level] for i, (name, _) in enumerate(per_level[0])]
    table = markdown_table(["metric"] + [s.label for s in summaries], rows)
    errors = [f"- {s.label}: {err}" for s in summaries for err in s.errors]
    parts = ([f"**{title}**", ""] if title else []) + [table]
    if errors:
        parts += ["", "Errors:", *errors]
    return "\n".join(parts)


def load_to_dict(load) -> dict:
    """A ServeLoad as JSON-ready data, without the API key."""
    data = {k: v for k, v in dataclasses.asdict(load).items() if k != "api_key"}
    return data | {"input_len": str(load.input_len), "output_len": str(load.output_len)}


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # NaN is not JSON: write null for missing percentiles.
    text = json.dumps(_nan_to_none(data), indent=2)
    Path(path).write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _nan_to_none(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def _concurrency_of(summary: ServeSummary, position: int) -> float:
    match = re.search(r"c=(\d+)", summary.label)
    return float(match.group(1)) if match else float(position + 1)


def plot_serve(series_to_summaries: dict[str, list[ServeSummary]], plot_dir: str) -> list[str]:
    """throughput_vs_concurrency.png, ttft_percentiles.png, tpot_percentiles.png; returns paths."""
    plt = pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, summaries in series_to_summaries.items():
        xs = [_concurrency_of(s, i) for i, s in enumerate(summaries)]
        ax.plot(xs, [s.output_throughput for s in summaries], marker="o", label=f"{name} output")
        ax.plot(xs, [s.total_token_throughput for s in summaries], marker="x", linestyle="--",
                label=f"{name} total")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s")
    ax.set_title("Token throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(str(save_png(fig, Path(plot_dir) / "throughput_vs_concurrency.png", dpi=110)))
    for attr, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for series_name, summaries in series_to_summaries.items():
            xs = [_concurrency_of(s, i) for i, s in enumerate(summaries)]
            for stat_attr, stat_name, style in (("median_ms", "p50", "-"), ("p95_ms", "p95", "--"),
                                                ("p99_ms", "p99", ":")):
                ax.plot(xs, [getattr(getattr(s, attr), stat_attr) for s in summaries], marker="o",
                        linestyle=style, label=f"{series_name} {stat_name}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles vs concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        paths.append(str(save_png(fig, Path(plot_dir) / f"{attr}_percentiles.png", dpi=110)))
    return paths


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, for the docs: `tokios bench ...`."""
    argv = sys.argv[1:] if argv is None else argv
    return "tokios " + " ".join(shlex.quote(a) for a in argv)


def update_docs_section(path: str, heading: str, body: str) -> None:
    """Replace (or append) the `## heading` section of the Markdown file at path.

    The section runs to the next `## ` heading; every other section is kept byte for byte. The
    file is re-read right before writing because other commands edit other sections.
    """
    file_path = Path(path)
    text = file_path.read_text() if file_path.exists() else DOCS_TITLE + "\n"
    if not text.lstrip().startswith("# "):
        text = DOCS_TITLE + "\n\n" + text
    section = f"## {heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
        text = text.rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    file_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = file_path.with_suffix(file_path.suffix + ".tmp")
    tmp_path.write_text(text)
    os.replace(tmp_path, file_path)
