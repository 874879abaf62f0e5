"""How much a host's speed drifts by itself: one fixed single-thread matrix product, timed over and over on one core.

A paired comparison of two systems on one host (``scripts/stream_wait_cpu.py``
alternates push and stream requests) cannot resolve a ratio smaller than the
drift between two adjacent runs of the same work. This measures that floor
with nothing of p2pkv running: ``--intervals`` intervals of about
``--seconds`` each, the same float32 ``1024×1024 @ 1024×4096`` products in
each, on core ``--cpu`` with one thread. It prints and writes (``--json``)
each interval's seconds, their coefficient of variation, the standard
deviation of ``ln(b / a)`` over adjacent pairs of intervals, and the pairs a
paired comparison with that spread needs for a 95 % interval of ±2 % and
±5 % (:func:`p2pkv.tools.bench.results.pairs_needed`).

Usage: ``python scripts/host_noise.py --cpu 0 --intervals 40 --seconds 2.5 --json host-noise.json``
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from p2pkv.tools.bench.results import pairs_needed, write_json

MARGINS = (0.02, 0.05)
"""The interval half-widths (ratios) the summary gives the pairs needed for."""


def measure(intervals: int, seconds: float, cpu: int | None) -> list[float]:
    """Seconds of each of ``intervals`` runs of the same matrix products (about ``seconds`` each, the count of
    products fixed by a first timing), on core ``cpu`` (None: where the process runs) with one thread.

    Raises:
        ValueError: ``intervals`` < 2 or ``seconds`` ≤ 0.
    """
    import torch

    if intervals < 2 or seconds <= 0:
        raise ValueError(f"need at least 2 intervals of more than 0 s, not {intervals} of {seconds}")
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=gen)
    b = torch.randn(1024, 4096, generator=gen)
    out = torch.empty(1024, 4096)
    torch.mm(a, b, out=out)  # warm
    start = time.perf_counter()
    torch.mm(a, b, out=out)
    products = max(1, round(seconds / (time.perf_counter() - start)))
    times = []
    for _ in range(intervals):
        start = time.perf_counter()
        for _ in range(products):
            torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    return times


def summary(times: Sequence[float]) -> dict[str, Any]:
    """The spread of ``times`` (seconds of the same work): ``cv`` (standard deviation over mean),
    ``pair_log_sd`` (standard deviation of ``ln(b / a)`` over the adjacent pairs ``(t0, t1), (t2, t3), ..``),
    ``pairs_needed`` (margin → pairs, :data:`MARGINS`).

    Raises:
        ValueError: fewer than 4 times (2 pairs).
    """
    if len(times) < 4:
        raise ValueError(f"need at least 4 times (2 pairs), not {len(times)}")
    logs = [math.log(times[i + 1] / times[i]) for i in range(0, len(times) - 1, 2)]
    sd = statistics.stdev(logs)
    return {"intervals": len(times), "mean_s": statistics.fmean(times), "cv": statistics.stdev(times) /
            statistics.fmean(times), "pair_log_sd": sd,
            "pairs_needed": {f"{m:.0%}": pairs_needed(sd, m) for m in MARGINS}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print the summary, write ``--json``; the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, default=None, help="core to run on (default: where started)")
    parser.add_argument("--intervals", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=2.5, help="about this long per interval")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    times = measure(args.intervals, args.seconds, args.cpu)
    result = {"command": "python scripts/host_noise.py " + " ".join(argv or []), "machine": platform.machine(),
              "cpus": os.cpu_count(), "cpu": args.cpu, "times_s": [round(t, 4) for t in times], **summary(times)}
    print({k: v for k, v in result.items() if k != "times_s"})
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
