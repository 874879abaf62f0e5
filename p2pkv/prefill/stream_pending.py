"""Stream destinations that came before their request: a prefill rank keeps them until the request's first chunk.

A decode rank sends its destination (:class:`handshake.StreamRequest`) as
soon as its engine has allocated the prompt's blocks, often before the
prefill engine has scheduled the request. Such a destination, checked, waits
here under its stream id (several when several decode ranks read this rank)
until the request's first chunk opens its stream, its wait ends, or its
decode rank gives it up.

How long it may wait depends on what the rank knows of its stream id. One
the scheduler has admitted (:attr:`p2pkv.metadata.P2pKvMetadata.stream_admits`:
a request that arrived here with that grant, still queued) waits as long as
its decode rank does (its window), and is never refused for room: a stream
id is admitted for one request only, so these are bounded by the requests
the engine holds. One nobody here has named (the destination raced the step
that admits its request, or a peer sends ids nobody prefills) waits at most
:data:`UNKNOWN_WAIT_S`, and at most :data:`MAX_UNKNOWN_PER_RANK` of them per
decode rank and :data:`MAX_PENDING` in all wait at once: a flood from one
peer fills only its own share and is gone within seconds, and never turns
away another decode rank's destination, nor one for a request the rank
knows. Pure bookkeeping: the caller locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pkv.prefill.agents import Identity, rank_name
from p2pkv.prefill.layer_stream import StreamTarget

MAX_PENDING = 4096
"""Most destinations for stream ids this rank does not know that wait at once, over every decode rank."""
MAX_UNKNOWN_PER_RANK = 64
"""Most destinations for stream ids this rank does not know that one decode rank keeps waiting at once (more are
answered ``busy``): about as many streams as one decode rank starts in the seconds a request takes to reach the
prefill engine's scheduler."""
UNKNOWN_WAIT_S = 10.0
"""Longest a destination for a stream id this rank does not know waits for the scheduler to admit it (seconds):
the scheduler admits a request in the step after it arrives, milliseconds to one long prefill step later."""


@dataclass
class Destination:
    """A decode rank's destination, checked, with what the prefill side compares before the first WRITE.

    Attributes:
        target: where the stream WRITEs.
        identity: the decode rank ``(engine id, tp rank)``.
        num_tokens: prompt tokens it loads (tokens).
        digest: :func:`p2pkv.prompt_digest.prompt_digest` of them.
        deadline: when its window passes (seconds on the streams' clock).
        readers: how many decode ranks of its engine read this rank (each sends a destination).
        wait_until: until when it waits here for its request (seconds on the streams' clock): its ``deadline``
            once its stream id is admitted, at most :data:`UNKNOWN_WAIT_S` from its arrival before.
    """

    target: StreamTarget
    identity: Identity
    num_tokens: int
    digest: str
    deadline: float
    readers: int
    wait_until: float = float("inf")


@dataclass
class PendingDestinations:
    """Destinations by stream id, for requests this rank does not run yet."""

    _by_stream: dict[str, list[Destination]] = field(default_factory=dict)
    _known: set[str] = field(default_factory=set)  # admitted stream ids (their request is queued here)
    _unknown: dict[str, int] = field(default_factory=dict)  # decode rank → its destinations for unknown ids

    def room(self, identity: Identity) -> str | None:
        """Why one more destination from ``identity`` for a stream id this rank does not know is refused
        (``busy``), or None."""
        if self._unknown.get(rank_name(identity), 0) >= MAX_UNKNOWN_PER_RANK:
            return (f"{MAX_UNKNOWN_PER_RANK} destinations from decode rank {rank_name(identity)[:96]} already wait "
                    "here for requests this prefill rank does not know")
        if sum(self._unknown.values()) >= MAX_PENDING:
            return f"{MAX_PENDING} stream destinations already wait here for requests this prefill rank does not know"
        return None

    def add(self, stream_id: str, dest: Destination, now: float) -> None:
        """Keep ``dest`` until its stream's request comes (``now``: the streams' clock)."""
        if stream_id in self._known:
            dest.wait_until = dest.deadline
        else:
            dest.wait_until = min(dest.deadline, now + UNKNOWN_WAIT_S)
            self._count(dest, 1)
        self._by_stream.setdefault(stream_id, []).append(dest)

    def admit(self, stream_id: str) -> None:
        """The scheduler admitted ``stream_id``'s request: its destinations wait as long as their decode ranks."""
        if stream_id in self._known:
            return
        self._known.add(stream_id)
        for dest in self._by_stream.get(stream_id, []):
            dest.wait_until = dest.deadline
            self._count(dest, -1)

    def take(self, stream_id: str) -> list[Destination]:
        """The destinations of ``stream_id``, forgotten here (its request came, or stopped)."""
        dests = self._by_stream.pop(stream_id, [])
        if stream_id not in self._known:
            for dest in dests:
                self._count(dest, -1)
        self._known.discard(stream_id)
        return dests

    def take_rank(self, stream_id: str, rank: str) -> tuple[list[Destination], bool]:
        """The destinations of ``stream_id`` from decode rank ``rank`` (``<engine id>:<tp rank>``), forgotten
        here, and whether that left none for the stream."""
        dests = self._by_stream.get(stream_id, [])
        mine = [d for d in dests if rank_name(d.identity) == rank]
        if not mine:
            return [], False
        rest = [d for d in dests if d not in mine]
        if stream_id not in self._known:
            for dest in mine:
                self._count(dest, -1)
        if rest:
            self._by_stream[stream_id] = rest
        else:
            del self._by_stream[stream_id]
        return mine, not rest

    def expire(self, now: float) -> list[tuple[str, Destination]]:
        """The destinations whose wait ended by ``now``, with their stream ids, forgotten here."""
        gone = []
        for stream_id, dests in list(self._by_stream.items()):
            gone += [(stream_id, d) for d in dests if d.wait_until <= now]
            if rest := [d for d in dests if d.wait_until > now]:
                self._by_stream[stream_id] = rest
            else:
                del self._by_stream[stream_id]
        for stream_id, dest in gone:
            if stream_id not in self._known:
                self._count(dest, -1)
        return gone

    def holds(self, stream_id: str) -> bool:
        """Whether a destination for ``stream_id`` waits here."""
        return stream_id in self._by_stream

    def waiting(self) -> int:
        """Destinations waiting now (every stream id)."""
        return sum(map(len, self._by_stream.values()))

    def _count(self, dest: Destination, change: int) -> None:
        name = rank_name(dest.identity)
        left = self._unknown.get(name, 0) + change
        if left > 0:
            self._unknown[name] = left
        else:
            self._unknown.pop(name, None)


__all__ = ["MAX_PENDING", "MAX_UNKNOWN_PER_RANK", "UNKNOWN_WAIT_S", "Destination", "PendingDestinations"]
