"""Comparisons within one ``p2pkv bench serve`` run: ratios against baselines, and the targets.

Every ratio divides two systems measured in the same run (same prompts,
same machine, minutes apart; the p2pkv systems on the very same engines):

- ``p2pkv-push / p2pkv-pull`` (and ``p2pkv / p2pkv-pull``): what pushing changes;
- every p2pkv system ``/ nixl``: against vLLM's NixlConnector.

The targets (:func:`evaluate_targets`) are checked for every p2pkv system
run; :data:`PREFILL_SLOWDOWN_LIMIT` is the push-mode one: the prefill engine
is not slowed by pushing. Units: ms, requests/s, output tokens/s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from p2pkv.tools.bench.serve_results import PointResult, Ratio, ServeResult, Target, all_met
from p2pkv.tools.bench.serve_systems import P2PKV_SYSTEMS, PUSH_BASELINE, SYSTEM_SPECS

TTFT_SLACK = 1.10
"""p2pkv's TTFT p50 may exceed the aggregated engine's plus the mean pull time by this factor."""

PROXY_P50_LIMIT_MS = 2.0
"""Target for the proxy's own added latency, median per request (ms)."""

PREFILL_SLOWDOWN_LIMIT = 1.10
"""While it pushes, the prefill engine's own latencies may be at most this times what they are while the
same engines pull (:data:`~p2pkv.tools.bench.serve_systems.PUSH_BASELINE`) at the same concurrency."""


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b not in (None, 0) else None


def baselines(systems: Sequence[str]) -> list[tuple[str, str]]:
    """``(system, baseline)`` pairs to divide, of the systems run: push (and auto) against pull on the same
    engines first, then every p2pkv system against NixlConnector."""
    pairs = [(s, PUSH_BASELINE) for s in ("p2pkv-push", "p2pkv") if s in systems and PUSH_BASELINE in systems]
    if "nixl" in systems:
        pairs += [(s, "nixl") for s in systems if s in P2PKV_SYSTEMS]
    return pairs


def _prefill(p: PointResult) -> tuple[float | None, float | None, float | None, float | None]:
    """A point's prefill legs' mean, prefill engine TTFT mean, probe TTFT p50, probe TPOT p50 (ms)."""
    pre = p.prefill
    if pre is None:
        return None, None, None, None
    probe = pre.probe
    return (pre.legs.mean_ms if pre.legs else None, pre.engine_ttft.mean_ms if pre.engine_ttft else None,
            probe.ttft_ms.p50 if probe else None, probe.tpot_ms.p50 if probe else None)


def ratios(result: ServeResult) -> list[Ratio]:
    """``system / baseline`` at every concurrency both ran, for the pairs of :func:`baselines`."""
    out = []
    for system, base in baselines(list(result.systems)):
        for conc in result.config.concurrency:
            p, b = result.point(system, conc), result.point(base, conc)
            if p is None or b is None:
                continue
            pp, bp = _prefill(p), _prefill(b)
            out.append(Ratio(system=system, baseline=base, concurrency=conc,
                             ttft_p50=ratio(p.ttft_ms.p50, b.ttft_ms.p50), ttft_p99=ratio(p.ttft_ms.p99, b.ttft_ms.p99),
                             tpot_p50=ratio(p.tpot_ms.p50, b.tpot_ms.p50),
                             request_throughput=ratio(p.request_throughput, b.request_throughput),
                             output_throughput=ratio(p.output_throughput, b.output_throughput),
                             prefill_legs_mean=ratio(pp[0], bp[0]), prefill_engine_ttft_mean=ratio(pp[1], bp[1]),
                             probe_ttft_p50=ratio(pp[2], bp[2]), probe_tpot_p50=ratio(pp[3], bp[3])))
    return out


def _each(result: ServeResult, systems: Sequence[str],
          measure: Callable[[PointResult, int], dict[str, object] | None]) -> tuple[dict[str, object], list]:
    """``measure(point, concurrency)`` for every point of ``systems``; its ``met`` entries (bools, or dicts
    with a ``met``) are collected. A None from ``measure`` counts as not measured."""
    measured: dict[str, object] = {}
    oks: list[bool | None] = []
    for system in systems:
        for conc in result.config.concurrency:
            p = result.point(system, conc)
            entry = measure(p, conc) if p is not None else None
            if entry is None:
                oks.append(None)
                continue
            measured[f"{system} c={conc}"] = entry
            if "met" in entry:
                oks.append(entry["met"])  # type: ignore[arg-type]
            else:
                oks += [v["met"] for v in entry.values() if isinstance(v, dict)]
    return measured, oks


