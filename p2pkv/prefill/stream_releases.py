"""A prefill rank's side-channel releases and hold questions about its layer streams.

A decode rank that loads nothing of a stream declines it (a release of the
stream id with no block ids); one whose load ended mid-stream gives its own
destination up the same way; and one waiting for a stream's notification
asks whether this rank still knows the stream (:mod:`p2pkv.decode.stream_watch`).
:class:`StreamReleases` answers them for :class:`p2pkv.prefill.prefill_streams.PrefillStreams`,
whose state it reads under that class's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from handshake import HoldStatus
from p2pkv.grant import is_stream_id
from p2pkv.prefill.agents import rank_name
from p2pkv.prefill.stream_ledger import KEEP_S, StreamLedger

if TYPE_CHECKING:
    from p2pkv.prefill.holds import PrefillHolds
    from p2pkv.prefill.poster import StreamPoster
    from p2pkv.prefill.stream_pending import PendingDestinations
    from p2pkv.prefill.write_engine import WriteEngine


class StreamReleases:
    """Releases and hold questions naming stream ids (the side channel's thread calls them; never raise)."""

    holds: PrefillHolds
    engine: WriteEngine
    poster: StreamPoster
    _lock: threading.Lock
    _ledger: StreamLedger
    _pending: PendingDestinations
    _by_stream: dict[str, str]
    _live: dict[str, Any]
    _clock: Callable[[], float]

    def on_heartbeat(self, request_ids: list[str], extend_s: float, block_ids: list[list[int]]) -> HoldStatus:
        """Side-channel thread: a heartbeat or hold question (:meth:`p2pkv.prefill.holds.PrefillHolds.on_heartbeat`).
        A stream id this rank took a destination for (or a decline of) is answered for it: held while one of its
        streams may still WRITE (its request runs here, or its destination waits for it), ``not_held`` once they
        have all ended (each ends only once no WRITE of it is in flight), until its grant has expired. A decode
        rank waiting for the stream's notification asks so, to tell a restarted prefill rank (which answers
        ``unknown``) from a slow one, and one that gave the stream up, to learn when no WRITE can land any more
        (:mod:`p2pkv.decode.stream_watch`). Everything else is the holds' to answer."""
        with self._lock:
            live = {rid for rid in request_ids if rid in self._by_stream or self._pending.holds(rid)}
            ended = {rid for rid in request_ids if rid not in live and self._ledger.served(rid)}
        known = live | ended
        rest = [i for i, rid in enumerate(request_ids) if rid not in known]
        status = HoldStatus() if not rest else self.holds.on_heartbeat(
            [request_ids[i] for i in rest], extend_s, [block_ids[i] for i in rest] if block_ids else [])
        status.not_held.extend(rid for rid in request_ids if rid in ended)
        return status

    def on_release(self, request_ids: list[str], block_ids: list[list[int]], requester: str = "") -> int:
        """Side-channel thread: a release (:meth:`p2pkv.prefill.holds.PrefillHolds.on_release`). A stream id
        among ``request_ids`` with no block ids is a decode rank declining that stream: it loads nothing of it
        (its prefix cache holds the prompt, or the request ended or failed first). The stream stops and its
        hold is freed. A stream that already has a destination stops only when ``requester`` (the release's
        ``requester_engine_id``: ``<engine id>:<tp rank>``) names that destination's decode rank: it gave the
        load up mid-stream (its request was aborted, or its load failed). Returns how many holds and streams
        are freed."""
        declined = sum(self._decline(rid, requester) for rid, blocks in zip(request_ids, block_ids, strict=True)
                       if not blocks and is_stream_id(rid))
        return declined + self.holds.on_release(request_ids, block_ids)

    def _decline(self, stream_id: str, requester: str) -> int:
        with self._lock:
            if self._ledger.served(stream_id):  # it has a destination (or was declined already)
                return self._give_up(stream_id, requester)
            request_id = self._by_stream.get(stream_id)
            if request_id is None and not self._ledger.decline(stream_id):
                return 0
            self._ledger.serve(stream_id, time.time() + KEEP_S)
            if request_id is not None:
                self.poster.abort(request_id, "the decode engine declined the stream (it loads nothing of it)")
        return 1

    def _give_up(self, stream_id: str, requester: str) -> int:
        """The destination's own decode rank gives a served stream up: it stops (its WRITEs in flight end first,
        then the decode rank is told), and its hold is freed when it has ended. A rank of the same decode engine
        that gave no destination yet (its load failed first) will send none: the request waits for one fewer,
        and is done once the others' streams have ended. Lock held."""
        mine, emptied = self._pending.take_rank(stream_id, requester)
        if mine:  # its request is not known here yet
            for dest in mine:
                self.engine.release_agent(dest.identity)
            if emptied:  # no rank's destination is left: the request never streams
                self._ledger.decline(stream_id)
            return 1
        request_id = self._by_stream.get(stream_id)
        live = self._live.get(request_id) if request_id is not None else None
        if live is None or request_id is None:
            return 0
        agent = next((a for a, i in live.agents.items() if rank_name(i) == requester), None)
        if agent is not None:
            self.poster.abort_one(request_id, agent, "the decode rank gave the load up mid-stream (its request ended)")
            return 1
        if not live.expects_more() or requester.rpartition(":")[0] != live.identity[0]:
            return 0
        live.readers -= 1  # a reading rank of the same engine that will send no destination (its load failed)
        if live.ended == live.streams and not live.expects_more():
            self._end(request_id, live, self._clock())
        return 1

    def _end(self, request_id: str, live: Any, now: float) -> None:
        """Every stream of ``request_id`` has ended: forget it, free its hold (the subclass's). Lock held."""
        raise NotImplementedError


__all__ = ["StreamReleases"]
