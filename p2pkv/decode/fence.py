"""Fencing finished READs: did the prefill rank still hold the blocks when the READ ended?

A prefill lease can end (and vLLM reuse the blocks) while a READ is in
flight; the bytes pulled would then be some other request's KV, served
with HTTP 200. After a READ is seen done, the decode worker asks the
prefill rank (one :class:`handshake.LeaseHeartbeat` per rank and step,
off the engine thread) whether any of the pulled requests' leases had
already expired; only confirmed pulls reach vLLM.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from handshake import send_heartbeat
from p2pkv.decode.background import Background

if TYPE_CHECKING:
    from p2pkv.decode.peers import PeerId
    from p2pkv.decode.pull import ReadPart

FENCE_EXTEND_S = 10.0
"""Lease extension (seconds) a confirmation asks for: the notification follows within a step."""


class Fence:
    """Batches finished READs per prefill rank and collects the confirmations.

    Args:
        background: where the side-channel calls run.
        engine_id: this (decode) engine's id.
        secret: side-channel HMAC key, or None.
        timeout_s: wait for each reply (seconds).
    """

    def __init__(self, background: Background, engine_id: str, secret: bytes | None, timeout_s: float) -> None:
        self.background, self.engine_id, self.secret, self.timeout_s = background, engine_id, secret, timeout_s
        self._batches: dict[PeerId, tuple[str, int, list[ReadPart]]] = {}
        self._in_flight: list[tuple[Future, list[ReadPart]]] = []

    def add(self, peer_id: PeerId, host: str, port: int, read: ReadPart) -> None:
        """Queue a finished READ from ``peer_id`` (side channel ``host:port``) for this step's batch."""
        self._batches.setdefault(peer_id, (host, port, []))[2].append(read)

    def send(self) -> None:
        """Ask every prefill rank with queued READs about their leases (one call per rank)."""
        for host, port, reads in self._batches.values():
            ids = [r.pull.spec.remote.request_id for r in reads]
            future = self.background.call(f"p2pkv-confirm-{host}:{port}", send_heartbeat, host, port, ids,
                                          self.engine_id, FENCE_EXTEND_S, secret=self.secret,
                                          timeout_s=self.timeout_s)
            self._in_flight.append((future, reads))
        self._batches.clear()

    def answers(self) -> list[tuple[list[ReadPart], set[str] | Exception]]:
        """Finished confirmations: the READs asked about, and the expired prefill request ids
        (or the exception that made the answer unknown)."""
        out: list[tuple[list[ReadPart], set[str] | Exception]] = []
        pending = []
        for future, reads in self._in_flight:
            if not future.done():
                pending.append((future, reads))
                continue
            try:
                out.append((reads, set(future.result().expired)))
            except Exception as exc:
                out.append((reads, exc))
        self._in_flight = pending
        return out
