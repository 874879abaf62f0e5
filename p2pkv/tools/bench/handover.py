"""Where a disaggregated request's first tokens wait: the handover breakdown of ``p2pkv bench serve``.

For every point the proxy's and the decode engine's ``/metrics`` deltas give
the mean of each phase of a P/D request (ms):

- ``prefill``: the proxy's prefill request round trip (``p2pkv_proxy_prefill_seconds``);
- ``decode_first_byte``: decode request sent → first streamed bytes relayed
  (``p2pkv_proxy_decode_first_byte_seconds``);
- the decode engine's pull phases (p2pkv only, ``p2pkv:pull_phase_seconds``,
  see :data:`p2pkv.telemetry.stats.PULL_PHASES`): ``queue``, ``dispatch``,
  ``post``, ``read``, ``confirm``; in push mode ``post`` ends when the push
  requests are queued and ``read`` lasts until the prefill engine's WRITE
  notifications arrive; NixlConnector exports only its READ time
  (``vllm:nixl_xfer_time_seconds``, shown as ``read``);
- ``decode_ttft``: the decode engine's own TTFT (``vllm:time_to_first_token_seconds``);
- ``proxy``: the proxy's own time per request (``p2pkv_proxy_overhead_seconds``).

vLLM's client gives per request the time to the first and to the second
token; :func:`evaluate` checks them against the handover targets, for every
p2pkv system run. Pure functions on snapshots and
:class:`~p2pkv.tools.bench.serve_results.ServeResult`, plus an optional matplotlib plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from p2pkv.telemetry.stats import PULL_PHASES
from p2pkv.tools.bench import plotting
from p2pkv.tools.bench.serve_metrics import Snapshot, histogram_p50_bound, mean_ms
from p2pkv.tools.bench.serve_results import Handover, Percentiles, PointResult, ServeResult, Target, all_met
from p2pkv.tools.bench.serve_systems import P2PKV_SYSTEMS
from p2pkv.tools.bench.table import grid_lines, number

PROXY_PHASES = {"prefill": "p2pkv_proxy_prefill_seconds",
                "decode_first_byte": "p2pkv_proxy_decode_first_byte_seconds",
                "proxy": "p2pkv_proxy_overhead_seconds"}
"""Proxy phase → its histogram (seconds)."""
PHASE_METRIC = "p2pkv:pull_phase_seconds"
"""The decode engine's per-phase pull histogram, labelled ``phase``."""
NIXL_READ = "vllm:nixl_xfer_time_seconds"
"""NixlConnector's READ time histogram."""
FIRST_TOKENS = "p2pkv_proxy_first_tokens_total"
"""The proxy's count of streaming requests by where their first token came from (``source`` label)."""
DECODE_TTFT = "vllm:time_to_first_token_seconds"
"""vLLM's TTFT histogram on the decode engine (from the request's arrival there)."""

TTFT_VS_AGGREGATED = 1.3
"""p2pkv TTFT p50 ≤ this × the aggregated engine's."""
TTFT_VS_NIXL = 0.5
"""p2pkv TTFT p50 and p99 ≤ this × NixlConnector's."""
SECOND_TOKEN_VS_AGGREGATED = 2.0
"""p2pkv time to the second token p50 ≤ this × the aggregated engine's."""
TPOT_VS_AGGREGATED = 1.2
"""p2pkv TPOT p50 ≤ this × the aggregated engine's."""
READ_P50_MS = 1.0
"""Pull post → done p50 (ms), for pulls up to 1 MiB."""


def second_token_ms(raw: Mapping[str, Any]) -> Percentiles:
    """Each request's time to its second token (TTFT + first ITL, ms) from vLLM's detailed ``bench serve``
    result (``ttfts``, ``itls`` in seconds); all None when not available."""
    ttfts, itls = raw.get("ttfts") or [], raw.get("itls") or []
    return Percentiles.of([1e3 * (t + i[0]) for t, i in zip(ttfts, itls, strict=False) if t and i])


