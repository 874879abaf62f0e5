"""Raw pull statistics a worker collects between two engine steps (no vLLM import).

The payload is a plain dict so vLLM can ship it from the worker to its
logger process; :mod:`p2pkv.telemetry.metrics` turns it into log lines and Prometheus
metrics.
"""

from __future__ import annotations

import json
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


class StatsBuffer:
    """One worker's statistics between two engine steps; writers append to :attr:`data`."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = empty_stats()

    def record_pull(self, num_bytes: int, seconds: float, num_descriptors: int) -> None:
        """One finished pull: bytes moved, seconds from the first READ posted to the last seen done, descriptors."""
        self.data["pull_bytes"].append(num_bytes)
        self.data["pull_seconds"].append(seconds)
        self.data["pull_descriptors"].append(num_descriptors)

    def record_failure(self, kind: str) -> None:
        """One failed pull of ``kind`` (a :class:`p2pkv.decode.failures.FailureKind` value)."""
        self.data["failures"][kind] = self.data["failures"].get(kind, 0) + 1

    def take(self) -> dict[str, Any] | None:
        """The payload since the last call (None when empty); starts a fresh one."""
        if is_empty(self.data):
            return None
        data, self.data = self.data, empty_stats()
        return data


def append_json_line(path: str, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to the file at ``path`` (the ``stats_file`` setting)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
