"""Raw pull statistics a worker collects between two engine steps (no vLLM import).

The payload is a plain dict so vLLM can ship it from the worker to its
logger process; :mod:`p2pkv.metrics` turns it into log lines and Prometheus
metrics.
"""

from __future__ import annotations

from typing import Any

LIST_KEYS = ("pull_bytes", "pull_seconds", "pull_descriptors", "handshake_seconds")
"""Per-event observations: bytes, seconds, descriptors, seconds."""
COUNT_KEYS = ("leases_expired", "leases_notified")
"""Plain counts of held prefill requests released by expiry / by notification."""


def empty_stats() -> dict[str, Any]:
    """A fresh payload: empty lists, zero counts, no failures (kind → count)."""
    return {**{k: [] for k in LIST_KEYS}, **{k: 0 for k in COUNT_KEYS}, "failures": {}}


def is_empty(data: dict[str, Any]) -> bool:
    """True when the payload holds no observation."""
    return not any(data.get(k) for k in (*LIST_KEYS, *COUNT_KEYS, "failures"))
