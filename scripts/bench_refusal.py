#!/usr/bin/env python3
"""What refusing forged ``kv_transfer_params`` costs a decode engine's EngineCore (docs/benchmarks/refusal-cpu.md).

Builds a real ``DecodeScheduling`` (p2pkv/scheduling/load_scheduling.py: the decode
half of the connector's scheduler side, which runs in vLLM's EngineCore
process) per ``max_model_len`` (blocks of ``--block-size`` tokens, one KV
cache group, a side-channel secret) and times its first
``get_num_new_matched_tokens`` for one vLLM ``Request`` (the call that parses
and checks the params; vLLM's scheduler makes it for every waiting request)
with, as ``kv_transfer_params``:

* ``forged-far-*``: a forged capability ``v1.9999999999.<64 hex>`` (the
  security review's case) over worst-case block id lists: 64 KV cache groups
  of ``max_blocks`` ids each (``64g``), one group of ``max_blocks`` ids (``1g``);
* ``forged-near-*``: the same with a plausible expiry (60 s ahead), which
  passes any expiry check: ``64g``; one group of ints (``1g-int``: ids of 17
  bits, 5 msgpack bytes each, the longest valid ids), of ints past 2**63
  (``1g-bigint``), of floats (``1g-float``);
* ``expired-64g``: a capability that expired an hour ago, 64 groups;
* ``honest-1g``: params the prefill engine signed for a prompt of
  ``max_model_len`` tokens (``max_blocks`` ids and the prompt's digest): what
  an honest request pays, for comparison.

Each sample is one call (``time.perf_counter_ns``), the request's params
restored between calls (untimed); median and p99 over ``--reps`` samples
(fewer where one call is slow: at most ``--budget-s`` per case, at least
30). The refusal's log line is formatted and written to ``/dev/null``, as an
engine writes it to its log. Which tree's ``p2pkv`` was measured is recorded
(``p2pkv_file``): run it with ``PYTHONPATH=<other checkout>`` to measure that
one. ``--compare BEFORE.json`` prints a before/after table in Markdown and keeps
that run in the JSON written (``before``).

    PYTHONPATH=. python scripts/bench_refusal.py --json docs/benchmarks/refusal-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import secrets
import sys
import time
from typing import Any

LENGTHS = (4096, 16384, 32768, 131072)
"""``max_model_len`` values measured (tokens)."""
TARGET_US = 100.0
"""Target: a forged capability costs at most this (µs) at any context length."""
SECRET = secrets.token_bytes(32)
FAR, NEAR_S, EXPIRED_S = 9_999_999_999, 60, 3600
CASES = ("forged-far-64g", "forged-far-1g", "forged-near-64g", "forged-near-1g-int", "forged-near-1g-bigint",
         "forged-near-1g-float", "expired-64g", "honest-1g")


class LastLine(logging.Handler):
    """Formats each record and writes it to ``/dev/null`` (an engine's log), keeping the last line."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        self.sink = open(os.devnull, "w")  # noqa: SIM115 (closed by close())
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = self.format(record)
        self.sink.write(self.last + "\n")

    def close(self) -> None:
        self.sink.close()
        super().close()


def case_params(case: str, max_model_len: int, block_size: int, prompt: list[int], now: float) -> dict[str, Any]:
    """The ``kv_transfer_params`` of ``case`` for an engine of ``max_model_len`` tokens (see the module's list).

    Raises:
        ValueError: an unknown case.
    """
    from p2pkv.params import CAPABILITY_KEY, make_prefill_response_params
    from p2pkv.prompt_digest import prompt_digest

    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")
    max_blocks = -(-max_model_len // block_size)
    params = make_prefill_response_params(
        engine_id="bench-prefill", request_id="prefill-0", host="127.0.0.1", port=5600,
        block_ids=list(range(1, max_blocks + 1)), tp_size=1, num_tokens=max_model_len, expiry_time=now + 120,
        prompt_digest=prompt_digest(prompt), secret=SECRET)
    if case == "honest-1g":
        return params
    if case.endswith("bigint"):
        ids: list[Any] = [2**64 - 1 - i for i in range(max_blocks)]
    elif case.endswith("float"):
        ids = [float(65536 + i) for i in range(max_blocks)]
    else:
        ids = [65536 + i for i in range(max_blocks)]
    params["remote_block_ids"] = [list(ids) for _ in range(64)] if case.endswith("64g") else [ids]
    when = case.split("-")[0 if case.startswith("expired") else 1]
    expiry = {"far": FAR, "near": int(now) + NEAR_S, "expired": int(now) - EXPIRED_S}[when]
    params[CAPABILITY_KEY] = f"v1.{expiry}.{secrets.token_hex(32)}"
    return params


def run_case(case: str, max_model_len: int, block_size: int, reps: int, budget_s: float,
             log: LastLine) -> dict[str, Any]:
    """One case at one ``max_model_len``: ``us`` (p50/p90/p99/mean/min/max µs per call), the samples' count,
    the outcome (``loaded_tokens``, or the refusal's log line) and the MAC input's size."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from p2pkv.config import P2pKvConfig
    from p2pkv.scheduling.load_scheduling import DecodeScheduling
    from p2pkv.tools.bench.results import summarize

    max_blocks = -(-max_model_len // block_size)
    prompt = [(7 * i) % 32000 for i in range(max_model_len)]
    template = case_params(case, max_model_len, block_size, prompt, time.time())
    sched = DecodeScheduling("bench-decode", P2pKvConfig(), block_size, SECRET, recompute_tokens=0, kv_groups=1,
                             max_blocks=max_blocks, tracing=False)
    req = Request("decode-0", prompt, SamplingParams(max_tokens=1), None)
    outcome: list[Any] = []

    def once() -> int:
        req.kv_transfer_params = dict(template)
        sched._loads.clear()
        log.last = ""
        t0 = time.perf_counter_ns()
        count, _ = sched.get_num_new_matched_tokens(req, 0)
        dt = time.perf_counter_ns() - t0
        outcome[:] = [count, log.last]
        return dt

    try:
        gc.collect()
        first = [once() for _ in range(3)]
        n = max(30, min(reps, int(budget_s * 1e9 / max(1, min(first)))))
        samples = [once() for _ in range(n)]
    finally:
        sched.shutdown()
    count, line = outcome
    return {"case": case, "max_model_len": max_model_len, "max_blocks": max_blocks,
            "ids": sum(len(g) for g in template["remote_block_ids"]), "samples": n, "us": summarize(samples, 1e-3),
            "loaded_tokens": count, "refused": line.split("] ", 1)[-1][:300] if line else ""}


def run(lengths: tuple[int, ...], cases: tuple[str, ...], block_size: int, reps: int, budget_s: float,
        quiet: bool) -> dict[str, Any]:
    """Every case at every length; a JSON-able dict with the command, the machine and the tree measured."""
    import vllm

    import p2pkv
    from p2pkv.tools.bench.machine import command_line, machine_info

    log = LastLine()
    logger = logging.getLogger("p2pkv")
    logger.addHandler(log)
    logger.propagate = False
    results = []
    try:
        for length in lengths:
            for case in cases:
                if not quiet:
                    print(f"[refusal] {length} tokens: {case} ...", file=sys.stderr, flush=True)
                results.append(run_case(case, length, block_size, reps, budget_s, log))
    finally:
        logger.removeHandler(log)
        log.close()
    machine = machine_info()
    machine["versions"]["vllm"] = vllm.__version__
    machine["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return {"bench": "refusal", "command": command_line(sys.argv), "machine": machine,
            "p2pkv_file": p2pkv.__file__, "pythonpath": os.environ.get("PYTHONPATH", ""),
            "config": {"block_size": block_size, "kv_groups": 1, "reps": reps, "budget_s": budget_s,
                       "gc_enabled": gc.isenabled(),
                       "hook": "DecodeScheduling.get_num_new_matched_tokens (first call)"},
            "target": {"forged_us_at_most": TARGET_US,
                       "met": {f"{r['case']}/{r['max_model_len']}": r["us"]["p50"] <= TARGET_US for r in results
                               if not r["case"].startswith("honest")}},
            "cases": results}


def _cell(us: float) -> str:
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def format_table(result: dict[str, Any]) -> str:
    """µs per call (median / p99) by case and ``max_model_len``."""
    from p2pkv.tools.bench.table import grid_lines

    lengths = sorted({r["max_model_len"] for r in result["cases"]})
    by = {(r["case"], r["max_model_len"]): r for r in result["cases"]}
    cases = [c for c in CASES if any((c, n) in by for n in lengths)]
    lines = grid_lines(["case", *(f"{n // 1024}k p50/p99 us" for n in lengths)],
                       [[c, *(f"{_cell(by[c, n]['us']['p50'])}/{_cell(by[c, n]['us']['p99'])}" if (c, n) in by
                              else "-" for n in lengths)] for c in cases])
    m = result["machine"]
    lines.append(f"{m.get('cpu_model')}, {m.get('usable_cpus')} cores, load {m.get('loadavg')}; "
                 f"p2pkv from {result['p2pkv_file']}")
    return "\n".join(lines)


def compare_markdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A Markdown table: median µs per call before → after, by case and ``max_model_len`` (p99 in brackets)."""
    lengths = sorted({r["max_model_len"] for r in after["cases"]})
    old = {(r["case"], r["max_model_len"]): r["us"] for r in before["cases"]}
    new = {(r["case"], r["max_model_len"]): r["us"] for r in after["cases"]}
    head = "| case | " + " | ".join(f"{n // 1024}k: before → after" for n in lengths) + " |"
    rows = [head, "|---|" + "---|" * len(lengths)]
    for case in CASES:
        cells = []
        for n in lengths:
            b, a = old.get((case, n)), new.get((case, n))
            cells.append(" → ".join(f"{_cell(x['p50'])} ({_cell(x['p99'])})" if x else "-" for x in (b, a)))
        rows.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run, print the table; ``--compare``: the Markdown table too; write ``--json``. Exit code 2
    on a bad option."""
    from p2pkv.tools.bench.results import write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="max_model_len values (tokens)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated among {', '.join(CASES)}")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--reps", type=int, default=2000, help="samples per case (at most)")
    p.add_argument("--budget-s", type=float, default=2.0, help="seconds of samples per case (at most; >= 30 samples)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--compare", metavar="BEFORE_JSON",
                   help="also print a before/after Markdown table; the JSON written keeps that run as 'before'")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    try:
        lengths = tuple(int(n) for n in a.lengths.split(",") if n.strip())
        cases = tuple(c.strip() for c in a.cases.split(",") if c.strip())
        if unknown := sorted(set(cases) - set(CASES)):
            raise ValueError(f"unknown cases {unknown}; known: {', '.join(CASES)}")
        if a.block_size < 1 or any(n < a.block_size for n in lengths) or a.reps < 30 or not math.isfinite(a.budget_s):
            raise ValueError("need --block-size >= 1, lengths >= the block size, --reps >= 30, a finite --budget-s")
    except ValueError as exc:
        print(f"bench_refusal: {exc}", file=sys.stderr)
        return 2
    result = run(lengths, cases, a.block_size, a.reps, a.budget_s, a.quiet)
    print(format_table(result))
    if a.compare:
        with open(a.compare, encoding="utf-8") as f:
            result["before"] = json.load(f)
        print("\n" + compare_markdown(result["before"], result))
    if a.json:
        write_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
