"""Decode side: keep prefill leases alive for requests still queued here.

A request can wait in the decode engine's queue (no free blocks, a long
batch) for longer than the prefill engine's lease. While it waits, the
decode scheduler periodically sends a :class:`handshake.LeaseHeartbeat`
naming its prefill request ids to every prefill rank's side channel, and
the prefill workers extend those leases (see :mod:`p2pkv.prefill.leases`). Sending
happens on a daemon thread so the scheduler never blocks on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from handshake import Destination, HandshakeError, send_heartbeat

logger = logging.getLogger("p2pkv.scheduling.heartbeat")


@dataclass(frozen=True)
class HeartbeatBatch:
    """Request ids to keep alive on one prefill rank's side channel.

    Attributes:
        host: side-channel host.
        port: side-channel port of that rank.
        request_ids: prefill-side request ids.
        extend_s: lease length asked for (seconds from receipt).
        engine_id: the prefill engine's id (the request's destination).
        rank: the prefill worker listening on ``port`` (:attr:`handshake.Destination.rank`).
    """

    host: str
    port: int
    request_ids: tuple[str, ...]
    extend_s: float
    engine_id: str
    rank: int


class HeartbeatSender:
    """Sends :class:`HeartbeatBatch` es on a daemon thread, best effort.

    Args:
        engine_id: this (decode) engine's id, shown in the prefill's logs.
        secret: side-channel HMAC key, or None.
        timeout_s: wait for each reply (seconds).
    """

    def __init__(self, engine_id: str, secret: bytes | None, timeout_s: float = 1.0) -> None:
        self.engine_id = engine_id
        self.secret = secret
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[HeartbeatBatch | None] = queue.Queue(maxsize=1024)
        self._thread: threading.Thread | None = None

    def submit(self, batch: HeartbeatBatch) -> None:
        """Queue a batch (dropped when the queue is full: the next round repeats it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="p2pkv-heartbeat", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("p2pkv: heartbeat queue full; dropping a batch for %s:%d", batch.host, batch.port)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                send_heartbeat(Destination(batch.host, batch.port, batch.engine_id, batch.rank),
                               list(batch.request_ids), self.engine_id, batch.extend_s, secret=self.secret,
                               timeout_s=self.timeout_s)
                self.sent += 1
            except HandshakeError as exc:
                self.failed += 1
                logger.warning("p2pkv: lease heartbeat to %s:%d failed: %s", batch.host, batch.port, exc)
            except Exception:  # one bad batch must not end the thread: later heartbeats still go out
                self.failed += 1
                logger.exception("p2pkv: lease heartbeat to %s:%d failed", batch.host, batch.port)

    def close(self) -> None:
        """Stop the thread after the batches already queued. Idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
