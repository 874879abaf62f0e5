"""A :class:`~p2pkv.tools.trace.timeline.Layout` drawn as a timeline PNG (matplotlib, Agg, no display needed)."""

from __future__ import annotations

from pathlib import Path

from p2pkv.tools.trace.timeline import Layout

LANE_COLORS = ("#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#937860")
"""Bar colours, one per lane in turn."""
FAILED_COLOR = "#d62728"
"""A failed span's bar."""
ROW_INCHES = 0.32
"""Height of one row (inches)."""
WIDTH_INCHES = 14.0
DPI = 100


def draw(plan: Layout, path: Path, title: str = "") -> None:
    """Write ``plan`` as a PNG: a band per lane (named on the left), a bar per span labelled with its
    name and duration, children indented under their parents, failed spans red.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: ``path`` cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = max(1, plan.rows)
    fig = Figure(figsize=(WIDTH_INCHES, 1.6 + ROW_INCHES * rows), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    total = plan.total_ms or 1.0
    for i, lane in enumerate(plan.lanes):
        ax.axhspan(lane.first_row - 0.5, lane.first_row + lane.rows - 0.5,
                   color="#f2f2f2" if i % 2 == 0 else "#ffffff", zorder=0)
    gap = total * 0.005
    for bar in plan.bars:
        color = FAILED_COLOR if bar.failed else LANE_COLORS[bar.lane % len(LANE_COLORS)]
        width = max(bar.end_ms - bar.start_ms, total * 0.002)  # a zero-length span stays visible
        ax.barh(bar.row, width, left=bar.start_ms, height=0.6, color=color, edgecolor="#333333", linewidth=0.4,
                zorder=2)
        text = "  " * bar.depth + ("└ " if bar.depth else "") + bar.label + (" (ERROR)" if bar.failed else "")
        if bar.end_ms - bar.start_ms > total * 0.5:  # a long bar holds its own label
            ax.text(bar.start_ms + gap, bar.row, text, ha="left", va="center", fontsize=7.5, color="white",
                    zorder=3)
        elif bar.end_ms < total * 0.7:  # one span per row: the rest of the row is free
            ax.text(bar.end_ms + gap, bar.row, text, ha="left", va="center", fontsize=7.5, zorder=3)
        else:
            ax.text(bar.start_ms - gap, bar.row, text, ha="right", va="center", fontsize=7.5, zorder=3)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(-total * 0.01, total * 1.02)
    ax.set_yticks([lane.first_row + (lane.rows - 1) / 2 for lane in plan.lanes])
    ax.set_yticklabels([lane.service for lane in plan.lanes])
    ax.set_xlabel("milliseconds since the trace's first span started")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=1)
    if any(bar.failed for bar in plan.bars):
        ax.legend(handles=[Patch(color=FAILED_COLOR, label="failed (status ERROR)")], loc="lower right",
                  fontsize=7.5)
    ax.set_title(title or f"trace {plan.trace_id}  ({len(plan.bars)} spans, {plan.total_ms:.2f} ms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
