"""Prometheus scrapes for ``p2pkv bench serve``: pull statistics and the proxy's overhead.

Each engine's and the proxy's ``/metrics`` is scraped before and after a
benchmark point; the difference of the two snapshots is what that point
added. Pure functions on the Prometheus text format (no HTTP here except
:func:`scrape`). Units: seconds and bytes as Prometheus stores them; the
summaries convert to ms where a key says ``_ms``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from p2pkv.tools.bench.serve_results import Latency, ProxyOverhead, PullStats

P2PKV_PULL = {
    "bytes": "p2pkv:pull_bytes_total",
    "seconds_sum": "p2pkv:pull_seconds_sum",
    "count": "p2pkv:pull_seconds_count",
    "descriptors_sum": "p2pkv:pull_descriptors_sum",
    "direction": "p2pkv:pulls_by_direction_total",
}
"""p2pkv's pull metrics on the decode engine's ``/metrics`` (see :mod:`p2pkv.telemetry.metrics`)."""

NIXL_PULL = {
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "seconds_sum": "vllm:nixl_xfer_time_seconds_sum",
    "count": "vllm:nixl_xfer_time_seconds_count",
    "descriptors_sum": "vllm:nixl_num_descriptors_sum",
}
"""vLLM NixlConnector's transfer metrics on the decode engine's ``/metrics`` (vLLM 0.32)."""

KEPT_LABELS = ("phase", "source", "direction")
"""Labels whose values are kept apart: a pull's ``phase``, the proxy's first-token ``source``, a transfer's
``direction`` (pull or push)."""

DIRECTIONS = ("pull", "push")
"""Values of the ``direction`` label of ``p2pkv:pulls_by_direction_total``."""
PROXY_OVERHEAD = "p2pkv_proxy_overhead_seconds"
"""The proxy's histogram of the time it adds per request (seconds)."""

PROXY_PREFILL = "p2pkv_proxy_prefill_seconds"
"""The proxy's histogram of the prefill request's round trip (seconds)."""

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Snapshot:
    """Metric samples of one scrape, summed over label sets except ``le``.

    Attributes:
        values: ``name`` → value, for samples without an ``le`` label.
        buckets: histogram ``name`` (with ``_bucket``) → {upper bound: cumulative count}.
    """

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        """The summed value of ``name``, or None when the scrape had no such metric."""
        return self.values.get(name)


def parse_prometheus(text: str) -> Snapshot:
    """Parse the Prometheus text exposition format.

    Samples of one name are summed over their label sets (one child per
    engine); histogram buckets are kept per ``le``. A sample with a label of
    :data:`KEPT_LABELS` is also kept under ``name|value`` (e.g. ``name|read``). Comments and malformed lines are
    skipped.
    """
    snap = Snapshot()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        found = dict(_LABEL.findall(labels or ""))
        le = found.get("le")
        keys = [name, *(f"{name}|{found[label]}" for label in KEPT_LABELS if label in found)]
        for key in keys:
            if le is not None:
                bound = math.inf if le == "+Inf" else float(le)
                per_le = snap.buckets.setdefault(key, {})
                per_le[bound] = per_le.get(bound, 0.0) + value
            else:
                snap.values[key] = snap.values.get(key, 0.0) + value
    return snap


