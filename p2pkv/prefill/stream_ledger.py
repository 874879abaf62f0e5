"""What a prefill rank remembers of stream ids besides its live streams: served, declined, stopped.

A grant serves one destination per decode rank that reads this rank (one,
or several for a decode engine of a larger TP size: the first destination
says how many, and all must come from the same decode engine), so a rank
remembers every stream id it took a destination for (or a decline of) until
the grant has expired, refuses a second destination from the same decode
rank or one too many, and answers a decode rank's question whether it knows
the stream
(:mod:`p2pkv.decode.stream_watch`). A decline that comes before the
stream's request is known here is kept until the request comes (its
stream then stops with nothing written), and a stream that stopped before
any destination came is kept so that a late destination is refused at
once. Both are kept for :data:`KEEP_S` and at most :data:`MAX_KEPT` of
each, and at most :data:`p2pkv.bindings.MAX_BINDINGS` stream ids are kept
served (each until its grant's expiry, which the rank has capped at
``max_lifetime_s`` past its own clock; past that count a new stream is
refused, never an old id forgotten early): a peer choosing stream ids cannot
grow them without bound, and forgetting expired ones costs the same at 10 or
a million (a heap of expiries; declines and stops expire in the order they
were kept). Pure bookkeeping: the caller locks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.bindings import MAX_BINDINGS
from p2pkv.prefill.agents import rank_name

MAX_KEPT = 4096
"""Most declines (and, apart, most stopped streams) kept at once; more are not remembered."""
KEEP_S = 600.0
"""How long a decline, or a stream stopped with no destination, is remembered (seconds)."""
EXPIRED_KEEP_S = 60.0
"""How long past its grant's expiry a served stream id is remembered (seconds; clocks differ that much)."""


@dataclass
class StreamLedger:
    """Stream ids a prefill rank served, declined or stopped.

    Attributes:
        clock: monotonic seconds (declines and stops are kept on it).
    """

    clock: Callable[[], float]
    max_served: int = MAX_BINDINGS
    _served: dict[str, float] = field(default_factory=dict)  # stream id → its grant's expiry (time.time())
    _expiries: list[tuple[float, str]] = field(default_factory=list)  # (expiry, stream id), earliest first
    _readers: dict[str, tuple[str, int, set[str]]] = field(default_factory=dict)
    """stream id → (decode engine id, how many of its ranks read this rank, the ranks that gave a destination)"""
    _declined: dict[str, float] = field(default_factory=dict)  # stream id → until when (clock)
    _stopped: dict[str, tuple[float, str]] = field(default_factory=dict)  # stream id → (until when, why)

    def served(self, stream_id: str) -> bool:
        """Whether ``stream_id`` had a destination (or a decline) here and its grant has not long expired."""
        return stream_id in self._served

    def serve(self, stream_id: str, expiry: float, rank: tuple[str, int] | None = None, readers: int = 1) -> None:
        """``stream_id`` takes a destination from decode ``rank`` (``(engine id, tp rank)``, one of ``readers``
        ranks of that engine that read this rank), or is declined (``rank`` None), now (``expiry``:
        ``time.time()`` seconds, its grant's expiry, or how long a decline is kept)."""
        kept = max(expiry, self._served.get(stream_id, expiry))
        if self._served.get(stream_id) != kept:
            self._served[stream_id] = kept
            heapq.heappush(self._expiries, (kept, stream_id))
        if rank is not None:
            self._readers.setdefault(stream_id, (rank[0], readers, set()))[2].add(rank_name(rank))

    def refuse(self, stream_id: str, rank: tuple[str, int], readers: int) -> str | None:
        """Why a destination for ``stream_id`` from decode ``rank`` (saying ``readers`` ranks read this rank) is
        refused, or None: a stream takes one destination per reading rank, all from one decode engine that said
        the same ``readers``, and none after a decline."""
        if stream_id not in self._served:
            if len(self._served) >= self.max_served:
                return (f"{len(self._served)} stream ids are served here, the most this rank keeps "
                        f"({self.max_served}); refused until some grants expire")
            return None
        entry = self._readers.get(stream_id)
        name = rank_name(rank)
        if entry is None:
            return f"stream {stream_id} already had a destination (a grant serves once), or was declined"
        if name in entry[2]:
            return f"stream {stream_id} already had a destination from decode rank {name} (a grant serves once)"
        engine, expected, ranks = entry
        if (engine, expected) != (rank[0], readers):
            return (f"stream {stream_id} is read by {expected} rank(s) of decode engine {engine}; this destination "
                    f"says {readers} of {rank[0]}")
        if len(ranks) >= expected:
            return f"stream {stream_id} already has its {expected} destination(s)"
        return None

    def forget_expired(self, now: float) -> None:
        """Drop served stream ids whose grants expired over :data:`EXPIRED_KEEP_S` before ``now``
        (``time.time()`` seconds): they can be served no more anyway. A heap pop per id dropped."""
        while self._expiries and self._expiries[0][0] + EXPIRED_KEEP_S < now:
            expiry, stream_id = heapq.heappop(self._expiries)
            if self._served.get(stream_id) == expiry:
                del self._served[stream_id]
                self._readers.pop(stream_id, None)

    def decline(self, stream_id: str) -> bool:
        """Keep a decline of ``stream_id`` until its request comes; False when :data:`MAX_KEPT` are kept."""
        if len(self._declined) >= MAX_KEPT:
            return False
        self._declined.pop(stream_id, None)
        self._declined[stream_id] = self.clock() + KEEP_S
        return True

    def take_decline(self, stream_id: str) -> bool:
        """Whether ``stream_id`` was declined before its request came (forgotten now)."""
        return self._declined.pop(stream_id, None) is not None

    def stop(self, stream_id: str, why: str) -> None:
        """``stream_id`` stopped before any destination came (``why``), kept if there is room."""
        if len(self._stopped) < MAX_KEPT:
            self._stopped.pop(stream_id, None)
            self._stopped[stream_id] = (self.clock() + KEEP_S, why)

    def stopped(self, stream_id: str) -> str | None:
        """Why ``stream_id`` stopped before any destination came, or None."""
        entry = self._stopped.get(stream_id)
        return None if entry is None else entry[1]

    def expire(self) -> None:
        """Forget the declines and stops kept over :data:`KEEP_S` (oldest first: each is kept for the same
        time on one clock, so the order they were kept in is the order they expire in)."""
        now = self.clock()
        while self._declined and next(iter(self._declined.values())) <= now:
            del self._declined[next(iter(self._declined))]
        while self._stopped and next(iter(self._stopped.values()))[0] <= now:
            del self._stopped[next(iter(self._stopped))]
