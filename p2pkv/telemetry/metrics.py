"""Pull statistics through vLLM's connector stats, onto the engine's ``/metrics``.

Each worker collects raw observations (:meth:`p2pkv.worker.WorkerSide.take_stats`);
vLLM ships them to its logger process as :class:`P2pKvStats`, aggregates them
over an interval (the periodic "KV Transfer metrics" log line) and hands them
to :class:`P2pKvPromMetrics`, which records them as Prometheus metrics on the
engine's ``/metrics``:

- ``p2pkv:pull_bytes_total`` / ``p2pkv:pulls_total`` (counters),
- ``p2pkv:pull_seconds``, ``p2pkv:pull_descriptors``, ``p2pkv:handshake_seconds`` (histograms),
- ``p2pkv:pull_phase_seconds{phase=...}`` (histogram; phases in
  :data:`p2pkv.telemetry.stats.PULL_PHASES`),
- ``p2pkv:pull_failures_total{kind=...}``, ``p2pkv:leases_expired_total``,
  ``p2pkv:leases_notified_total`` (counters),
- ``p2pkv:peer_transport_total{mem_type=...,transport=...}`` (counter: peers
  whose first READ UCX moved with that transport, e.g. ``DRAM``/``cma``,
  ``VRAM``/``cuda_ipc``, ``VRAM``/``tcp``; see :mod:`p2pkv.dataplane.transport`),
- ``p2pkv:pulls_by_direction_total{direction=pull|push|stream}`` (counter:
  completed pulls whose bytes the decode engine READ, the prefill engine
  WROTE after its prefill, or WROTE layer by layer during it;
  :mod:`p2pkv.decode.direction`),
- on a prefill engine in push mode (:mod:`p2pkv.prefill.pusher`):
  ``p2pkv:push_requests_total{status=...}`` (push requests answered, by reply
  status), ``p2pkv:push_writes_total{outcome=written|failed}``,
  ``p2pkv:push_bytes_total`` and ``p2pkv:push_agents_unloaded_total``
  (decode agents removed from NIXL: idle, or a WRITE to them failed),
- on a prefill engine in stream mode (:mod:`p2pkv.prefill.prefill_streams`):
  ``p2pkv:stream_tail_seconds`` (histogram: each stream that landed whole,
  from its last layer computed to the decode rank told: the wait after the
  last layer streaming adds to the first token) and
  ``p2pkv:streams_landed_total{how=per_layer|whole}`` (counter: those
  streams by how their bytes went: a WRITE per layer, or one WRITE after the
  last layer, for a short prompt or by the link rule of
  :mod:`p2pkv.prefill.stream_measures`),
- on a decode engine with ``verify_kv``: ``p2pkv:kv_checks_total{direction=...,outcome=verified|mismatch|missing}``
  (counter: landed parts checked against the prefill engine's digest; :mod:`p2pkv.decode.verify`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from p2pkv.telemetry.stats import COUNT_KEYS, DICT_KEYS, LIST_KEYS, add_counts, empty_stats, is_empty


class P2pKvStats(KVConnectorStats):
    """p2pkv's connector stats: lists of per-pull observations plus counters."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty_stats()

    def reset(self) -> None:
        self.data = empty_stats()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in LIST_KEYS:
            self.data[key] = list(self.data.get(key, [])) + list(other.data.get(key, []))
        for key in COUNT_KEYS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        for key in DICT_KEYS:
            counts = dict(self.data.get(key, {}))
            add_counts(counts, other.data.get(key, {}))
            self.data[key] = counts
        phases = {k: list(v) for k, v in self.data.get("phase_seconds", {}).items()}
        for phase, values in other.data.get("phase_seconds", {}).items():
            phases[phase] = phases.get(phase, []) + list(values)
        self.data["phase_seconds"] = phases
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data.get("pull_seconds", []))
        nbytes = sum(self.data.get("pull_bytes", []))
        return {
            "pulls": len(seconds),
            "pulled_MiB": round(nbytes / 2**20, 3),
            "avg_pull_ms": round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
            "p90_pull_ms": round(1e3 * seconds[int(0.9 * (len(seconds) - 1))], 3) if seconds else 0.0,
            "GB_per_s": round(nbytes / sum(seconds) / 1e9, 3) if seconds and sum(seconds) > 0 else 0.0,
            "failures": sum(self.data.get("failures", {}).values()),
            "leases_expired": self.data.get("leases_expired", 0),
        }

    def is_empty(self) -> bool:
        return is_empty(self.data)


