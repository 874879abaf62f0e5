"""OpenTelemetry traces of p2pkv's work: set-up, export over OTLP/HTTP, and W3C trace context.

Off by default. On when an OTLP traces endpoint is configured: the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
variables (an engine's), or the proxy's ``--otlp-traces-endpoint``. Spans go out in batches from a
bounded queue on the SDK's own thread (``BatchSpanProcessor``) over
OTLP/HTTP with protobuf bodies (``opentelemetry-exporter-otlp-proto-http``):
a collector that is down or slow never delays a request; spans that do not
fit the queue or fail to export are dropped and counted (:attr:`Tracing.dropped`).

One trace per client request: the proxy starts (or continues the client's)
trace and hands each leg its context as the W3C ``traceparent`` header
(vLLM's own request span reads it) and as ``kv_transfer_params.traceparent``
(p2pkv's hold and pull spans read it).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger("p2pkv.tracing")

TRACEPARENT_KEY = "traceparent"
"""The W3C trace-context header, and the ``kv_transfer_params`` key carrying the same value."""

_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
"""A version-00 W3C ``traceparent`` (https://www.w3.org/TR/trace-context/#traceparent-header)."""

MAX_QUEUE_SPANS = 4096
"""Spans waiting for export at most per process; more are dropped (and counted)."""
EXPORT_TIMEOUT_S = 2.0
"""Longest one export request may take (seconds)."""


def traces_endpoint(setting: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The OTLP/HTTP traces URL in force (``""``: tracing off).

    ``setting`` (the proxy's ``--otlp-traces-endpoint``) wins; then ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    (used as is); then ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``.
    """
    env = os.environ if environ is None else environ
    if setting:
        return setting
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return f"{base.rstrip('/')}/v1/traces" if base else ""


def parse_traceparent(value: Any) -> str | None:
    """``value`` if it is a valid version-00 W3C ``traceparent`` (lower-case hex), else None."""
    if isinstance(value, str) and len(value) == 55 and _TRACEPARENT.fullmatch(value):
        return value
    return None


def context_of(traceparent: str | None) -> Context | None:
    """The OpenTelemetry context a ``traceparent`` names (None: none, or not valid)."""
    if parse_traceparent(traceparent) is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT_KEY: traceparent})


def traceparent_of(span: Span) -> str:
    """The ``traceparent`` naming ``span`` as the parent."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class _CountingExporter:
    """Wraps an exporter: counts spans it failed to export."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failed = 0
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not end the SDK's export thread
            logger.exception("p2pkv: exporting spans failed")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            before, self.failed = self.failed, self.failed + len(spans)
            if before == 0 or self.failed.bit_length() > before.bit_length():  # the first, then at each doubling
                logger.warning("p2pkv: %d trace span(s) dropped so far: the OTLP collector did not take them "
                               "(requests are not affected; check the traces endpoint)", self.failed)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Tracing:
    """This process's tracer, exporting to one OTLP/HTTP endpoint.

    Args:
        service_name: ``service.name`` of the spans (e.g. ``p2pkv-proxy``,
            ``p2pkv-decode``).
        endpoint: the OTLP/HTTP traces URL (e.g. ``http://127.0.0.1:4318/v1/traces``).

    Attributes:
        tracer: the OpenTelemetry tracer.
        endpoint: where spans go.
    """

    _instances: ClassVar[dict[tuple[str, str], Tracing]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, service_name: str, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.endpoint = endpoint
        self._exporter = _CountingExporter(OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S))
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter, max_queue_size=MAX_QUEUE_SPANS,
                                                             schedule_delay_millis=200))
        self._ended = 0
        self.tracer: Tracer = self._provider.get_tracer("p2pkv")

    @classmethod
    def get(cls, service_name: str, endpoint: str) -> Tracing | None:
        """The process's :class:`Tracing` for ``service_name`` and ``endpoint`` (made once); None when
        ``endpoint`` is ``""`` (tracing off: callers skip every span)."""
        if not endpoint:
            return None
        with cls._lock:
            key = (service_name, endpoint)
            if key not in cls._instances:
                cls._instances[key] = Tracing(service_name, endpoint)
                logger.info("p2pkv: exporting traces of %s to %s", service_name, endpoint)
            return cls._instances[key]

    def ended(self, span: Span, end_ns: int | None = None) -> None:
        """End ``span`` (at ``end_ns``, nanoseconds since the epoch; default now) and count it."""
        span.end(end_time=end_ns)
        self._ended += 1

    @property
    def dropped(self) -> int:
        """Spans ended but not exported: failed exports, and (after :meth:`flush`) those the full queue dropped."""
        return self._exporter.failed + max(0, self._ended - self._exporter.exported - self._exporter.failed
                                           - MAX_QUEUE_SPANS)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now (tests, shutdown); True when everything went out in time."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter thread. Idempotent."""
        self._provider.shutdown()
