"""Which prefill request each stream id serves on a prefill rank, and the streams admitted but not opened yet.

The scheduler admits a streamed request when it arrives (:attr:`p2pkv.metadata.P2pKvMetadata.stream_admits`:
its stream id and grant expiry) and the rank opens its stream at the request's first chunk, maybe much later (a
long queue). In between, the rank knows the stream id is real: its destinations wait as long as their decode
ranks do and are never refused for room (:mod:`p2pkv.prefill.stream_pending`). A stream id serves the first
request that names it here for the grant's whole life (:class:`p2pkv.bindings.Bindings`), never another.

A stream that will never open here (the scheduler refused it, its request was aborted in the queue, its grant
expired there) stops at once: a destination still to come is refused, and those waiting are told, so that
their decode ranks fail the load then instead of at their window. Pure bookkeeping and the destinations' word:
the caller locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.bindings import Bindings
from p2pkv.lifetime import CLOCK_SKEW_S
from p2pkv.prefill.stream_ledger import StreamLedger
from p2pkv.prefill.stream_pending import UNKNOWN_WAIT_S, Destination, PendingDestinations

logger = logging.getLogger("p2pkv.prefill")

Tell = Callable[[Destination, str], None]
"""Tells a waiting destination's decode rank that it gets no stream, and why (its agent released)."""


@dataclass
class StreamAdmits:
    """The stream ids of one prefill rank's requests, and their admitted streams not opened yet.

    Attributes:
        clock: the streams' monotonic clock (seconds).
        max_lifetime_s: how far past this rank's clock a grant's expiry may lie (seconds).
        ledger: the rank's served, declined and stopped stream ids.
        pending: the destinations waiting for their requests.
        tell: tells a dropped destination why.
    """

    clock: Callable[[], float]
    max_lifetime_s: float
    ledger: StreamLedger
    pending: PendingDestinations
    tell: Tell
    bound: Bindings = field(default_factory=lambda: Bindings("stream id"))
    _admitted: dict[str, tuple[str, float]] = field(default_factory=dict)  # stream id → (request id, grant end)

    def knows(self, stream_id: str) -> bool:
        """Whether ``stream_id``'s request was admitted here and has not opened its stream yet."""
        return stream_id in self._admitted

    def admit(self, request_id: str, stream_id: str, expiry: float) -> None:
        """The scheduler admitted ``request_id``'s stream (its grant expiring at ``expiry``, ``time.time()``):
        ``stream_id`` serves it alone here; destinations for it wait as long as their decode ranks."""
        wall = time.time()
        if (why := self.bound.bind(stream_id, request_id, expiry + CLOCK_SKEW_S, wall)) is not None:
            logger.error("p2pkv: request %s: %s; not streamed", request_id, why)
            return
        self._admitted[stream_id] = (request_id, self.clock() + expiry + CLOCK_SKEW_S - wall)
        self.pending.admit(stream_id)

    def open(self, request_id: str, stream_id: str) -> float | None:
        """``request_id``'s first chunk opens its stream: when its grant ends (the streams' clock; inf when it was
        never admitted here), or None when ``stream_id`` serves another request here (logged: not streamed)."""
        now = time.time()
        if (why := self.bound.bind(stream_id, request_id, now + self.max_lifetime_s, now)) is not None:
            logger.error("p2pkv: request %s: %s; not streamed", request_id, why)
            return None
        return self._admitted.pop(stream_id, ("", float("inf")))[1]

    def refused(self, stream_id: str, why: str) -> None:
        """The scheduler did not stream ``stream_id``'s request (``why``)."""
        self.stop(stream_id, f"the prefill engine did not stream its request: {why}")

    def aborted(self, request_id: str, why: str) -> None:
        """``request_id`` was aborted (``why``); if its stream had not opened, it never will."""
        stream_id = next((sid for sid, (rid, _) in self._admitted.items() if rid == request_id), None)
        if stream_id is not None:
            self.stop(stream_id, why)

    def stop(self, stream_id: str, why: str) -> None:
        """``stream_id`` will never stream here: a destination still to come is refused at once, and those
        waiting are told now."""
        self._admitted.pop(stream_id, None)
        self.ledger.stop(stream_id, why)
        for dest in self.pending.take(stream_id):
            self.tell(dest, why)

    def expire(self, now: float) -> None:
        """At ``now`` (the streams' clock): destinations whose wait ended are told and dropped, and admitted
        streams whose grant ended before they opened stop."""
        for stream_id, dest in self.pending.expire(now):
            why = (f"no prefill request for stream {stream_id} came within {UNKNOWN_WAIT_S:g} s" if dest.deadline
                   > now else "the decode rank's window passed before its prefill request started")
            self.tell(dest, why)
        for stream_id in [s for s, (_, ends) in self._admitted.items() if ends <= now]:
            self.stop(stream_id, "its grant expired before its prefill request started")


__all__ = ["StreamAdmits", "Tell"]
