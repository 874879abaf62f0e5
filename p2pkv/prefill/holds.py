"""Prefill side: which finished requests' blocks are held for decode engines, and when they are freed.

A request's blocks are freed when every decode rank that answers for this
prefill rank has sent its "done" notification, or when its lease expires,
whichever comes first; decode heartbeats extend leases of requests still
queued on the decode side. Lease expiries are remembered for a while so a
decode rank that finishes a READ late learns that the blocks may already
have been reused (its pull then counts as failed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from p2pkv.notification import DoneNotification
from p2pkv.prefill.leases import LeaseTable

logger = logging.getLogger("p2pkv.prefill.holds")


class PrefillHolds:
    """Held requests of one prefill worker.

    Args:
        lease_s: longest a request is held without a notification (seconds);
            heartbeats never extend a lease beyond this from now.

    Attributes:
        leases: request id → deadline (:class:`p2pkv.prefill.leases.LeaseTable`).
        notifs: request id → (first notification time, decode ranks that
            notified, how many must) for requests not yet freed.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.leases = LeaseTable()
        self.notifs: dict[str, tuple[float, set[str], int]] = {}
        self._heartbeats: queue.SimpleQueue[tuple[list[str], float]] = queue.SimpleQueue()
        self._expired_lock = threading.Lock()
        self._expired_recent: dict[str, float] = {}

    def on_heartbeat(self, request_ids: list[str], extend_s: float) -> list[str]:
        """Side-channel thread: a decode engine still has these requests queued, or has
        just pulled them; returns those whose lease already expired here."""
        self._heartbeats.put((request_ids, min(extend_s, self.lease_s)))
        with self._expired_lock:
            return [rid for rid in request_ids if rid in self._expired_recent]

    def _apply_heartbeats(self) -> None:
        while True:
            try:
                request_ids, extend_s = self._heartbeats.get_nowait()
            except queue.Empty:
                return
            for rid in request_ids:
                self.leases.extend(rid, extend_s)

    def note(self, done: DoneNotification, now: float) -> None:
        """Count one decode rank's "done" (see :mod:`p2pkv.notification`).

        The request's blocks are freed once ``done.notifiers`` distinct decode
        ranks said so (several decode ranks read one prefill rank when decode
        TP is larger).
        """
        first, readers, _ = self.notifs.get(done.request_id, (now, set(), done.notifiers))
        readers.add(done.reader)
        self.notifs[done.request_id] = (first, readers, done.notifiers)

    def released(self, notes: list[DoneNotification], stats: dict) -> set[str]:
        """Request ids to free now, after this step's "done" notifications.

        Counts ``leases_expired`` and ``leases_notified`` into ``stats``.
        """
        now = time.monotonic()
        for done in notes:
            self.note(done, now)
        done = {rid for rid, (_, readers, expected) in list(self.notifs.items())
                if len(readers) >= expected and self.leases.release(rid)}
        for rid in done:
            del self.notifs[rid]
        self._apply_heartbeats()
        expired = set(self.leases.pop_expired())
        with self._expired_lock:
            for rid in expired:
                self._expired_recent[rid] = now
            horizon = now - 10 * self.lease_s  # remembered for late pulls' confirmations
            for rid in [r for r, t in self._expired_recent.items() if t < horizon]:
                del self._expired_recent[rid]
        for rid in expired:
            logger.warning("p2pkv: lease of request %s expired before a decode engine pulled it; "
                           "releasing its blocks", rid)
        # A notification for a request not (yet) leased here is kept one lease long.
        for rid, (t, _, _) in list(self.notifs.items()):
            if now - t > self.lease_s:
                del self.notifs[rid]
        stats["leases_expired"] += len(expired)
        stats["leases_notified"] += len(done)
        return done | expired
