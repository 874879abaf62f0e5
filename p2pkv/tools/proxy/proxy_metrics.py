"""The proxy's own Prometheus metrics (a private registry, served on ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from p2pkv.tools.proxy.first_token import Fallback, FirstToken

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class ProxyMetrics:
    """Counters and histograms (seconds) of one proxy app, on their own registry.

    Attributes:
        requests: ``p2pkv_proxy_requests_total{endpoint, status}``, the status the client got.
        errors: ``p2pkv_proxy_errors_total{stage}``, backend failures (5xx,
            unreachable, timeout, bad answer, broken stream) by ``prefill`` /
            ``decode``; a backend's 4xx passed through to the client is not one.
        prefill_seconds: prefill request round trip.
        decode_seconds: decode request sent to its last byte relayed.
        decode_first_byte_seconds: decode request sent to the first bytes of its
            streamed answer (its first token) relayed.
        overhead_seconds: time the proxy itself adds per request: handler
            time minus the time spent waiting on engines (to the decode's
            response headers when streaming).
        releases: ``p2pkv_proxy_prefill_releases_total``, prefill holds freed
            because their decode leg failed or the client went away (per rank).
        first_tokens: ``p2pkv_proxy_first_tokens_total{source}``, streaming
            requests by where their first token came from: ``prefill`` (sent
            from the prefill answer, see :mod:`p2pkv.tools.proxy.first_token`)
            or ``decode``.
        first_token_fallbacks: ``p2pkv_proxy_first_token_fallbacks_total{reason}``,
            the ``decode`` ones of :attr:`first_tokens` by why
            (:class:`p2pkv.tools.proxy.first_token.Fallback`).
        first_token_mismatches: ``p2pkv_proxy_first_token_mismatches_total``,
            layer-streamed requests whose decode engine sampled another first
            token than the prefill engine's, which the client already had (the
            decode engine was asked again to continue after the client's:
            :mod:`p2pkv.tools.proxy.stream_hand_over`).
        turns: ``p2pkv_proxy_turns_total{event}``, multi-turn reuse (:mod:`p2pkv.tools.proxy.turns`):
            ``kept`` (a decode answer named blocks kept for the next turn, remembered), ``sent`` (a prefill leg
            went with a kept turn's params: its engine loads that turn instead of computing it), ``failed`` (such
            a leg failed, the decode engine that kept the turn gone or its hold ended: sent again without them).

    With tracing on, the histograms' observations carry an exemplar
    (``trace_id`` of the request's trace), which ``/metrics`` serves to a
    scraper asking for OpenMetrics.
    """

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("p2pkv_proxy_requests", "Client requests by endpoint and returned HTTP status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("p2pkv_proxy_errors", "Backend failures by stage (prefill, decode)", ["stage"],
                              registry=r)
        self.prefill_seconds = Histogram("p2pkv_proxy_prefill_seconds", "Prefill request round trip (seconds)",
                                         buckets=_BUCKETS, registry=r)
        self.decode_seconds = Histogram("p2pkv_proxy_decode_seconds",
                                        "Decode request sent to last byte relayed (seconds)", buckets=_BUCKETS,
                                        registry=r)
        self.decode_first_byte_seconds = Histogram(
            "p2pkv_proxy_decode_first_byte_seconds",
            "Decode request sent to the first bytes of its streamed answer relayed (seconds)", buckets=_BUCKETS,
            registry=r)
        self.overhead_seconds = Histogram("p2pkv_proxy_overhead_seconds",
                                          "Time the proxy itself adds per request, engine waits excluded (seconds)",
                                          buckets=_BUCKETS, registry=r)
        self.releases = Counter("p2pkv_proxy_prefill_releases",
                                "Prefill holds freed because the decode leg failed or the client left (per rank)",
                                registry=r)
        self.first_tokens = Counter("p2pkv_proxy_first_tokens",
                                    "Streaming requests by the engine their first token came from (prefill, decode)",
                                    ["source"], registry=r)
        for source in ("prefill", "decode"):  # both series exist from the start, at 0
            self.first_tokens.labels(source)
        self.first_token_fallbacks = Counter(
            "p2pkv_proxy_first_token_fallbacks",
            "Streaming requests whose first token came from the decode engine, by reason", ["reason"],
            registry=r)
        for reason in Fallback:  # every series exists from the start, at 0
            self.first_token_fallbacks.labels(reason.value)
        self.first_token_mismatches = Counter(
            "p2pkv_proxy_first_token_mismatches",
            "Layer-streamed requests whose decode engine's first token differed from the handed-over one "
            "(continued after the client's)", registry=r)
        self.turns = Counter("p2pkv_proxy_turns", "Multi-turn reuse: turns kept by a decode engine and remembered "
                             "(kept), prefill legs sent with a kept turn (sent), such legs that failed and "
                             "were sent again without it (failed)", ["event"], registry=r)
        for event in ("kept", "sent", "failed"):  # every series exists from the start, at 0
            self.turns.labels(event)

    def count_first_token(self, first: FirstToken | Fallback) -> None:
        """Count a streaming request's first token: from the prefill answer (``first`` the token), or from the
        decode engine (``first`` the reason, counted in :attr:`first_token_fallbacks` too)."""
        if isinstance(first, Fallback):
            self.first_tokens.labels("decode").inc()
            self.first_token_fallbacks.labels(first.value).inc()
        else:
            self.first_tokens.labels("prefill").inc()
