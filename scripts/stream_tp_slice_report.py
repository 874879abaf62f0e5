"""The table and plot of scripts/stream_tp_slice.py runs: sliced against staged streams into a larger decode TP size.

    python scripts/stream_tp_slice_report.py docs/benchmarks/stream-tp-slice-*.json \
        --plot docs/benchmarks/stream-tp-slice.png

Reads one JSON per system and regime and prints a markdown table: per regime (the first of its UCX_TLS) and
system, the requests, the medians of their wall seconds (``max_tokens`` 2), the prefill engine's prefill seconds
and the mean wait after the last layer of the request's streams (s), the wall seconds past the prefill, and the
bytes each decode rank received per request (MiB). The plot shows each request's wall seconds past its prefill
and its wait after the last layer, per regime and system.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.plotting import pyplot, save


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: list[dict[str, Any]]) -> list[str]:
    """The markdown table's lines, a row per result, in regime then system order."""
    lines = ["| regime | system | requests | wall s (median) | prefill s (median) | wait after the last layer, s "
             "(median) | wall past the prefill, s (median) | MiB per decode rank and request |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["ucx_tls"].split(",")[0], r["system"])):
        rows = r["requests"]
        past = statistics.median(x["wall_s"] - x["prefill_s"] for x in rows)
        mib = sorted({p["bytes"] >> 20 for p in r["pulls"]})
        lines.append(f"| {r['ucx_tls'].split(',')[0]} | {r['system']} | {len(rows)} | {_median(rows, 'wall_s'):.2f} | "
                     f"{_median(rows, 'prefill_s'):.2f} | {_median(rows, 'tail_s'):.3f} | {past:.2f} | "
                     f"{', '.join(map(str, mib))} |")
    return lines


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Each request's wall seconds past its prefill (dots; bars: their median) and its wait after the last layer
    (crosses), per regime and system: what the transfer adds to the first token."""
    plt = pyplot("stream_tp_slice_report", "plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ordered = sorted(results, key=lambda r: (r["ucx_tls"].split(",")[0], r["system"]))
    for i, r in enumerate(ordered):
        past = [x["wall_s"] - x["prefill_s"] for x in r["requests"]]
        tails = [x["tail_s"] for x in r["requests"]]
        ax.bar(i, statistics.median(past), color="tab:blue" if r["system"] == "sliced" else "tab:orange",
               alpha=0.6)
        ax.scatter([i] * len(past), past, color="black", s=10, zorder=3)
        ax.scatter([i] * len(tails), tails, color="tab:red", marker="x", s=20, zorder=3)
    ax.set_xticks(range(len(ordered)))
    ax.set_xticklabels([f"{r['ucx_tls'].split(',')[0]}\n{r['system']}" for r in ordered])
    ax.set_ylabel("seconds past the prefill")
    ax.set_title(f"{ordered[0]['length']}-token prompts into decode TP {ordered[0]['decode_tp']}\n"
                 "wall past the prefill (dots, bar: median), wait after the last layer (x)", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON files of scripts/stream_tp_slice.py")
    parser.add_argument("--plot", default=None, help="write the plot here (PNG)")
    args = parser.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    print("\n".join(table(results)))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
