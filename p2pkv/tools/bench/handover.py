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

vLLM's detailed client result gives each request's time to its second token
(:func:`second_token_p50_ms`). Pure functions plus an optional matplotlib plot.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from p2pkv.telemetry.stats import PULL_PHASES
from p2pkv.tools.bench import plotting
from p2pkv.tools.bench.serve_metrics import ENGINE_TTFT, Snapshot, mean_ms
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

COLUMNS = ("prefill", "decode_first_byte", *PULL_PHASES, "decode_ttft", "proxy")
"""The breakdown's phases, in request order."""


def second_token_p50_ms(raw: Mapping[str, Any]) -> float | None:
    """Median time to the second token (TTFT + first ITL, ms) over a point's requests, from vLLM's
    detailed result (``ttfts``, ``itls`` in seconds); None without such requests."""
    import numpy as np

    times = [1e3 * (t + i[0]) for t, i in zip(raw.get("ttfts") or [], raw.get("itls") or [], strict=False)
             if t and i]
    return float(np.median(times)) if times else None


def breakdown(decode: Snapshot | None, proxy: Snapshot | None) -> dict[str, Any]:
    """Each phase's mean over a point (ms; None where not exported) and ``first_token_from_prefill`` /
    ``first_token_from_decode`` (the proxy's counts of streaming requests by their first token's source)."""
    out: dict[str, Any] = {phase: mean_ms(proxy, hist) for phase, hist in PROXY_PHASES.items()}
    out.update({phase: mean_ms(decode, PHASE_METRIC, phase) for phase in PULL_PHASES})
    if decode is not None and out["read"] is None:
        out["read"] = mean_ms(decode, NIXL_READ)
    out["decode_ttft"] = mean_ms(decode, ENGINE_TTFT)
    for source in ("prefill", "decode"):
        count = proxy.value(f"{FIRST_TOKENS}|{source}") if proxy is not None else None
        out[f"first_token_from_{source}"] = None if count is None else round(count)
    return out


def format_breakdown(systems: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Lines of the handover table: per system and point, TTFT and second-token p50 and each phase's mean
    (ms), and how many first tokens came from the prefill engine's answer.

    Args:
        systems: system name → its result (``points``: vLLM's result dicts with p2pkv's ``p2pkv`` extras).
    """
    rows = []
    for name, s in systems.items():
        for p in s["points"]:
            h, extra = p["p2pkv"].get("handover") or {}, p["p2pkv"]
            early, late = h.get("first_token_from_prefill"), h.get("first_token_from_decode")
            share = "n/a" if early is None and late is None else f"{early or 0}/{(early or 0) + (late or 0)}"
            rows.append([name, str(p["max_concurrency"]), number(p.get("median_ttft_ms")),
                         number(extra.get("second_token_p50_ms")), *(number(h.get(c), ".2f") for c in COLUMNS),
                         share])
    header = ["system", "conc", "TTFT p50", "2nd tok p50", *COLUMNS, "1st tok from prefill"]
    return ["handover (ms; phases are means over the point; n/a: not exported by that system):",
            *grid_lines(header, rows)]


STACK = ("prefill", *PULL_PHASES, "decode_rest", "proxy")
"""The plot's stacked segments: prefill round trip, the pull's phases, the rest of the decode leg to its
first byte (``decode_first_byte`` minus the pull phases), the proxy itself."""


def stack_of(h: Mapping[str, Any]) -> list[float]:
    """The :data:`STACK` segments (ms) of one point's :func:`breakdown` (missing phases count 0)."""
    pull = sum(h.get(ph) or 0.0 for ph in PULL_PHASES)
    first_byte = h.get("decode_first_byte") or 0.0
    rest = first_byte - pull if h.get("queue") is not None else first_byte - (h.get("read") or 0.0)
    return [h.get("prefill") or 0.0, *(h.get(ph) or 0.0 for ph in PULL_PHASES), max(0.0, rest),
            h.get("proxy") or 0.0]


def plot(systems: Mapping[str, Mapping[str, Any]], path: str | Path) -> bool:
    """Per disaggregated system, stacked bars of the handover phases (ms) per concurrency, with the client's
    TTFT p50 and the aggregated engine's; False without matplotlib or without such a system."""
    pairs = [n for n, s in systems.items() if n != "aggregated" and s["points"]]
    plt = plotting.pyplot("p2pkv bench serve", "handover plot") if pairs else None
    if plt is None:
        return False
    agg = {p["max_concurrency"]: p.get("median_ttft_ms") for p in systems.get("aggregated", {}).get("points", [])}
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.4), squeeze=False)
    for ax, name in zip(axes[0], pairs, strict=True):
        points = systems[name]["points"]
        labels = [f"c={p['max_concurrency']}" for p in points]
        stacks = [stack_of(p["p2pkv"].get("handover") or {}) for p in points]
        bottom = [0.0] * len(points)
        for i, seg in enumerate(STACK):
            values = [st[i] for st in stacks]
            ax.bar(labels, values, bottom=bottom, label=seg)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.scatter(labels, [p.get("median_ttft_ms") or 0.0 for p in points], color="black", marker="_", s=500,
                   label="TTFT p50 (client)", zorder=3)
        if agg:
            ax.scatter(labels, [agg.get(p["max_concurrency"]) or 0.0 for p in points], color="red", marker="_",
                       s=500, label="aggregated TTFT p50", zorder=3)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("ms (phase means)")
        ax.legend(fontsize=6)
    fig.suptitle("where the first token waits (phase means per point)", fontsize=9)
    fig.tight_layout()
    plotting.save(fig, path)
    return True
