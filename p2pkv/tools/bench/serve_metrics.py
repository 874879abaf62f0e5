"""p2pkv's own numbers of a ``p2pkv bench serve`` point, from ``/metrics`` scrapes.

Each engine's and the proxy's ``/metrics`` is scraped before and after a
point; the difference of the two snapshots is what that point added.
The functions here turn the deltas into the plain dicts stored beside
vLLM's own result of the point: the decode engine's transfers (and their
directions), the proxy's own time and the prefill engine's own latency (the
handover breakdown: :mod:`p2pkv.tools.bench.handover`).
Pure functions on the Prometheus text format (no HTTP except :func:`scrape`).
Units: ms (Prometheus' seconds converted), bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

P2PKV_PULL = {"bytes": "p2pkv:pull_bytes_total", "seconds": "p2pkv:pull_seconds",
              "descriptors_sum": "p2pkv:pull_descriptors_sum", "direction": "p2pkv:pulls_by_direction_total"}
"""p2pkv's transfer metrics on the decode engine (:mod:`p2pkv.telemetry.metrics`; ``seconds``: a histogram)."""

NIXL_PULL = {"bytes": "vllm:nixl_bytes_transferred_sum", "seconds": "vllm:nixl_xfer_time_seconds",
             "descriptors_sum": "vllm:nixl_num_descriptors_sum"}
"""vLLM NixlConnector's transfer metrics on the decode engine (vLLM 0.32)."""

KEPT_LABELS = ("phase", "source", "direction", "how")
"""Labels whose values are also kept apart, as ``name|value``."""

PROXY_OVERHEAD = "p2pkv_proxy_overhead_seconds"
"""The proxy's histogram of the time it adds per request (seconds; a point's :func:`latency` of it is stored
as ``proxy``)."""
PROXY_PREFILL = "p2pkv_proxy_prefill_seconds"
"""The proxy's histogram of the prefill request's round trip (seconds)."""
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
"""vLLM's TTFT histogram (arrival at the engine → first token, seconds)."""
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
"""vLLM's histogram of a request's wait to be scheduled (seconds)."""
ENGINE_PREFILL = "vllm:request_prefill_time_seconds"
"""vLLM's histogram of a request's prefill phase (scheduled → first token, seconds)."""
STREAM_TAIL = "p2pkv:stream_tail_seconds"
"""The prefill engine's histogram of each layer stream's wait after its last layer (seconds)."""
STREAMS_LANDED = "p2pkv:streams_landed_total"
"""The prefill engine's count of landed layer streams, by ``how`` (``per_layer`` or ``whole``)."""

@dataclass
class Snapshot:
    """Samples of one scrape, summed over label sets except ``le``.

    Attributes:
        values: name → value (samples without ``le``).
        buckets: histogram ``name_bucket`` → {upper bound: cumulative count}.
    """

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        """The summed value of ``name``, or None when the scrape had no such metric."""
        return self.values.get(name)


