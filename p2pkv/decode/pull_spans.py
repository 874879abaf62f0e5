"""Trace spans of decode-side pulls: one ``p2pkv.pull`` span per pull, its phases as children.

Emitted when a pull ends (after its "done" notifications, or when it fails),
from the wall-clock marks the pull collected on its way
(:attr:`p2pkv.decode.transfer.Transfer.marks`), under the decode leg's trace context
(``kv_transfer_params.traceparent``, :attr:`p2pkv.metadata.LoadSpec.traceparent`).
Nothing runs while tracing is off: the receiver holds no :class:`TransferSpans` then.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from p2pkv.decode.failures import FailureKind
from p2pkv.decode.transfer import Transfer
from p2pkv.telemetry.tracing import Tracing, context_of, traces_endpoint

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import NixlTransferAgent

PHASES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("queue", ("arrival",), "scheduled"),
    ("handshake", ("taken",), "handshaken"),
    ("post", ("handshaken", "taken"), "posted"),
    ("transfer", ("posted",), "read"),
    ("fence", ("read",), "confirmed"),
    ("notify", ("confirmed",), "notified"),
)
"""Child spans ``p2pkv.pull.<phase>``: from the first of the start marks the pull has to its end mark
(skipped when the pull never reached it): waiting in vLLM's queue for blocks, the handshake with the
prefill ranks (only when one was needed), planning and posting the READs, the READs themselves, the
fence answer after them, and the "done" notifications."""


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TransferSpans:
    """Emits the spans of this decode rank's pulls.

    Args:
        tracing: this process's tracer.
        engine_id / tp_rank: this decode rank.
        agent: its NIXL agent (for the transport UCX reported per peer).
    """

    def __init__(self, tracing: Tracing, engine_id: str, tp_rank: int, agent: NixlTransferAgent) -> None:
        self.tracing, self.engine_id, self.tp_rank, self.agent = tracing, engine_id, tp_rank, agent

    @classmethod
    def start(cls, engine_id: str, tp_rank: int, agent: NixlTransferAgent) -> TransferSpans | None:
        """The emitter, or None when tracing is off (no ``OTEL_EXPORTER_OTLP_*`` endpoint)."""
        tracing = Tracing.get("p2pkv-decode", traces_endpoint())
        return None if tracing is None else cls(tracing, engine_id, tp_rank, agent)

    def ended(self, transfer: Transfer, failure: tuple[FailureKind, str] | None = None) -> None:
        """Emit ``pull``'s spans (now it is done, or failed with ``failure``: its kind and reason).

        A pull without a trace context (the client sent none, or no proxy
        traced the request) emits nothing.
        """
        parent = context_of(transfer.spec.traceparent)
        if parent is None:
            return
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        marks, now = transfer.marks, time.time()
        start = next((marks[m] for m in ("arrival", "scheduled", "taken") if marks.get(m)), now)
        end = max(start, marks.get("notified") or marks.get("confirmed") or now)
        span = self.tracing.tracer.start_span("p2pkv.pull", context=parent, start_time=_ns(start),
                                              attributes=self._attributes(transfer))
        if failure is not None:
            span.set_attribute("p2pkv.failure_kind", failure[0].value)
            span.set_status(Status(StatusCode.ERROR, f"{failure[0].value}: {failure[1]}"[:512]))
        inside = trace.set_span_in_context(span)
        for name, starts, end_mark in PHASES:
            first = next((marks[m] for m in starts if marks.get(m)), 0.0)
            if first and marks.get(end_mark):
                child = self.tracing.tracer.start_span(f"p2pkv.pull.{name}", context=inside,
                                                       start_time=_ns(max(first, start)))
                self.tracing.ended(child, _ns(min(max(marks[end_mark], first, start), end)))
        self.tracing.ended(span, _ns(end))

    def _attributes(self, transfer: Transfer) -> dict[str, str | int | list[str] | list[int]]:
        spec, remote = transfer.spec, transfer.spec.remote
        reads = transfer.parts
        transports = self.agent.transports
        return {
            "p2pkv.request_id": spec.request_id, "p2pkv.remote_request_id": remote.request_id,
            "p2pkv.engine_id": self.engine_id, "p2pkv.tp_rank": self.tp_rank,
            "p2pkv.peer.engine_id": remote.engine_id, "p2pkv.peer.host": remote.host,
            "p2pkv.peer.ranks": sorted({r.peer_id.rank for r in reads}),
            "p2pkv.blocks": len(spec.local_block_ids), "p2pkv.bytes": transfer.num_bytes,
            "p2pkv.descriptors": transfer.num_descriptors, "p2pkv.attempts": transfer.attempt + 1,
            "p2pkv.mode": transfer.direction().value,
            "p2pkv.plan": sorted({r.peer.plan.placement.value for r in reads}),
            "p2pkv.transport": sorted({transports[r.peer.agent_name].transport for r in reads
                                       if r.peer.agent_name in transports}),
        }
