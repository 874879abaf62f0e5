"""A decode rank's stream destination taken on a prefill rank's side channel: checked, then given to its stream.

A decode rank's :class:`handshake.StreamRequest` is checked in a fixed order
(:func:`p2pkv.prefill.stream_requests.check_stream_request`), then against the rank's state: a stream id
stopped before this destination came refuses it, naming why; the ledger refuses a second destination from the
same decode rank, one too many, or one after a decline (:mod:`p2pkv.prefill.stream_ledger`); a destination for
a stream id the rank does not know (not running, not admitted) needs room in that decode rank's share of
waiting destinations (:mod:`p2pkv.prefill.stream_pending`: else ``busy``), one for a stream the rank runs or
has admitted never does. Then NIXL loads the decode agent and keeps it until the stream ends, and the
destination goes to the request's stream (the first), to a stream forked from it (each further decode rank
reading this one), or waits for the request. :class:`StreamDestinations` is a base of
:class:`p2pkv.prefill.prefill_streams.PrefillStreams`, whose state it reads under that class's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from handshake import StreamRequest
from handshake.messages import PushStatus
from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.stages import StageLayers
from p2pkv.prefill.agents import Identity, rank_name
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.layer_stream import LayerStream, StreamSide, StreamTarget
from p2pkv.prefill.poster import StreamPoster
from p2pkv.prefill.stream_admits import StreamAdmits
from p2pkv.prefill.stream_ledger import StreamLedger
from p2pkv.prefill.stream_measures import StreamMeasures
from p2pkv.prefill.stream_pending import Destination, PendingDestinations
from p2pkv.prefill.stream_requests import check_stream_request
from p2pkv.prefill.write_engine import WriteEngine

logger = logging.getLogger("p2pkv.prefill")


@dataclass
class LiveRequest:
    """A streamed request on this rank: its first destination's rank (``identity``), every destination's rank
    by agent name, the destinations expected (``readers``), its streams started and ended."""

    stream_id: str
    digest: str
    loaded_tokens: int
    bulk: bool
    hold_blocks: tuple[int, ...] | None = None
    identity: Identity | None = None
    pinned: bool = False
    readers: int = 1
    agents: dict[str, Identity] = field(default_factory=dict)
    streams: int = 1
    ended: int = 0
    failed: str | None = None
    grant_ends: float = float("inf")

    def expects_more(self) -> bool:
        """Every stream so far ended whole, and a decode rank that reads this rank has not sent its destination."""
        return self.failed is None and self.identity is not None and len(self.agents) < self.readers



class StreamDestinations:
    """The side channel's stream requests of one prefill rank (its thread calls :meth:`on_stream`; never raises)."""

    engine_id: str
    agent: NixlTransferAgent
    holds: PrefillHolds
    engine: WriteEngine
    poster: StreamPoster
    source: StreamSide | str
    stage: StageLayers | None
    pp_size: int
    measures: StreamMeasures
    kv_groups: int
    max_lifetime_s: float
    _secret: bytes | None
    _clock: Callable[[], float]
    _lock: threading.Lock
    _live: dict[str, LiveRequest]
    _by_stream: dict[str, str]
    _pending: PendingDestinations
    _ledger: StreamLedger
    _admits: StreamAdmits

    def on_stream(self, msg: StreamRequest) -> tuple[PushStatus, str]:
        """Check a decode rank's stream request and take its destination; ``(status, message)``. Never raises."""
        try:
            return self._accept(msg)
        except Exception as exc:  # a bug must not stop the side channel
            logger.exception("p2pkv: a stream request failed")
            return "refused", f"internal error: {exc!r}"

    def _accept(self, msg: StreamRequest) -> tuple[PushStatus, str]:
        now = time.time()
        checked = check_stream_request(msg, self.source, self._secret, self.engine_id, now, self.kv_groups,
                                       self.max_lifetime_s, self.stage, self.pp_size)
        if isinstance(checked, str):
            return "refused", checked
        if msg.kv_digest and self._on_gpu:  # type: ignore[attr-defined]  # PrefillStreams's
            return "refused", "digest: verify_kv digests KV in host memory only, and this rank's is on the GPU"
        stream_id = checked.grant.stream_id
        with self._lock:
            self._ledger.forget_expired(now)
            if (stopped := self._ledger.stopped(stream_id)) is not None:
                return "refused", (f"the prefill request of stream {stream_id} stopped before this destination "
                                   f"came: {stopped}")
            if (why := self._ledger.refuse(stream_id, checked.identity, msg.readers)) is not None:
                return "refused", why
            known = stream_id in self._by_stream or self._admits.knows(stream_id)
            if not known and (why := self._pending.room(checked.identity)) is not None:
                return "busy", why  # a full queue never turns away a request this rank runs or has queued
            self._ledger.serve(stream_id, checked.grant.expiry, checked.identity, msg.readers)
        loaded, why = self.engine.hold_agent(checked.identity, msg.agent)
        if not loaded:
            return "refused", why
        deadline = self._clock() + checked.window_s  # the decode rank gives the load up then: no WRITE after it
        target = StreamTarget(msg.agent.agent_name, checked.side, tuple(msg.block_ids), msg.first_block,
                              msg.push_id, deadline, not self.measures.per_layer(rank_name(checked.identity)),
                              tuple(msg.group_blocks), checked.source_pages, msg.kv_digest)
        dest = Destination(target, checked.identity, msg.num_tokens, msg.prompt_digest, deadline, msg.readers)
        with self._lock:
            request_id = self._by_stream.get(stream_id)
            if request_id is None:
                self._pending.add(stream_id, dest, self._clock())
                return "accepted", ""
            status, why = self._attach(request_id, dest)
        if status != "accepted":
            self.engine.release_agent(checked.identity)
        return status, why

    def _attach(self, request_id: str, dest: Destination) -> tuple[PushStatus, str]:
        """Give a known stream a destination (lock held), pinned first when its hold exists: the first one goes
        to its stream, each later one (another decode rank reading this one) to a stream forked from it."""
        live = self._live[request_id]
        first = live.identity is None
        if live.hold_blocks is not None and not live.pinned:
            answer = self.holds.pin(request_id, list(live.hold_blocks))
            if answer != "held":
                return answer, ""
            live.pinned = True
        live.agents[dest.target.agent] = dest.identity
        if first:
            live.identity, live.readers = dest.identity, dest.readers
            self.poster.target(request_id, dest.target)
        else:
            live.streams += 1
            self.poster.fork(request_id, LayerStream(request_id, self.source, self.agent, self._secret, self._clock,
                                                     bulk=live.bulk, faults=self.engine.faults), dest.target)
        if (dest.num_tokens, dest.digest) != (live.loaded_tokens, live.digest):
            self.poster.abort_one(request_id, dest.target.agent, f"the decode engine loads {dest.num_tokens} prompt "
                                  f"tokens of another prompt than the {live.loaded_tokens} this engine computed "
                                  "(prompt digest differs)")
        return "accepted", ""


__all__ = ["StreamDestinations"]