class P2pKvPromMetrics(KVConnectorPromMetrics):
    """Registers and records p2pkv's Prometheus metrics, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.pull_bytes = per_engine(self._counter_cls(
            name="p2pkv:pull_bytes", documentation="KV bytes pulled by this engine", labelnames=labelnames))
        self.pulls = per_engine(self._counter_cls(
            name="p2pkv:pulls", documentation="Completed KV pulls", labelnames=labelnames))
        self.pull_seconds = per_engine(self._histogram_cls(
            name="p2pkv:pull_seconds", documentation="Duration of one KV pull (NIXL READ), seconds",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames))
        self.pull_descriptors = per_engine(self._histogram_cls(
            name="p2pkv:pull_descriptors", documentation="NIXL descriptors per KV pull",
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384], labelnames=labelnames))
        self.handshake_seconds = per_engine(self._histogram_cls(
            name="p2pkv:handshake_seconds", documentation="Side-channel handshake + NIXL peer setup, seconds",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0], labelnames=labelnames))
        self.leases_expired = per_engine(self._counter_cls(
            name="p2pkv:leases_expired", documentation="Held prefill requests released by lease expiry",
            labelnames=labelnames))
        self.leases_notified = per_engine(self._counter_cls(
            name="p2pkv:leases_notified", documentation="Held prefill requests released by a decode notification",
            labelnames=labelnames))
        self.phase_seconds = self._histogram_cls(
            name="p2pkv:pull_phase_seconds", documentation="Phases of a KV pull, from the request's arrival "
            "to the KV handed to vLLM (queue, dispatch, post, read, confirm), seconds",
            buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
            labelnames=[*labelnames, "phase"])
        self.failures = self._counter_cls(
            name="p2pkv:pull_failures", documentation="Failed KV pulls by failure kind",
            labelnames=[*labelnames, "kind"])
        self.transports = self._counter_cls(
            name="p2pkv:peer_transport", documentation="Peers whose first KV READ UCX moved with this transport "
            "into this memory type (DRAM/VRAM)", labelnames=[*labelnames, "mem_type", "transport"])
        self.directions = self._counter_cls(
            name="p2pkv:pulls_by_direction", documentation="Completed KV pulls by direction: pull (the decode "
            "engine READs), push (the prefill engine WRITEs) or stream (WRITEs layer by layer during the prefill)",
            labelnames=[*labelnames, "direction"])
        self.push_requests = self._counter_cls(
            name="p2pkv:push_requests", documentation="Push requests this prefill engine answered, by reply status",
            labelnames=[*labelnames, "status"])
        self.push_writes = self._counter_cls(
            name="p2pkv:push_writes", documentation="KV WRITEs this prefill engine posted for decode engines, by "
            "outcome (written, failed)", labelnames=[*labelnames, "outcome"])
        self.push_bytes = per_engine(self._counter_cls(
            name="p2pkv:push_bytes", documentation="KV bytes this prefill engine WRITE into decode engines",
            labelnames=labelnames))
        self.push_agents_unloaded = per_engine(self._counter_cls(
            name="p2pkv:push_agents_unloaded", documentation="Decode agents this prefill engine removed from NIXL "
            "(idle, or a WRITE to them failed)", labelnames=labelnames))

        self.stream_tail_seconds = per_engine(self._histogram_cls(
            name="p2pkv:stream_tail_seconds", documentation="Layer streams this prefill engine WROTE: from the "
            "prefill's last layer computed to the decode engine told (its WRITEs after that layer), seconds",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
            labelnames=labelnames))
        self.kv_checks = self._counter_cls(
            name="p2pkv:kv_checks", documentation="Landed KV parts checked against the prefill engine's digest "
            "(verify_kv), by direction and outcome: verified, mismatch, missing (no digest: failed closed)",
            labelnames=[*labelnames, "direction", "outcome"])
        self.streams_landed = self._counter_cls(
            name="p2pkv:streams_landed", documentation="Layer streams this prefill engine landed whole, by how "
            "their bytes went: per_layer (a WRITE per layer during the prefill) or whole (one WRITE after the last "
            "layer: a prompt under stream_min_tokens, or a link fast against the forward)",
            labelnames=[*labelnames, "how"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Count one :class:`p2pkv.telemetry.stats.P2pKvStats` ``data`` of engine ``engine_idx`` (vLLM's
        ``KVConnectorPromMetrics.observe``)."""
        data = transfer_stats_data
        for name in OBSERVED:
            for value in data.get(name, []):
                getattr(self, name)[engine_idx].observe(value)
        if data.get("pull_seconds"):
            self.pulls[engine_idx].inc(len(data["pull_seconds"]))
        for n in data.get("pull_bytes", []):
            self.pull_bytes[engine_idx].inc(n)
        for name in TOTALS:
            if data.get(name):
                getattr(self, name)[engine_idx].inc(data[name])
        labels = self.per_engine_labelvalues[engine_idx]
        for phase, values in data.get("phase_seconds", {}).items():
            for s in values:
                self.phase_seconds.labels(*labels, phase).observe(s)
        for name, parts in COUNTED_BY_LABEL.items():
            counter = getattr(self, name)
            for key, n in data.get(name, {}).items():
                values = key.partition(":")[::2] if parts == 2 else (key,)
                counter.labels(*labels, *values).inc(n)


OBSERVED = ("stream_tail_seconds", "pull_seconds", "pull_descriptors", "handshake_seconds")
"""Stats that are lists of values, each observed by the per-engine histogram of the same name."""

TOTALS = ("leases_expired", "leases_notified", "push_bytes", "push_agents_unloaded")
"""Stats that are one count, added to the per-engine counter of the same name."""

COUNTED_BY_LABEL: dict[str, int] = {"failures": 1, "transports": 2, "directions": 1, "push_requests": 1,
                                    "push_writes": 1, "kv_checks": 2, "streams_landed": 1}
"""Stats that are counts by label value → how many labels a key names (two: ``"DRAM:cma"`` is mem_type and
transport, ``"pull:verified"`` direction and outcome), added to the labelled counter of the same name."""
