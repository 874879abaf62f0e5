"""Raw pull statistics a worker collects between two engine steps (no vLLM import).

The payload is a plain dict so vLLM can ship it from the worker to its
logger process; :mod:`p2pkv.telemetry.metrics` turns it into log lines and Prometheus
metrics.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

LIST_KEYS = ("pull_bytes", "pull_seconds", "pull_descriptors", "handshake_seconds", "stream_tail_seconds")
"""Per-event observations: bytes, seconds, descriptors, seconds; on a prefill rank, each layer stream's wait
after its last layer (seconds: :attr:`p2pkv.prefill.layer_stream.StreamCounters.tail_s`)."""
COUNT_KEYS = ("leases_expired", "leases_notified", "push_bytes", "push_agents_unloaded")
"""Plain counts: held prefill requests released by expiry / by notification; bytes this prefill rank WRITE
into decode ranks (push mode), and decode agents it removed from NIXL (idle or broken)."""
DICT_KEYS = ("failures", "transports", "directions", "push_requests", "push_writes", "streams_landed", "kv_checks")
"""Counts by label: failed pulls by kind; peers by ``"<mem_type>:<transport>"`` of their first READ;
finished pulls by direction (``"pull"``/``"push"``); push requests this prefill rank answered, by reply
status (``accepted``, ``busy``, ``refused``, ...); its WRITEs by outcome (``written``/``failed``); its layer
streams that landed whole, by how their bytes went (``per_layer``, or ``whole``: one WRITE after the last layer,
for a prompt under ``stream_min_tokens`` or by the link rule); verified KV's checks of landed parts, by
``"<direction>:<outcome>"`` (``verified``, ``mismatch``, ``missing``: :class:`p2pkv.decode.verify.Check`)."""
PULL_PHASES = ("queue", "dispatch", "post", "read", "confirm")
"""The phases of a decode-side pull, in order (each in seconds, wall clock):

- ``queue``: the request reached the decode engine → the scheduler allocated its blocks;
- ``dispatch``: blocks allocated → the worker took the pull (the next engine step);
- ``post``: taken → every READ posted (handshake, planning, staging wait);
- ``read``: posted → every READ seen done;
- ``confirm``: seen done → the prefill ranks confirmed their holds and the KV is handed to vLLM.

After ``confirm`` vLLM schedules the request's first forward at its next step;
its own ``vllm:time_to_first_token_seconds`` covers the rest.
"""


def empty_stats() -> dict[str, Any]:
    """A fresh payload: empty lists (:data:`LIST_KEYS`), zero counts (:data:`COUNT_KEYS`), empty counts by
    label (:data:`DICT_KEYS`) and no phase durations."""
    return {**{k: [] for k in LIST_KEYS}, **{k: 0 for k in COUNT_KEYS}, **{k: {} for k in DICT_KEYS},
            "phase_seconds": {}}


def is_empty(data: dict[str, Any]) -> bool:
    """True when the payload holds no observation."""
    return not any(data.get(k) for k in (*LIST_KEYS, *COUNT_KEYS, *DICT_KEYS, "phase_seconds"))


def add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    """Add ``counts`` (label → count) into ``into``, label by label; zero counts are left out."""
    for key, n in counts.items():
        if n:
            into[key] = into.get(key, 0) + n


class StatsBuffer:
    """One worker's statistics between two engine steps; writers append to :attr:`data`."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = empty_stats()

    def record_pull(self, num_bytes: int, seconds: float, num_descriptors: int, direction: str = "pull") -> None:
        """One finished pull: bytes moved, seconds from the first READ posted (or push requested) to the last
        seen done, descriptors, and ``direction`` (``"pull"``: READs, ``"push"``: the prefill rank WRITEs)."""
        directions = self.data.setdefault("directions", {})
        directions[direction] = directions.get(direction, 0) + 1
        self.data["pull_bytes"].append(num_bytes)
        self.data["pull_seconds"].append(seconds)
        self.data["pull_descriptors"].append(num_descriptors)

    def record_phases(self, marks: dict[str, float]) -> None:
        """One pull's phase durations from its wall-clock ``marks`` (``arrival``, ``scheduled``,
        ``taken``, ``posted``, ``read``, ``confirmed``; seconds); a phase with a missing end is skipped."""
        order = ("arrival", "scheduled", "taken", "posted", "read", "confirmed")
        phases = self.data["phase_seconds"]
        for phase, (start, end) in zip(PULL_PHASES, itertools.pairwise(order), strict=True):
            if marks.get(start) and marks.get(end):
                phases.setdefault(phase, []).append(max(0.0, marks[end] - marks[start]))

    def record_failure(self, kind: str) -> None:
        """One failed pull of ``kind`` (a :class:`p2pkv.decode.failures.FailureKind` value)."""
        self.data["failures"][kind] = self.data["failures"].get(kind, 0) + 1

    def record_check(self, direction: str, outcome: str) -> None:
        """One landed part checked against its prefill rank's digest (verified KV): its direction and outcome."""
        key = f"{direction}:{outcome}"
        self.data["kv_checks"][key] = self.data["kv_checks"].get(key, 0) + 1

    def record_transport(self, mem_type: str, transport: str) -> None:
        """A peer's first READ: UCX moved ``mem_type`` (``DRAM``/``VRAM``) memory with ``transport``
        (see :class:`p2pkv.dataplane.transport.TransportReport`)."""
        key = f"{mem_type}:{transport}"
        self.data["transports"][key] = self.data["transports"].get(key, 0) + 1

    def record_pushes(self, now: dict[str, Any], before: dict[str, Any]) -> None:
        """This prefill rank's push work between two snapshots of its pusher's cumulative counts
        (:meth:`p2pkv.prefill.pusher.Pusher.snapshot`: ``by_status``, ``written``, ``failed``, ``bytes``,
        ``unloaded``)."""
        old = before.get("by_status", {})
        add_counts(self.data["push_requests"], {k: n - old.get(k, 0) for k, n in now["by_status"].items()})
        add_counts(self.data["push_writes"], {k: now[k] - before.get(k, 0) for k in ("written", "failed")})
        self.data["push_bytes"] += now["bytes"] - before.get("bytes", 0)
        self.data["push_agents_unloaded"] += now["unloaded"] - before.get("unloaded", 0)

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
