"""The table and plot of a paired prefill run of scripts/stream_wait_cpu.py: stream's prefill time over push's.

    python scripts/stream_prefill_ab_report.py docs/benchmarks/stream-prefill-ab-run.json \
        --plot docs/benchmarks/stream-prefill-ab-run.png

Reads the JSON that ``stream_wait_cpu.py`` wrote (one result per UCX regime and prompt length, push and stream
requests alternating) and prints a markdown table: per regime and length, the medians of the prefill engine's
own prefill time (``vllm:request_prefill_time_seconds``, s) per mode, stream over push of those medians and, per
alternating pair, the pairs' median with its 95 % bootstrap interval and their geometric mean, and the forward
thread's CPU seconds per request, stream over push; then per regime the pairs' figures over every length together
(the ratio does not depend on the length if the stream's cost is a share of the forward's). The issue's bound:
stream's prefill at most 5 % slower (ratio 1.05). The plot shows every pair's ratio per length and regime, the
pairs' medians with their intervals, and the bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.plotting import pyplot, save
from p2pkv.tools.bench.results import median_interval

BOUND = 1.05
"""The largest stream-over-push prefill time the issue allows."""
FORWARD = "P:MainThread"
"""The prefill engine's thread that runs the forward (named by ``py-spy`` in the JSON)."""


def regime(ucx_tls: str) -> str:
    """A UCX_TLS list's regime: ``tcp`` (every byte over loopback TCP: link-bound with the rate limit) or its first
    transport (``cma``: fast)."""
    return ucx_tls.split(",")[0]


def _row(name: str, tokens: str, pairs: list[float], push: list[float] | None, stream: list[float] | None,
         forward: float | None = None) -> str:
    lo, hi = median_interval(pairs)
    cells = [name, tokens, str(len(pairs))]
    if push is not None and stream is not None:
        cells += [f"{statistics.median(push):.2f}", f"{statistics.median(stream):.2f}",
                  f"{statistics.median(stream) / statistics.median(push):.3f}"]
    else:
        cells += ["-", "-", "-"]
    cells += [f"**{statistics.median(pairs):.3f}** ({lo:.3f}–{hi:.3f})", f"{statistics.geometric_mean(pairs):.3f}",
              "yes" if hi <= BOUND else ("no" if lo > BOUND else "not resolved"),
              "-" if forward is None else f"{forward:.3f}"]
    return "| " + " | ".join(cells) + " |"


def table(doc: dict[str, Any]) -> list[str]:
    """The markdown table's lines: a row per regime and length, then one per regime over all its lengths."""
    lines = ["| regime | prompt tokens | pairs | push prefill s (median) | stream prefill s (median) | "
             "stream / push, medians | stream / push, pairs' median (95 % interval) | pairs' geometric mean | "
             "interval within 1.05 | forward thread CPU-s per request, stream / push |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    pooled: dict[str, list[float]] = {}
    for r in doc["results"]:
        push = [q["prefill_s"] for q in r["push"]["requests"]]
        stream = [q["prefill_s"] for q in r["stream"]["requests"]]
        pairs = [s / p for p, s in zip(push, stream, strict=True)]
        pooled.setdefault(regime(r["ucx_tls"]), []).extend(pairs)
        threads = (r["push"]["threads"].get(FORWARD), r["stream"]["threads"].get(FORWARD))
        forward = threads[1] / threads[0] if None not in threads else None
        lines.append(_row(regime(r["ucx_tls"]), str(r["length"]), pairs, push, stream, forward))
    for name, pairs in pooled.items():
        lines.append(_row(name, "all", pairs, None, None))
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """Every pair's ratio (dots), each point's median with its interval, and the 1.05 bound."""
    plt = pyplot("stream_prefill_ab_report.py")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lengths = sorted({r["length"] for r in doc["results"]})
    regimes = sorted({regime(r["ucx_tls"]) for r in doc["results"]}, reverse=True)
    for k, name in enumerate(regimes):
        for r in doc["results"]:
            if regime(r["ucx_tls"]) != name:
                continue
            x = lengths.index(r["length"]) + (k - (len(regimes) - 1) / 2) * 0.25
            pairs = [s["prefill_s"] / p["prefill_s"] for p, s in
                     zip(r["push"]["requests"], r["stream"]["requests"], strict=True)]
            lo, hi = median_interval(pairs)
            mid = statistics.median(pairs)
            ax.scatter([x] * len(pairs), pairs, s=10, alpha=0.4, color=f"C{k}")
            ax.errorbar([x], [mid], yerr=[[mid - lo], [hi - mid]], fmt="o", color=f"C{k}", capsize=4,
                        label=name if r["length"] == lengths[0] else None)
    ax.axhline(BOUND, color="red", linestyle="--", linewidth=1, label="bound 1.05")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("stream prefill s / push prefill s (pair)")
    ax.set_title("Prefill time, stream over push, alternating pairs")
    ax.legend()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="stream_wait_cpu.py's results file")
    parser.add_argument("--plot", help="PNG to write")
    args = parser.parse_args()
    doc = json.loads(Path(args.json).read_text())
    print("\n".join(table(doc)))
    if args.plot:
        plot(doc, Path(args.plot))


if __name__ == "__main__":
    main()
