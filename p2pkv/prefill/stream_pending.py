"""Stream destinations that came before their request: a prefill rank keeps them until the request's first chunk.

A decode rank sends its destination (:class:`handshake.StreamRequest`) as
soon as its engine has allocated the prompt's blocks, often before the
prefill engine has scheduled the request. Such a destination, checked, waits
here under its stream id (several when several decode ranks read this rank)
until the request's first chunk opens its stream, its window passes, or its
decode rank gives it up. At most :data:`MAX_PENDING` wait at once: a peer
choosing stream ids cannot grow them without bound. Pure bookkeeping: the
caller locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pkv.prefill.agents import Identity, rank_name
from p2pkv.prefill.streamer import StreamTarget

MAX_PENDING = 4096
"""Most destinations kept for requests not yet known here (more are answered ``busy``)."""


@dataclass
class Destination:
    """A decode rank's destination, checked, with what the prefill side compares before the first WRITE.

    Attributes:
        target: where the stream WRITEs.
        identity: the decode rank ``(engine id, tp rank)``.
        num_tokens: prompt tokens it loads (tokens).
        digest: :func:`p2pkv.params.prompt_digest` of them.
        deadline: when its window passes (seconds on the streams' clock).
        readers: how many decode ranks of its engine read this rank (each sends a destination).
    """

    target: StreamTarget
    identity: Identity
    num_tokens: int
    digest: str
    deadline: float
    readers: int


@dataclass
class PendingDestinations:
    """Destinations by stream id, for requests this rank does not know yet."""

    _by_stream: dict[str, list[Destination]] = field(default_factory=dict)

    def full(self) -> bool:
        """:data:`MAX_PENDING` destinations wait already."""
        return sum(map(len, self._by_stream.values())) >= MAX_PENDING

    def add(self, stream_id: str, dest: Destination) -> None:
        """Keep ``dest`` until its stream's request comes."""
        self._by_stream.setdefault(stream_id, []).append(dest)

    def take(self, stream_id: str) -> list[Destination]:
        """The destinations of ``stream_id``, forgotten here (its request came)."""
        return self._by_stream.pop(stream_id, [])

    def take_rank(self, stream_id: str, rank: str) -> tuple[list[Destination], bool]:
        """The destinations of ``stream_id`` from decode rank ``rank`` (``<engine id>:<tp rank>``), forgotten
        here, and whether that left none for the stream."""
        dests = self._by_stream.get(stream_id, [])
        mine = [d for d in dests if rank_name(d.identity) == rank]
        if not mine:
            return [], False
        rest = [d for d in dests if d not in mine]
        if rest:
            self._by_stream[stream_id] = rest
        else:
            del self._by_stream[stream_id]
        return mine, not rest

    def expire(self, now: float) -> list[Destination]:
        """The destinations whose window passed by ``now``, forgotten here."""
        gone = []
        for stream_id, dests in list(self._by_stream.items()):
            gone += [d for d in dests if d.deadline <= now]
            if rest := [d for d in dests if d.deadline > now]:
                self._by_stream[stream_id] = rest
            else:
                del self._by_stream[stream_id]
        return gone


__all__ = ["MAX_PENDING", "Destination", "PendingDestinations"]