def scrape(client: Any, base_url: str) -> Snapshot:
    """GET ``base_url/metrics`` with an ``httpx.Client`` and parse it.

    Raises:
        httpx.HTTPError: the endpoint did not answer or answered an error.
    """
    resp = client.get(f"{base_url}/metrics")
    resp.raise_for_status()
    return parse_prometheus(resp.text)


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after - before`` for every metric in ``after`` (a metric new in ``after`` counts from 0)."""
    out = Snapshot()
    for name, v in after.values.items():
        out.values[name] = v - before.values.get(name, 0.0)
    for name, per_le in after.buckets.items():
        old = before.buckets.get(name, {})
        out.buckets[name] = {le: c - old.get(le, 0.0) for le, c in per_le.items()}
    return out


def histogram_p50_bound(buckets: dict[float, float]) -> float | None:
    """Upper bound of the histogram's median: the smallest ``le`` whose cumulative count reaches half.

    Args:
        buckets: upper bound → cumulative count (as in ``_bucket{le=...}``).

    Returns:
        That bound (the histogram's unit, e.g. seconds), ``inf`` when only
        the ``+Inf`` bucket reaches half, None for an empty histogram.
    """
    if not buckets:
        return None
    total = buckets.get(math.inf, max(buckets.values()))
    if total <= 0:
        return None
    for le in sorted(buckets):
        if buckets[le] >= total / 2:
            return le
    return math.inf


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, interpolated linearly inside its bucket (Prometheus'
    ``histogram_quantile``; the first bucket counts from 0).

    Args:
        buckets: upper bound → cumulative count (as in ``_bucket{le=...}``).

    Returns:
        The estimate (the histogram's unit), the last finite bound when it
        falls in the ``+Inf`` bucket, None for an empty histogram.
    """
    if not buckets:
        return None
    total = buckets.get(math.inf, max(buckets.values()))
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = (le, count) if not math.isinf(le) else (lower, below)
    return lower


def mean_ms(d: Snapshot | None, hist: str, label: str = "") -> float | None:
    """The mean of histogram ``hist`` (seconds, without the ``_count``/``_sum`` suffix) in ms.

    Args:
        d: a snapshot or a delta of two; None (not scraped) gives None.
        hist: the histogram's name.
        label: a kept label's value (:data:`KEPT_LABELS`, e.g. a pull ``phase``); "" for the sum over all.

    Returns:
        ``1e3 * sum / count``; None when the snapshot lacks the histogram or its count is 0.
    """
    if d is None:
        return None
    tail = f"|{label}" if label else ""
    n = d.value(f"{hist}_count{tail}")
    return 1e3 * (d.value(f"{hist}_sum{tail}") or 0.0) / n if n else None


def latency(d: Snapshot, hist: str) -> Latency | None:
    """The latency one point added to histogram ``hist`` (seconds, without the ``_count``/``_sum``/``_bucket``
    suffix) as a :class:`~p2pkv.tools.bench.serve_results.Latency` in ms; None when the scrape lacks it."""
    count = d.value(f"{hist}_count")
    if count is None:
        return None
    buckets = d.buckets.get(f"{hist}_bucket", {})
    p50, p99 = histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)
    return Latency(count=round(count), mean_ms=1e3 * (d.value(f"{hist}_sum") or 0.0) / count if count > 0 else None,
                   p50_ms=None if p50 is None else 1e3 * p50, p99_ms=None if p99 is None else 1e3 * p99)


def pull_stats(d: Snapshot, names: dict[str, str]) -> PullStats | None:
    """Pull statistics of one benchmark point from the decode engine's metric delta.

    Args:
        d: ``after - before`` of the decode engine's scrapes.
        names: :data:`P2PKV_PULL` or :data:`NIXL_PULL`.

    Returns:
        The point's transfers (count, bytes, mean ms, descriptors and
        directions where exported), or None when the engine exports none of
        these metrics.
    """
    if d.value(names["count"]) is None and d.value(names["bytes"]) is None:
        return None
    count = d.value(names["count"]) or 0.0
    seconds = d.value(names["seconds_sum"]) or 0.0
    descs = d.value(names["descriptors_sum"])
    directions = {}
    if "direction" in names:
        for direction in DIRECTIONS:
            n = d.value(f"{names['direction']}|{direction}")
            if n:
                directions[direction] = round(n)
    return PullStats(pulls=round(count), bytes=round(d.value(names["bytes"]) or 0.0), seconds_total=seconds,
                     mean_ms=1e3 * seconds / count if count > 0 else None,
                     descriptors_mean=descs / count if descs is not None and count > 0 else None,
                     directions=directions)


def proxy_overhead(d: Snapshot) -> ProxyOverhead | None:
    """The proxy's added latency over one benchmark point, from its histogram delta.

    Returns:
        Requests, the median's bucket bound and the mean of the time the
        proxy adds, and the prefill request's mean round trip (from
        ``p2pkv_proxy_prefill_seconds``); None without the overhead histogram.
    """
    count = d.value(f"{PROXY_OVERHEAD}_count")
    if count is None:
        return None
    total = d.value(f"{PROXY_OVERHEAD}_sum") or 0.0
    bound = histogram_p50_bound(d.buckets.get(f"{PROXY_OVERHEAD}_bucket", {}))
    prefill_n = d.value(f"{PROXY_PREFILL}_count") or 0.0
    return ProxyOverhead(
        requests=round(count),
        p50_bound_ms=None if bound is None or math.isinf(bound) else 1e3 * bound,
        mean_ms=1e3 * total / count if count > 0 else None,
        prefill_mean_ms=1e3 * (d.value(f"{PROXY_PREFILL}_sum") or 0.0) / prefill_n if prefill_n > 0 else None)
