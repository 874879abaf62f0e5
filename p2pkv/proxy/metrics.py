"""The proxy's own Prometheus metrics (a private registry, served on ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class ProxyMetrics:
    """Counters and histograms (seconds) of one proxy app."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("p2pkv_proxy_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("p2pkv_proxy_errors", "Upstream failures by stage", ["stage"], registry=r)
        self.prefill_seconds = Histogram("p2pkv_proxy_prefill_seconds", "Prefill round trip (s)",
                                         buckets=_BUCKETS, registry=r)
        self.decode_seconds = Histogram("p2pkv_proxy_decode_seconds",
                                        "Decode request to last byte (s)", buckets=_BUCKETS, registry=r)
        self.overhead_seconds = Histogram("p2pkv_proxy_overhead_seconds",
                                          "Time spent in the proxy itself per request (s)",
                                          buckets=_BUCKETS, registry=r)
