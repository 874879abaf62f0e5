"""What remembering bound stream ids and capabilities costs, at 10 and at a million entries.

An engine binds every grant's stream id (and a decode engine every capability) to the one request it serves
until it expires (:class:`p2pkv.bindings.Bindings`), and a prefill rank keeps the stream ids it served
(:class:`p2pkv.prefill.stream_ledger.StreamLedger`). Both are checked on every request; expiring was once a
scan of every entry under the side channel's lock (31 ms per stream request at a million ids). This measures,
at each size, one ``bind`` (with its expiry pass) and one served stream id's ``refuse`` + ``serve`` +
``forget_expired``, each with one entry expiring per operation (a steady state), in microseconds.

    python scripts/bench_bindings.py --sizes 10 1000 100000 1000000 --json docs/benchmarks/bindings-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time

from p2pkv.bindings import Bindings
from p2pkv.prefill.stream_ledger import StreamLedger
from p2pkv.tools.bench.machine import command_line, machine_info
from p2pkv.tools.bench.results import summarize, write_json
from p2pkv.tools.bench.table import grid


def bind_costs(size: int, ops: int) -> list[float]:
    """Seconds per :meth:`Bindings.bind` with ``size`` ids kept, one expiring per call."""
    bound = Bindings("stream id", max_entries=size + ops + 1)
    for i in range(size):
        bound.bind(f"{i:032x}", f"r-{i}", expiry=float(i), now=0.0)
    out = []
    for j in range(ops):
        key, now = f"{size + j:032x}", float(j) + 0.5  # id j expires now; the new one lasts as long
        start = time.perf_counter()
        bound.bind(key, "r", expiry=float(size + j), now=now)
        out.append(time.perf_counter() - start)
    assert len(bound) == size, len(bound)
    return out


def ledger_costs(size: int, ops: int) -> list[float]:
    """Seconds per stream request's ledger work (``forget_expired`` + ``refuse`` + ``serve``) with ``size``
    served ids kept, one expiring per request."""
    ledger = StreamLedger(time.monotonic, max_served=size + ops + 1)
    rank = ("decode-engine", 0)
    for i in range(size):
        ledger.serve(f"{i:032x}", float(i), rank)
    out = []
    for j in range(ops):
        key, now = f"{size + j:032x}", float(j) + 60.5  # past EXPIRED_KEEP_S of id j
        start = time.perf_counter()
        ledger.forget_expired(now)
        ledger.refuse(key, rank, 1)
        ledger.serve(key, float(size + j), rank)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 100_000, 1_000_000])
    parser.add_argument("--ops", type=int, default=20_000, help="operations timed per size")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    rows, results = [], []
    for size in args.sizes:
        bind = summarize(bind_costs(size, args.ops), 1e6)
        ledger = summarize(ledger_costs(size, args.ops), 1e6)
        results.append({"size": size, "bind_us": bind, "ledger_us": ledger})
        rows.append([f"{size:,}", f"{bind['p50']:.2f}", f"{bind['p99']:.2f}", f"{ledger['p50']:.2f}",
                     f"{ledger['p99']:.2f}"])
    print(grid(["entries", "bind p50 µs", "bind p99 µs", "ledger p50 µs", "ledger p99 µs"], rows))
    if args.json:
        write_json({"command": command_line(sys.argv), "machine": machine_info(), "ops": args.ops,
                    "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