def parse_prometheus(text: str) -> Snapshot:
    """Parse the Prometheus text format (with ``prometheus_client``'s parser): samples of one name summed
    over label sets (a label of :data:`KEPT_LABELS` also kept as ``name|value``), buckets per ``le``.

    Raises:
        ValueError: a line that is not the text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for name, labels, value, *_ in family.samples:
            for key in [name, *(f"{name}|{labels[k]}" for k in KEPT_LABELS if k in labels)]:
                if "le" in labels:
                    per_le = snap.buckets.setdefault(key, {})
                    per_le[float(labels["le"])] = per_le.get(float(labels["le"]), 0.0) + value
                else:
                    snap.values[key] = snap.values.get(key, 0.0) + value
    return snap


def scrape(client: Any, base_url: str) -> Snapshot:
    """GET ``base_url/metrics`` with an ``httpx.Client`` and parse it (raises ``httpx.HTTPError``)."""
    resp = client.get(f"{base_url}/metrics")
    resp.raise_for_status()
    return parse_prometheus(resp.text)


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after - before`` for every metric in ``after`` (one new in ``after`` counts from 0)."""
    out = Snapshot({n: v - before.values.get(n, 0.0) for n, v in after.values.items()})
    for name, per_le in after.buckets.items():
        old = before.buckets.get(name, {})
        out.buckets[name] = {le: c - old.get(le, 0.0) for le, c in per_le.items()}
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile (0..1), interpolated inside its bucket as Prometheus' ``histogram_quantile``
    (the last finite bound when it falls in ``+Inf``); None for an empty histogram."""
    total = buckets.get(math.inf, max(buckets.values())) if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        if not math.isinf(le):
            lower, below = le, count
    return lower


def mean_ms(d: Snapshot | None, hist: str, label: str = "") -> float | None:
    """Mean of histogram ``hist`` (seconds; no ``_sum``/``_count`` suffix) in ms, for one kept label value
    or all; None without the histogram, observations or snapshot."""
    tail = f"|{label}" if label else ""
    n = d.value(f"{hist}_count{tail}") if d is not None else None
    return 1e3 * (d.value(f"{hist}_sum{tail}") or 0.0) / n if d is not None and n else None


def latency(d: Snapshot | None, hist: str) -> dict[str, Any] | None:
    """``count``, ``mean_ms`` and bucket-interpolated ``p50_ms``/``p99_ms`` of histogram ``hist``
    (seconds) over a point; None when the scrape lacks it."""
    count = d.value(f"{hist}_count") if d is not None else None
    if d is None or count is None:
        return None
    buckets = d.buckets.get(f"{hist}_bucket", {})
    q = {k: histogram_quantile(buckets, v) for k, v in (("p50_ms", 0.5), ("p99_ms", 0.99))}
    return {"count": round(count), "mean_ms": mean_ms(d, hist),
            **{k: None if v is None else 1e3 * v for k, v in q.items()}}


def transfers(d: Snapshot, names: dict[str, str]) -> dict[str, Any] | None:
    """The decode engine's transfers over a point: ``count``, ``bytes``, ``mean_ms``, ``descriptors_mean``,
    ``directions`` (``{"pull": n, "push": m, "stream": k}``, p2pkv only); None when none of the metrics is exported."""
    count, size = d.value(f"{names['seconds']}_count"), d.value(names["bytes"])
    if count is None and size is None:
        return None
    n, descs = count or 0.0, d.value(names["descriptors_sum"])
    directions = {k: round(v) for k in ("pull", "push", "stream") if (v := d.value(f"{names.get('direction')}|{k}"))}
    return {"count": round(n), "bytes": round(size or 0.0), "mean_ms": mean_ms(d, names["seconds"]),
            "descriptors_mean": descs / n if descs is not None and n else None, "directions": directions}


def prefill_latency(prefill: Snapshot | None, proxy: Snapshot | None) -> dict[str, Any] | None:
    """The prefill engine's own latency over a point: ``legs`` (the proxy's prefill round trips),
    ``engine_ttft`` (:func:`latency` dicts), ``engine_queue_mean_ms``, ``engine_prefill_mean_ms``, and
    ``stream_tail`` (:func:`latency` of its layer streams' waits after the last layer; None for an engine that
    streamed nothing or is not p2pkv's), ``streams`` (its landed streams by how their bytes went: ``per_layer``
    and ``whole`` counts; empty likewise); the engine's figures count ``--prefill-probe``'s requests too. None
    when neither was scraped."""
    if prefill is None and proxy is None:
        return None
    return {"legs": latency(proxy, PROXY_PREFILL), "engine_ttft": latency(prefill, ENGINE_TTFT),
            "engine_queue_mean_ms": mean_ms(prefill, ENGINE_QUEUE),
            "engine_prefill_mean_ms": mean_ms(prefill, ENGINE_PREFILL), "stream_tail": latency(prefill, STREAM_TAIL),
            "streams": {how: round(n) for how in ("per_layer", "whole")
                        if prefill is not None and (n := prefill.value(f"{STREAMS_LANDED}|{how}"))}}
