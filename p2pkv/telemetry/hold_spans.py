"""The trace span of one prefill hold: from the request's end on the prefill engine to its release, and why it
ended (:class:`HoldEnd`); emitted by a prefill worker and, for an aborted request, by its scheduler."""

from __future__ import annotations

import enum
import time

from p2pkv.telemetry.tracing import Tracing, context_of, traces_endpoint


class HoldEnd(str, enum.Enum):
    """Why a hold ended."""

    NOTIFIED = "notified"
    """Every decode reader said "done"."""
    RELEASED = "released"
    """A decode worker or the proxy said nobody will pull it (``ReleaseHolds``)."""
    EXPIRED = "expired"
    """Its lease ran out first."""
    ABORTED = "aborted"
    """The request was aborted on the prefill engine (its client went away): no hold began."""



def emit_hold_span(tracing: Tracing, request_id: str, traceparent: str, start_ns: int, ended: HoldEnd,
                   engine_id: str, tp_rank: int | None, num_blocks: int) -> None:
    """Emit span ``p2pkv.hold`` under the prefill leg ``traceparent`` names.

    Args:
        tracing: this process's tracer.
        request_id: the prefill engine's request id.
        traceparent: W3C trace context of the prefill leg.
        start_ns: when the hold began (``request_finished``; nanoseconds since the epoch).
        ended: why it ended; an expired lease marks the span as an error.
        engine_id / tp_rank: this prefill rank (``tp_rank`` None: the engine's scheduler, for an
            aborted request).
        num_blocks: blocks held (every KV cache group).
    """
    from opentelemetry.trace import SpanKind, Status, StatusCode

    attributes: dict[str, str | int] = {"p2pkv.request_id": request_id, "p2pkv.engine_id": engine_id,
                                        "p2pkv.blocks": num_blocks, "p2pkv.hold.end": ended.value}
    if tp_rank is not None:
        attributes["p2pkv.tp_rank"] = tp_rank
    span = tracing.tracer.start_span("p2pkv.hold", context=context_of(traceparent), kind=SpanKind.INTERNAL,
                                     start_time=start_ns, attributes=attributes)
    if ended is HoldEnd.EXPIRED:
        span.set_status(Status(StatusCode.ERROR, "lease expired before a decode engine pulled the blocks"))
    tracing.ended(span, max(start_ns, time.time_ns()))


class HoldTraces:
    """A prefill rank's open hold spans: each hold's trace context from its lease to its end (nothing kept while
    tracing is off: no OTLP endpoint configured).

    Args:
        engine_id / tp_rank: this prefill rank.
    """

    def __init__(self, engine_id: str, tp_rank: int) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self._tracing = Tracing.get("p2pkv-prefill", traces_endpoint())
        self._open: dict[str, tuple[str, int, int]] = {}  # held id → (traceparent, start ns, blocks)

    def began(self, traces: dict[str, tuple[str, int]], blocks: dict[str, tuple[int, ...]]) -> None:
        """Holds leased this step: held id → (its prefill leg's traceparent, when it began in ns since the epoch),
        and held id → its block ids."""
        if self._tracing is not None:
            for rid, (trace, start_ns) in traces.items():
                self._open[rid] = (trace, start_ns, len(blocks.get(rid, ())))

    def ended(self, endings: dict[str, HoldEnd]) -> None:
        """Holds that ended, and why: their spans are emitted."""
        if self._tracing is None:
            return
        for rid, why in endings.items():
            if (trace := self._open.pop(rid, None)) is not None:
                traceparent, start_ns, num_blocks = trace
                emit_hold_span(self._tracing, rid, traceparent, start_ns, why, self.engine_id, self.tp_rank,
                               num_blocks)
