"""Prefill side: which finished requests' blocks are held for decode engines, and when they are freed.

A request's blocks are freed when every decode rank that answers for this
prefill rank has sent its "done" notification, when the proxy says nobody
will pull them (:class:`handshake.ReleaseHolds`), or when the lease expires,
whichever comes first; decode heartbeats extend leases of requests still
queued on the decode side. Ended holds are remembered for a while, expired
and released apart, so a decode rank that asks about a pull (before or after
its READ) learns that the blocks may already have been reused, and a pull of
another request's block ids is refused.

In push mode a hold is *pinned* while a WRITE from its blocks is queued or
in flight (:meth:`PrefillHolds.pin`): whatever would end it meanwhile (a
release, the last "done", the lease) takes effect only once the last pin is
gone, so no WRITE ever reads blocks handed back to vLLM.
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Literal

from handshake import HoldStatus
from p2pkv.notification import DoneNotification, blocks_digest
from p2pkv.prefill.leases import LeaseTable
from p2pkv.telemetry.hold_spans import HoldEnd

logger = logging.getLogger("p2pkv.prefill")

PinAnswer = Literal["held", "expired", "not_held", "unknown"]
"""What :meth:`PrefillHolds.pin` (and :meth:`PrefillHolds.check`) answer about a hold."""


class PrefillHolds:
    """Held requests of one prefill worker.

    Args:
        lease_s: longest a request is held without a notification (seconds);
            heartbeats never extend a lease beyond this from now.
        clock: monotonic seconds, the leases' deadlines' clock (``time.monotonic``; tests pass a fake).

    Attributes:
        leases: request id → deadline (:class:`p2pkv.prefill.leases.LeaseTable`).
        notifs: request id → (first notification time, decode ranks that
            notified, how many must, the block digest they name) for requests
            not yet freed.
        endings: holds ended by :meth:`released` and why, until the caller
            (the worker, for its trace spans) clears them.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self.leases = LeaseTable(clock)
        self.notifs: dict[str, tuple[float, set[str], int, str]] = {}
        self._requests: queue.SimpleQueue[tuple[list[str], float | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._blocks: dict[str, frozenset[int] | None] = {}  # held now → its block ids (None: not known)
        self._digests: dict[str, str] = {}  # held now → blocks_digest of its block ids, in order
        self._expired: dict[str, float] = {}  # ended by expiry → when
        self._released: dict[str, float] = {}  # ended by notification or release → when
        self.endings: dict[str, HoldEnd] = {}  # ended since the caller last took them → why
        self._pins: dict[str, int] = {}  # held now → WRITEs from its blocks queued or in flight
        self._deferred: dict[str, HoldEnd] = {}  # ended while pinned → why; freed when the last pin goes

    def hold(self, request_id: str, deadline: float, block_ids: tuple[int, ...] | None = None) -> None:
        """Engine thread: hold a finished request's blocks until ``deadline`` (seconds on the holds' clock)."""
        self.leases.hold(request_id, deadline)
        with self._lock:
            self._blocks[request_id] = None if block_ids is None else frozenset(block_ids)
            if block_ids is not None:
                self._digests[request_id] = blocks_digest(block_ids)

    def pending(self) -> bool:
        """True while a request's blocks are held (or wait for a WRITE from them to end)."""
        return len(self.leases) > 0 or bool(self._deferred)

    def check(self, request_id: str, block_ids: list[int]) -> PinAnswer:
        """Side-channel thread: what :meth:`pin` would answer now, changing nothing (a push request is checked
        against its hold before anything is loaded or queued for it).

        Returns:
            ``"held"`` (it holds exactly ``block_ids``), or why not: ``"expired"`` (its lease ran out),
            ``"not_held"`` (released, ending, or other block ids), ``"unknown"`` (never told to hold it).
        """
        with self._lock:
            return self._answer(request_id, block_ids)

    def pin(self, request_id: str, block_ids: list[int]) -> PinAnswer:
        """Side-channel thread: keep ``request_id``'s hold until :meth:`unpin`, if it holds exactly ``block_ids``.

        Returns:
            ``"held"`` (pinned), or why not: ``"expired"`` (its lease ran
            out), ``"not_held"`` (released, ending, or other block ids), ``"unknown"``
            (never told to hold it).
        """
        with self._lock:
            answer = self._answer(request_id, block_ids)
            if answer == "held":
                self._pins[request_id] = self._pins.get(request_id, 0) + 1
            return answer

    def _answer(self, request_id: str, block_ids: list[int]) -> PinAnswer:
        """:meth:`check`'s answer; the caller holds the lock."""
        if request_id in self._expired or self._deferred.get(request_id) is HoldEnd.EXPIRED:
            return "expired"
        if request_id in self._released or request_id in self._deferred:
            return "not_held"
        if request_id not in self._blocks:
            return "unknown"
        if self._blocks[request_id] not in (None, frozenset(block_ids)):
            return "not_held"
        return "held"

    def unpin(self, request_id: str) -> None:
        """A WRITE from ``request_id``'s blocks has ended (or will never start); thread-safe."""
        with self._lock:
            left = self._pins.get(request_id, 0) - 1
            if left > 0:
                self._pins[request_id] = left
            else:
                self._pins.pop(request_id, None)

    def on_heartbeat(self, request_ids: list[str], extend_s: float, block_ids: list[list[int]]) -> HoldStatus:
        """Side-channel thread: a decode engine still has these requests queued, or is pulling them.

        Held ones are extended at the next step. With ``block_ids`` (per id), a
        hold that lacks any of them counts as not held.
        """
        status = HoldStatus()
        held = []
        with self._lock:
            for i, rid in enumerate(request_ids):
                if rid in self._expired:
                    status.expired.append(rid)
                elif rid in self._released:
                    status.not_held.append(rid)
                elif rid not in self._blocks:
                    status.unknown.append(rid)
                elif block_ids and self._blocks[rid] is not None and not self._blocks[rid] >= set(block_ids[i]):
                    status.not_held.append(rid)
                else:
                    held.append(rid)
        self._requests.put((held, min(extend_s, self.lease_s)))
        return status

    def on_release(self, request_ids: list[str], block_ids: list[list[int]], requester: str = "") -> int:
        """Side-channel thread: nobody will pull these requests; they are freed at the next step.

        ``requester`` (the sender's ``requester_engine_id``) is not needed: the block ids are the proof.

        Only holds whose block ids are exactly ``block_ids`` (per request id,
        every block of the hold) are freed: params naming another request's id
        with other blocks free nothing.

        Returns:
            How many of them are held now with those block ids (and will be freed).
        """
        with self._lock:
            matched = [rid for rid, blocks in zip(request_ids, block_ids, strict=True)
                       if rid in self._blocks and self._blocks[rid] in (None, frozenset(blocks))]
        for rid in request_ids:
            if rid in self._blocks and rid not in matched:
                logger.warning("p2pkv: a release of request %s named block ids it does not hold with; not released",
                               rid[:64])
        self._requests.put((matched, None))
        return len(matched)

    def note(self, done: DoneNotification, now: float) -> None:
        """Count one decode rank's "done" (see :mod:`p2pkv.notification`).

        The request's blocks are freed once ``done.notifiers`` distinct decode
        ranks said so (several decode ranks read one prefill rank when decode
        TP is larger).
        """
        first, readers, expected, digest = self.notifs.get(done.request_id,
                                                           (now, set(), done.notifiers, done.blocks))
        if done.notifiers != expected or done.blocks != digest:
            logger.warning("p2pkv: a done notification for %s from %s says %d decode ranks notify (earlier ones %d), "
                           "block digest %s (earlier %s); ignored", done.request_id, done.reader, done.notifiers,
                           expected, done.blocks, digest)
            return
        readers.add(done.reader)
        self.notifs[done.request_id] = (first, readers, expected, digest)

    def _confirms(self, request_id: str, digest: str) -> bool:
        """True when ``digest`` is that of the hold's block ids (or the hold's block ids are not known)."""
        with self._lock:
            held = self._digests.get(request_id)
        if held is None or hmac.compare_digest(held, digest):
            return True
        logger.warning("p2pkv: done notifications for %s name block ids it does not hold with; not released "
                       "(its lease frees it)", request_id)
        return False

    def _apply_requests(self) -> set[str]:
        """Heartbeat extensions and releases from the side channel; the ids released."""
        released = set()
        while True:
            try:
                request_ids, extend_s = self._requests.get_nowait()
            except queue.Empty:
                return released
            for rid in request_ids:
                if extend_s is not None:
                    self.leases.extend(rid, extend_s)
                elif self.leases.release(rid):
                    released.add(rid)
                    logger.info("p2pkv: request %s released on request (its decode leg failed)", rid)

    def released(self, notes: list[DoneNotification], stats: dict) -> set[str]:
        """Request ids to free now, after this step's "done" notifications.

        Counts ``leases_expired`` and ``leases_notified`` into ``stats``.
        """
        now = self._clock()
        for done in notes:
            self.note(done, now)
        done = set()
        for rid, (_, readers, expected, digest) in list(self.notifs.items()):
            if len(readers) < expected or rid not in self.leases:
                continue  # more to come, or not leased here (yet)
            del self.notifs[rid]
            if self._confirms(rid, digest) and self.leases.release(rid):
                done.add(rid)
        on_request = self._apply_requests()
        expired = set(self.leases.pop_expired())
        for rid in expired:
            logger.warning("p2pkv: lease of request %s expired before a decode engine pulled it; "
                           "releasing its blocks", rid)
        ending = {**dict.fromkeys(done, HoldEnd.NOTIFIED), **dict.fromkeys(on_request, HoldEnd.RELEASED),
                  **dict.fromkeys(expired, HoldEnd.EXPIRED)}
        ended = self._end(ending, now)
        self.endings.update(ended)
        # A notification for a request not (yet) leased here is kept one lease long.
        for rid, (t, _, _, _) in list(self.notifs.items()):
            if now - t > self.lease_s:
                del self.notifs[rid]
        expired = {rid for rid, why in ended.items() if why is HoldEnd.EXPIRED}
        stats["leases_expired"] += len(expired)
        stats["leases_notified"] += len(ended) - len(expired)
        return set(ended)

    def _end(self, ending: dict[str, HoldEnd], now: float) -> dict[str, HoldEnd]:
        """End these holds now, except pinned ones (deferred until unpinned); with the deferred ones no
        longer pinned, the holds ended, and why. Deciding and forgetting a hold's blocks happen under one
        lock, so a pin sees either a hold it may pin or one that has ended."""
        with self._lock:
            self._deferred.update(ending)
            ended = {rid: why for rid, why in self._deferred.items() if not self._pins.get(rid)}
            for rid in ended:
                del self._deferred[rid]
            self._remember({rid for rid, why in ended.items() if why is not HoldEnd.EXPIRED},
                           {rid for rid, why in ended.items() if why is HoldEnd.EXPIRED}, now)
        for rid in set(ending) - set(ended):
            logger.info("p2pkv: request %s ends once the WRITE from its blocks has ended", rid)
        return ended

    def _remember(self, released: set[str], expired: set[str], now: float) -> None:
        """Move ended holds to the expiry/release memory (kept 10 × ``lease_s`` for late questions).
        The caller holds the lock."""
        horizon = now - 10 * self.lease_s
        for rids, memory in ((released, self._released), (expired, self._expired)):
            for rid in rids:
                self._blocks.pop(rid, None)
                self._digests.pop(rid, None)
                memory[rid] = now
            while memory and next(iter(memory.values())) < horizon:  # oldest first (insertion order)
                del memory[next(iter(memory))]