def breakdown(decode: Snapshot | None, proxy: Snapshot | None) -> Handover:
    """The mean of each phase (ms; None where the system does not export it) over one point.

    Args:
        decode / proxy: ``after - before`` of the decode engine's and the proxy's scrapes.

    Returns:
        Each phase's mean, the READ phase's median bucket bound (p2pkv only)
        and the proxy's count of first tokens by source.
    """
    out: dict[str, Any] = {}
    for phase, hist in PROXY_PHASES.items():
        out[phase] = mean_ms(proxy, hist)
    for phase in PULL_PHASES:
        out[phase] = mean_ms(decode, PHASE_METRIC, phase)
    if decode is not None and out["read"] is None:
        out["read"] = mean_ms(decode, NIXL_READ)
    out["decode_ttft"] = mean_ms(decode, DECODE_TTFT)
    bound = histogram_p50_bound(decode.buckets.get(f"{PHASE_METRIC}_bucket|read", {})) if decode else None
    out["read_p50_bound_ms"] = None if bound is None else 1e3 * bound
    for source in ("prefill", "decode"):
        count = proxy.value(f"{FIRST_TOKENS}|{source}") if proxy is not None else None
        out[f"first_token_from_{source}"] = None if count is None else round(count)
    return Handover(**out)


def _check(a: float | None, b: float | None, factor: float) -> dict[str, Any]:
    return {"p2pkv": None if a is None else round(a, 2), "baseline": None if b is None else round(b, 2),
            "limit": None if b is None else round(factor * b, 2),
            "met": None if a is None or b is None else bool(a <= factor * b)}


Checks = Callable[[PointResult, PointResult], dict[str, dict[str, Any]]]
"""A target's comparison of a p2pkv point with its baseline's: metric → :func:`_check`'s verdict."""


def evaluate(result: ServeResult) -> list[Target]:
    """The handover targets for every p2pkv system run; ``measured`` per ``"<system> c=<n>"``."""
    concs = result.config.concurrency
    systems = [s for s in result.systems if s in P2PKV_SYSTEMS]
    specs: list[tuple[str, str, str, Checks]] = [
        ("ttft_vs_aggregated", f"p2pkv TTFT p50 <= {TTFT_VS_AGGREGATED} x aggregated TTFT p50", "aggregated",
         lambda p, b: {"p50": _check(p.ttft_ms.p50, b.ttft_ms.p50, TTFT_VS_AGGREGATED)}),
        ("ttft_vs_nixl", f"p2pkv TTFT p50 and p99 <= {TTFT_VS_NIXL} x NixlConnector's", "nixl",
         lambda p, b: {"p50": _check(p.ttft_ms.p50, b.ttft_ms.p50, TTFT_VS_NIXL),
                       "p99": _check(p.ttft_ms.p99, b.ttft_ms.p99, TTFT_VS_NIXL)}),
        ("second_token_vs_aggregated", f"p2pkv time to the second token p50 <= {SECOND_TOKEN_VS_AGGREGATED} x "
         "aggregated's", "aggregated",
         lambda p, b: {"p50": _check(p.second_token_ms.p50, b.second_token_ms.p50, SECOND_TOKEN_VS_AGGREGATED)}),
        ("tpot_vs_aggregated", f"p2pkv TPOT p50 <= {TPOT_VS_AGGREGATED} x aggregated TPOT p50", "aggregated",
         lambda p, b: {"p50": _check(p.tpot_ms.p50, b.tpot_ms.p50, TPOT_VS_AGGREGATED)}),
    ]
    out = []
    for name, text, base, checks in specs:
        measured, oks = {}, []
        for system in systems:
            for conc in concs:
                p, b = result.point(system, conc), result.point(base, conc)
                if p is None or b is None:
                    oks.append(None)
                    continue
                measured[f"{system} c={conc}"] = checks(p, b)
                oks += [c["met"] for c in measured[f"{system} c={conc}"].values()]
        out.append(Target(name, text, measured, all_met(oks)))
    measured, oks = {}, []
    for system in systems:
        for conc in concs:
            p = result.point(system, conc)
            bound = p.handover.read_p50_bound_ms if p is not None and p.handover is not None else None
            ok = None if bound is None else bool(bound <= READ_P50_MS)
            measured[f"{system} c={conc}"] = {"read_p50_bound_ms": bound, "met": ok}
            oks.append(ok)
    out.append(Target("read_p50", f"pull post -> done p50 <= {READ_P50_MS:g} ms (histogram bucket bound; push: "
                      "the WRITE's notification seen)", measured, all_met(oks)))
    return out