def _vs_nixl(result: ServeResult) -> Callable[[PointResult, int], dict[str, object] | None]:
    def measure(p: PointResult, conc: int) -> dict[str, object] | None:
        n = result.point("nixl", conc)
        if n is None:
            return None
        out: dict[str, object] = {}
        for key, a, b, how in (("ttft_p50", p.ttft_ms.p50, n.ttft_ms.p50, "le"),
                               ("ttft_p99", p.ttft_ms.p99, n.ttft_ms.p99, "le"),
                               ("output_throughput", p.output_throughput, n.output_throughput, "ge")):
            ok = None if a is None or b is None else bool(a <= b if how == "le" else a >= b)
            out[key] = {"p2pkv": a, "nixl": b, "met": ok}
        return out
    return measure


def _vs_aggregated(result: ServeResult) -> Callable[[PointResult, int], dict[str, object] | None]:
    def measure(p: PointResult, conc: int) -> dict[str, object] | None:
        a = result.point("aggregated", conc)
        pull_ms = p.pull.mean_ms if p.pull else None
        if a is None or p.ttft_ms.p50 is None or a.ttft_ms.p50 is None or pull_ms is None:
            return None
        limit = (a.ttft_ms.p50 + pull_ms) * TTFT_SLACK
        return {"p2pkv_ttft_p50_ms": p.ttft_ms.p50, "aggregated_ttft_p50_ms": a.ttft_ms.p50,
                "pull_mean_ms": pull_ms, "limit_ms": limit, "met": bool(p.ttft_ms.p50 <= limit)}
    return measure


def _proxy(p: PointResult, conc: int) -> dict[str, object]:
    ov = p.proxy_overhead
    bound = ov.p50_bound_ms if ov else None
    return {"p50_bound_ms": bound, "mean_ms": ov.mean_ms if ov else None,
            "met": None if bound is None else bool(bound <= PROXY_P50_LIMIT_MS)}


def _not_slowed(result: ServeResult) -> Callable[[PointResult, int], dict[str, object] | None]:
    def measure(p: PointResult, conc: int) -> dict[str, object] | None:
        b = result.point(PUSH_BASELINE, conc)
        if b is None:
            return None
        out: dict[str, object] = {}
        names = ("prefill_legs_mean_ms", "prefill_engine_ttft_mean_ms", "probe_ttft_p50_ms", "probe_tpot_p50_ms")
        for name, a, base in zip(names, _prefill(p), _prefill(b), strict=True):
            if name.startswith("probe") and a is None and base is None:
                continue  # no probe in this run
            limit = None if base is None else base * PREFILL_SLOWDOWN_LIMIT
            out[name] = {"push": a, "pull": base, "limit": limit,
                         "met": None if a is None or limit is None else bool(a <= limit)}
        return out
    return measure


def evaluate_targets(result: ServeResult) -> list[Target]:
    """Check the measured numbers against the targets (each p2pkv system run); ``measured`` per
    ``"<system> c=<n>"``, ``met`` None where a system a target needs was not run or a number is missing."""
    p2pkv = [s for s in result.systems if s in P2PKV_SYSTEMS]
    pairs = [s for s in result.systems if SYSTEM_SPECS[s].disaggregated]
    out = []
    for name, text, systems, measure in (
            ("p2pkv_vs_nixl", "p2pkv TTFT p50 and p99 <= NixlConnector's and output tok/s >= NixlConnector's at "
             "every concurrency", p2pkv, _vs_nixl(result)),
            ("p2pkv_ttft_vs_aggregated", f"p2pkv TTFT p50 <= (aggregated TTFT p50 + mean pull time) x "
             f"{TTFT_SLACK:.2f}", p2pkv, _vs_aggregated(result)),
            ("proxy_overhead_p50", f"proxy's own latency per request, p50 < {PROXY_P50_LIMIT_MS:g} ms (histogram "
             "bucket bound)", pairs, _proxy),
            ("push_prefill_not_slowed", f"while it pushes, the prefill engine's own latency <= "
             f"{PREFILL_SLOWDOWN_LIMIT:.2f} x while the same engines pull ({PUSH_BASELINE}): prefill legs' mean "
             "round trip, its mean TTFT, and with --prefill-probe its own requests' TTFT and TPOT p50",
             [s for s in ("p2pkv-push",) if s in result.systems], _not_slowed(result))):
        measured, oks = _each(result, systems, measure)
        out.append(Target(name, text, measured, all_met(oks)))
    return out
