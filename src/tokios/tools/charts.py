"""The tools' PNG charts: matplotlib on its Agg backend (no display needed), and writing a figure.

One place for what tokios roofline, tokios simulate and tokios bench share; matplotlib is imported
only when a chart is drawn, so building the tools' parsers stays cheap.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(figure, path: str | Path, *, dpi: float | None = None) -> Path:
    """Lays the figure out, writes it (making the folder), closes it; returns the path."""
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi or "figure")
    pyplot().close(figure)
    return path