COLUMNS = ("prefill", "decode_first_byte", *PULL_PHASES, "decode_ttft", "proxy")
"""The breakdown table's phase columns, in request order."""


def format_breakdown(result: ServeResult) -> list[str]:
    """Lines of the handover table: per system and concurrency, TTFT and second-token p50 and each phase's mean."""
    header = ["system", "conc", "TTFT p50", "2nd tok p50", *COLUMNS, "1st tok from prefill"]
    rows = []
    for name, sys_result in result.systems.items():
        for p in sys_result.points:
            h = p.handover or Handover()
            rows.append([name, str(p.concurrency), number(p.ttft_ms.p50), number(p.second_token_ms.p50),
                         *(number(h.phase(c), ".2f") for c in COLUMNS), _share(h)])
    return ["handover (ms; phases are means over the point; n/a: not exported by that system):",
            *grid_lines(header, rows)]


def _share(h: Handover) -> str:
    """``"prefill/all"`` first tokens of a point (n/a without the proxy's counter)."""
    early, late = h.first_token_from_prefill, h.first_token_from_decode
    return "n/a" if early is None and late is None else f"{early or 0}/{(early or 0) + (late or 0)}"


STACK = ("prefill", *PULL_PHASES, "decode_rest", "proxy")
"""The plot's stacked segments: prefill round trip, the pull's phases, the rest of the decode leg to its
first byte (``decode_first_byte`` minus the pull phases), the proxy itself."""


def stack_of(h: Handover) -> list[float]:
    """The :data:`STACK` segments (ms) of one point's breakdown ``h`` (missing phases count 0)."""
    pull = sum(h.phase(ph) or 0.0 for ph in PULL_PHASES)
    first_byte = h.decode_first_byte or 0.0
    rest = max(0.0, first_byte - pull) if h.queue is not None else first_byte - (h.read or 0.0)
    return [h.prefill or 0.0, *(h.phase(ph) or 0.0 for ph in PULL_PHASES), max(0.0, rest), h.proxy or 0.0]


def plot(result: ServeResult, path: str | Path) -> bool:
    """Per disaggregated system, stacked bars of the handover phases per concurrency, with the client's
    TTFT p50 and the aggregated engine's; False without matplotlib."""
    plt = plotting.pyplot("p2pkv bench serve", "handover plot")
    if plt is None:
        return False
    systems = [n for n, s in result.systems.items() if n != "aggregated" and s.points]
    if not systems:
        return False
    aggregated = result.systems.get("aggregated")
    agg = {p.concurrency: p.ttft_ms.p50 for p in (aggregated.points if aggregated else [])}
    fig, axes = plt.subplots(1, len(systems), figsize=(5.5 * len(systems), 4.4), squeeze=False)
    for ax, name in zip(axes[0], systems, strict=True):
        points = result.systems[name].points
        labels = [f"c={p.concurrency}" for p in points]
        stacks = [stack_of(p.handover or Handover()) for p in points]
        bottom = [0.0] * len(points)
        for i, seg in enumerate(STACK):
            values = [st[i] for st in stacks]
            ax.bar(labels, values, bottom=bottom, label=seg)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.scatter(labels, [p.ttft_ms.p50 or 0.0 for p in points], color="black", marker="_", s=500,
                   label="TTFT p50 (client)", zorder=3)
        if agg:
            ax.scatter(labels, [agg.get(p.concurrency) or 0.0 for p in points], color="red", marker="_",
                       s=500, label="aggregated TTFT p50", zorder=3)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("ms (phase means)")
        ax.legend(fontsize=6)
    fig.suptitle("where the first token waits (phase means per point)", fontsize=9)
    fig.tight_layout()
    plotting.save(fig, path)
    return True
