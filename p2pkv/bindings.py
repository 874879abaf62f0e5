"""One request per capability or grant: what an engine has bound, and to whom, until it expires.

Whoever has seen one proxy → engine hop (logs, traces, a router) holds a
valid stream grant or capability and may send it again. Each engine
therefore binds every grant's ``stream_id`` (and, on a decode engine, every
capability) to the first request that names it, for the whole life of the
grant or capability, and refuses any other request naming it before
anything is held or allocated for that request. A bound id is never moved to
another request.

What is remembered is bounded twice: by time (an entry lives until the
expiry it was bound with, which the receiver has already capped at
``max_lifetime_s`` past its own clock: :attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`)
and by count (:attr:`Bindings.max_entries`: past it, new bindings are
refused, never old ones forgotten early, since forgetting would let a
replay through). Expiring is a heap pop per expired entry: the same cost at
10 or at a million entries. Pure bookkeeping: the caller locks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

MAX_BINDINGS = 1 << 17
"""Most ids an engine keeps bound at once (131,072: at the default 120 s grant and lease, over 1,000 new requests
per second per engine). Each costs about 200 bytes."""


@dataclass
class Bindings:
    """Ids (stream ids, capabilities) bound to the one request (``owner``) each serves, until they expire.

    Attributes:
        what: what the ids are, for the refusals' messages (``"stream id"``, ``"capability"``).
        max_entries: most ids kept at once.
    """

    what: str
    max_entries: int = MAX_BINDINGS
    _owner: dict[str, tuple[str, float]] = field(default_factory=dict)  # id → (owner, expiry)
    _heap: list[tuple[float, str]] = field(default_factory=list)  # (expiry, id), earliest first

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: str) -> str | None:
        """The request ``key`` is bound to (None: not bound, or expired and expired here)."""
        entry = self._owner.get(key)
        return None if entry is None else entry[0]

    def bind(self, key: str, owner: str, expiry: float, now: float) -> str | None:
        """Bind ``key`` to ``owner`` until ``expiry`` (both ``now`` and ``expiry`` in one clock's seconds).

        Returns:
            None when ``key`` now serves ``owner`` (bound now, or already bound to it), else why not: bound to
            another request (a replay), or :attr:`max_entries` ids are bound.
        """
        self.expire(now)
        entry = self._owner.get(key)
        if entry is not None:
            if entry[0] == owner:
                return None
            return (f"{self.what} {key[:64]} already serves request {entry[0][:64]} on this engine (a replay: one "
                    f"{self.what} serves one request for its whole life)")
        if len(self._owner) >= self.max_entries:
            return (f"{len(self._owner)} {self.what}s are bound on this engine, the most it keeps "
                    f"({self.max_entries}); refused until some expire")
        self._owner[key] = (owner, expiry)
        heapq.heappush(self._heap, (expiry, key))
        return None

    def expire(self, now: float) -> int:
        """Forget the ids whose expiry is before ``now``; how many."""
        gone = 0
        while self._heap and self._heap[0][0] < now:
            expiry, key = heapq.heappop(self._heap)
            entry = self._owner.get(key)
            if entry is not None and entry[1] == expiry:
                del self._owner[key]
                gone += 1
        return gone


__all__ = ["MAX_BINDINGS", "Bindings"]
