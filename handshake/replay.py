"""Refusing replayed and stale side-channel requests with bounded memory.

Every request names its time (``sent_at``) and carries a random nonce
(:class:`handshake.messages.Request`). A server accepts a request only when
``sent_at`` lies at most ``window_s`` in the past and at most
``future_skew_s`` in the future of its own clock, and the nonce was not seen
within the window. Nonces are remembered until they leave the window, at
most ``capacity`` of them: when full, the oldest is forgotten and the
window's lower edge (the floor) moves up to its time, so a request as old as
a forgotten nonce is refused as stale — memory stays bounded (the price
under a flood is a shorter effective window).

The floor never moves past the server's clock: a flood of requests dated in
the future (a peer whose clock runs fast, or one holding the secret) cannot
make honest requests sent after it stale. Such requests are refused beyond
``future_skew_s``, and a forgotten nonce whose request was dated after the
clock at the time it was forgotten (at most ``future_skew_s`` ahead) could
be accepted again until that time passes — only by a sender that fills the
whole cache within the skew, which needs the secret (docs/security.md).

The scheme is the usual timestamp-plus-nonce cache of replay protection
(e.g. Kerberos' replay cache, RFC 4120 §3.2.3).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from handshake.errors import ReplayedRequestError, StaleRequestError

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_FUTURE_SKEW_S", "DEFAULT_WINDOW_S", "ReplayGuard"]

DEFAULT_WINDOW_S = 30.0
"""How far (seconds) a request's ``sent_at`` may lie from the server's clock: the clocks of the engines and
the proxy must agree to well within this (NTP keeps them within milliseconds)."""

DEFAULT_FUTURE_SKEW_S = 5.0
"""How far (seconds) a request's ``sent_at`` may lie ahead of the server's clock (a peer's clock running fast):
NTP keeps honest clocks within milliseconds, and refusing requests dated further ahead keeps a flood of them (a
fast clock, or a secret holder) from making honest requests stale (docs/security.md, tests/test_replay.py)."""

DEFAULT_CAPACITY = 1 << 17
"""Nonces remembered at most (about 100 bytes each: ~13 MiB), i.e. 4,000 requests a second over 30 s."""


class ReplayGuard:
    """Remembers the nonces of accepted requests while they are fresh.

    Thread-safe.

    Args:
        window_s: how far (seconds) a request's ``sent_at`` may lie before ``clock()``.
        capacity: most nonces remembered (>= 1).
        clock: seconds since the Unix epoch (injectable for tests).
        future_skew_s: how far (seconds) a request's ``sent_at`` may lie after ``clock()``
            (0 <= future_skew_s <= window_s).

    Raises:
        ValueError: ``window_s`` <= 0, ``capacity`` < 1, or ``future_skew_s`` outside ``[0, window_s]``.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.time, future_skew_s: float = DEFAULT_FUTURE_SKEW_S) -> None:
        if window_s <= 0 or capacity < 1:
            raise ValueError(f"window_s must be > 0 s and capacity >= 1, got {window_s} and {capacity}")
        if not 0 <= future_skew_s <= window_s:
            raise ValueError(f"future_skew_s must be in [0, window_s={window_s:g}] s, got {future_skew_s}")
        self.window_s = window_s
        self.future_skew_s = future_skew_s
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []  # min-heap of (sent_at, nonce)
        self._floor = float("-inf")  # requests sent at or before this are refused (a nonce of then was forgotten);
        # never above the clock at the time it was raised

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, nonce: bytes, sent_at: float) -> None:
        """Accept a request (remembering its nonce) or refuse it.

        Args:
            nonce: the request's nonce.
            sent_at: the request's ``sent_at`` (seconds since the epoch).

        Raises:
            StaleRequestError: ``sent_at`` is outside the window (or not after
                a forgotten nonce's time); field ``sent_at``.
            ReplayedRequestError: the nonce was seen within the window; field ``nonce``.
        """
        now = self._clock()
        if not now - self.window_s <= sent_at <= now + self.future_skew_s:  # also refuses NaN
            fast = "; the sender's clock runs ahead of this server's" if sent_at > now else ""
            raise StaleRequestError(
                f"request sent_at is {sent_at - now:+.1f} s from this server's clock, outside the freshness "
                f"window ({self.window_s:g} s back, {self.future_skew_s:g} s ahead){fast}; synchronise the "
                "engines' clocks (NTP) or resend", field="sent_at")
        with self._lock:
            self._expire(now)
            if sent_at <= self._floor:
                raise StaleRequestError(
                    "request is older than the oldest nonce this server still remembers (a flood of requests "
                    "shortened the freshness window); resend it", field="sent_at")
            if nonce in self._seen:
                raise ReplayedRequestError("request nonce was already used: a replayed request; send each request "
                                           "with a fresh random nonce", field="nonce")
            self._seen.add(nonce)
            heapq.heappush(self._by_time, (sent_at, nonce))
            while len(self._seen) > self.capacity:
                t, old = heapq.heappop(self._by_time)
                self._seen.discard(old)
                self._floor = max(self._floor, min(t, now))

    def _expire(self, now: float) -> None:
        """Forget nonces whose requests are out of the window anyway."""
        edge = now - self.window_s
        while self._by_time and self._by_time[0][0] < edge:
            _, old = heapq.heappop(self._by_time)
            self._seen.discard(old)
