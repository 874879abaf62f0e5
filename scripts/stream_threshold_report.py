"""The table and plot of scripts/bench_stream_threshold.sh: where layer streaming stops paying for short prompts.

    python scripts/stream_threshold_report.py docs/benchmarks stream-threshold-cpu

Reads ``<dir>/<name>-<transport>-<tokens>.json`` (``scripts/bench_transfer.py --mode stream``, one per transport
and prompt length) and writes ``<dir>/<name>-table.md`` and ``<dir>/<name>.png``: per transport, prompt length
and cache (cross-layer, per-layer), the time from the decode's ask to the notification (ms, p50: the stand-in
forward plus the wait after its last layer) of the stream and of one bulk WRITE after the last layer, their
ratio, and the forward's own time under each (a poster that slows the forward shows there). The threshold per
transport and cache: the shortest prompt from which on every longer one streams faster than the bulk WRITE.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.plotting import pyplot, save

CACHES = ("per_layer", "cross_layer")


def rows(path: Path) -> list[dict[str, Any]]:
    """One row per cache kind of one run's JSON."""
    match = re.search(r"-(\w+)-(\d+)\.json$", path.name)
    if match is None:
        return []
    transport, tokens = match.group(1), int(match.group(2))
    result = json.loads(path.read_text())["results"][0]["stream"]
    out = []
    for cache in CACHES:
        stream, bulk = result.get(f"{cache}/stream"), result.get(f"{cache}/bulk")
        if stream is None or bulk is None:
            continue
        out.append({"transport": transport, "tokens": tokens, "cache": cache,
                    "stream_ms": stream["total_ms"]["p50"], "bulk_ms": bulk["total_ms"]["p50"],
                    "stream_forward_ms": stream["compute_ms"]["p50"], "bulk_forward_ms": bulk["compute_ms"]["p50"],
                    "stream_wait_ms": stream["wait_after_last_layer_ms"]["p50"],
                    "bulk_wait_ms": bulk["wait_after_last_layer_ms"]["p50"],
                    "verified": bool(stream["verified"] and bulk["verified"])})
    return out


def thresholds(table: list[dict[str, Any]]) -> dict[tuple[str, str], int | None]:
    """(transport, cache) → the shortest prompt (tokens) from which on every measured longer one streamed
    faster than the bulk WRITE (None: the longest did not)."""
    out: dict[tuple[str, str], int | None] = {}
    for key in sorted({(r["transport"], r["cache"]) for r in table}):
        points = sorted((r["tokens"], r["stream_ms"] < r["bulk_ms"]) for r in table
                        if (r["transport"], r["cache"]) == key)
        best: int | None = None
        for tokens, faster in reversed(points):
            if not faster:
                break
            best = tokens
        out[key] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("name")
    args = parser.parse_args()
    table = sorted((r for p in args.dir.glob(f"{args.name}-*-*.json") for r in rows(p)),
                   key=lambda r: (r["transport"], r["cache"], r["tokens"]))
    lines = ["| transport | cache | tokens | stream ask→note p50 ms | bulk ask→note p50 ms | stream / bulk | "
             "forward p50 ms (stream / bulk) | wait after last layer p50 ms (stream / bulk) | bytes equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['transport']} | {r['cache']} | {r['tokens']} | {r['stream_ms']:.2f} | {r['bulk_ms']:.2f} "
                     f"| {r['stream_ms'] / r['bulk_ms']:.2f} | {r['stream_forward_ms']:.2f} / "
                     f"{r['bulk_forward_ms']:.2f} | {r['stream_wait_ms']:.2f} / {r['bulk_wait_ms']:.2f} | "
                     f"{'yes' if r['verified'] else 'NO'} |")
    lines.append("")
    for (transport, cache), tokens in thresholds(table).items():
        lines.append(f"- {transport}, {cache}: streams faster from "
                     f"{'(none measured)' if tokens is None else f'{tokens} tokens'} on")
    text = "\n".join(lines) + "\n"
    (args.dir / f"{args.name}-table.md").write_text(text)
    print(text)
    plt = pyplot("stream_threshold_report")
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(CACHES), figsize=(11, 4), sharey=True)
    for ax, cache in zip(axes, CACHES, strict=True):
        for transport in sorted({r["transport"] for r in table}):
            pts = [r for r in table if r["transport"] == transport and r["cache"] == cache]
            ax.plot([r["tokens"] for r in pts], [r["stream_ms"] / r["bulk_ms"] for r in pts], marker="o",
                    label=transport)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{cache} cache")
    axes[0].set_ylabel("stream / bulk WRITE (ask → notification, p50)")
    axes[0].legend()
    save(fig, args.dir / f"{args.name}.png")


if __name__ == "__main__":
    main()
