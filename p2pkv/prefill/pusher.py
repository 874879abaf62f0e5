"""Push mode, prefill side: WRITE held requests' blocks into the decode ranks that ask, off the engine thread.

A decode rank in push mode sends a :class:`handshake.PushRequest` naming a
held request, its block ids and descriptor rows on both sides. The side-channel
thread (:meth:`Pusher.on_push`) checks it and queues it; the pusher thread
posts NIXL WRITEs, at most ``max_in_flight`` per decode rank, taking the
decode ranks in turn (one slow or busy decode rank never starves another),
polls them, and drops or cancels what the decode rank has given up on
(``window_s``). The engine thread does none of this work.

Checks, in order, before a WRITE is queued: the decode agent's metadata
against its digest (:func:`handshake.verify_agent_info`, then NIXL loads
it), the rows (``[n, 3]``, paired lengths), every source byte inside the
held request's blocks (:func:`p2pkv.dataplane.plan.check_rows_in_blocks`),
and the hold itself, which is then pinned (:meth:`p2pkv.prefill.holds.PrefillHolds.pin`):
nothing ends it until the WRITE has ended, so a WRITE never reads blocks
vLLM has been given back. The WRITE's NIXL notification
(:func:`p2pkv.notification.encode_pushed`) reaches the decode rank after
its bytes; a WRITE that never happens or fails is reported with a
"push_failed" notification instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from handshake import PushRequest
from handshake.messages import PushStatus
from p2pkv.dataplane.agent import NixlTransferAgent, XferHandle
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.plan import PlanError, check_block_ids, check_rows_in_blocks
from p2pkv.notification import PushedNotification, encode_pushed
from p2pkv.prefill.holds import PrefillHolds

logger = logging.getLogger("p2pkv.prefill")


@dataclass(eq=False)
class PushJob:
    """One WRITE a decode rank asked for.

    Attributes:
        request_id: the held request (prefill-side id).
        push_id: names the WRITE in its notification.
        agent_name: the decode rank's NIXL agent.
        source_rows / target_rows: uint64 ``[n, 3]`` rows (this rank's, the decode rank's).
        received: ``time.monotonic()`` when the request arrived.
        window_s: seconds from ``received`` within which it may start (and be in flight): the
            request's ``window_s``, less the time it took to arrive and be handled (counted from its
            ``sent_at``, so a request handled late never writes after the decode rank stopped waiting).
        handle: the WRITE once posted.
    """

    request_id: str
    push_id: bytes
    agent_name: str
    source_rows: np.ndarray
    target_rows: np.ndarray
    received: float
    window_s: float
    handle: XferHandle | None = None

    def overdue(self, now: float) -> bool:
        """Past its window: the decode rank has given up on it."""
        return now > self.received + self.window_s


@dataclass
class PushCounters:
    """What the pusher did (cumulative counts; ``bytes`` in bytes)."""

    accepted: int = 0
    refused: int = 0
    written: int = 0
    failed: int = 0
    bytes: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Pusher:
    """The WRITEs one prefill rank posts for decode ranks in push mode.

    Args:
        agent: this rank's NIXL agent (KV memory registered).
        holds: this rank's holds (pinned while a WRITE from them is queued or in flight).
        layout: this rank's KV layout (where held blocks lie).
        secret: the side-channel secret (signs the notifications), or None.
        max_in_flight: WRITEs in flight per decode rank at once.
        max_queued: WRITEs waiting per decode rank; more are answered ``busy``.
        poll_interval_s: how often (seconds) the thread polls WRITEs in flight.
        on_start: run first on the pusher thread (binds the KV cache's GPU).
    """

    def __init__(self, agent: NixlTransferAgent, holds: PrefillHolds, layout: KVLayout, secret: bytes | None, *,
                 max_in_flight: int = 4, max_queued: int = 256, poll_interval_s: float = 0.0002,
                 on_start: Callable[[], None] | None = None) -> None:
        self.agent = agent
        self.holds = holds
        self.layout = layout
        self.secret = secret
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.poll_interval_s = poll_interval_s
        self.counters = PushCounters()
        self._on_start = on_start
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queued: dict[str, collections.deque[PushJob]] = {}  # decode agent → jobs, in arrival order
        self._in_flight: dict[str, list[PushJob]] = {}  # decode agent → WRITEs posted
        self._turn: collections.deque[str] = collections.deque()  # decode agents, the next to post first
        self._thread = threading.Thread(target=self._run, name="p2pkv-push", daemon=True)
        self._thread.start()

    # ---- side-channel thread ----------------------------------------------------------
    def on_push(self, msg: PushRequest) -> tuple[PushStatus, str]:
        """Check a push request and queue its WRITE; ``(status, message)`` for the reply. Never raises."""
        try:
            status, message = self._accept(msg)
        except Exception as exc:  # a bug must not stop the side channel
            logger.exception("p2pkv: a push request failed")
            status, message = "refused", f"internal error: {exc!r}"
        with self._lock:
            self.counters.by_status[status] = self.counters.by_status.get(status, 0) + 1
            if status == "accepted":
                self.counters.accepted += 1
            else:
                self.counters.refused += 1
        if status not in ("accepted", "expired", "not_held", "unknown"):
            logger.warning("p2pkv: push of request %s for %s refused (%s): %s", msg.request_id[:64],
                           msg.requester_engine_id[:64], status, message)
        return status, message

    def _accept(self, msg: PushRequest) -> tuple[PushStatus, str]:
        source, target = _rows(msg.source_rows), _rows(msg.target_rows)
        if source is None or target is None:
            return "refused", "source_rows/target_rows must be uint64 [n, 3] rows (24 bytes each)"
        if source.shape != target.shape or not np.array_equal(source[:, 1], target[:, 1]):
            return "refused", "source_rows and target_rows do not pair up row by row (count or lengths)"
        try:
            check_block_ids(msg.block_ids, self.layout.num_blocks, "held")
            check_rows_in_blocks(source, self.layout.segments, self.layout.num_blocks, msg.block_ids)
        except PlanError as exc:
            return "refused", f"source_rows: {exc}"
        with self._lock:
            full = len(self._queued.get(msg.agent.agent_name, ())) >= self.max_queued
        if full:
            return "busy", f"{self.max_queued} WRITEs already wait for this decode rank; retry or pull"
        try:
            name = self.agent.add_peer(msg.agent)
        except Exception as exc:
            return "refused", f"agent: {exc}"
        window_s = min(float(msg.window_s), msg.sent_at + msg.window_s - time.time())
        if window_s <= 0:  # the decode rank's wait, counted from when it sent the request, is over
            return "refused", "window_s passed before the request was handled (a busy side channel)"
        held = self.holds.pin(msg.request_id, list(msg.block_ids))
        if held != "held":
            return held, ""
        job = PushJob(msg.request_id, msg.push_id, name, source, target, time.monotonic(), window_s)
        with self._lock:
            if name not in self._queued:
                self._queued[name] = collections.deque()
                self._in_flight[name] = []
                self._turn.append(name)
            self._queued[name].append(job)
        self._wake.set()
        return "accepted", ""

    # ---- pusher thread ------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            try:
                busy = self._cycle(time.monotonic())
            except Exception:
                logger.exception("p2pkv: the push thread failed a cycle")
                busy = True
            if busy:
                self._wake.wait(self.poll_interval_s)
            else:
                self._wake.wait(1.0)
            self._wake.clear()

    def _cycle(self, now: float) -> bool:
        """Drop overdue jobs, post what fits (decode agents in turn), poll WRITEs in flight; True while any is."""
        self._post_in_turn(now)
        with self._lock:
            posted = [(name, job) for name, jobs in self._in_flight.items() for job in jobs]
        for name, job in posted:
            if self._poll(job, now):
                with self._lock:
                    self._in_flight[name].remove(job)
        with self._lock:
            return any(self._in_flight.values()) or any(self._queued.values())

    def _post_in_turn(self, now: float) -> None:
        """Post what fits now: decode agents in turn (:func:`take_in_turn`), each up to ``max_in_flight``."""
        with self._lock:
            order = list(self._turn)
            self._turn.rotate(-1)  # the next cycle starts with the next agent
            flying = {name: len(jobs) for name, jobs in self._in_flight.items()}
            taken = take_in_turn(self._queued, flying, order, self.max_in_flight)
        for name, job in taken:
            if job.overdue(now):
                self._finish(job, "the decode rank's window passed before the WRITE could start")
            elif self._start(job):
                with self._lock:
                    self._in_flight[name].append(job)

    def _start(self, job: PushJob) -> bool:
        """Post ``job``'s WRITE; False (and the job finished as failed) when NIXL refused it."""
        notif = encode_pushed(PushedNotification(job.push_id, True), self.secret)
        try:
            job.handle = self.agent.start_write(job.agent_name, job.source_rows, job.target_rows, notif)
        except Exception as exc:
            self._finish(job, f"WRITE could not start: {exc}")
            return False
        return True

    def _poll(self, job: PushJob, now: float) -> bool:
        """Poll one WRITE; True once it has ended (done, failed, or cancelled past its window)."""
        assert job.handle is not None
        try:
            done = self.agent.poll(job.handle)
        except Exception as exc:
            self._finish(job, f"WRITE failed: {exc}")
            return True
        if done:
            with self._lock:
                self.counters.written += 1
                self.counters.bytes += job.handle.num_bytes
            self.holds.unpin(job.request_id)
            return True
        if job.overdue(now) and self.agent.cancel(job.handle):
            self._finish(job, "WRITE cancelled: still in flight when the decode rank's window passed")
            return True
        return False  # not cancelled (still active): polled until it ends, the hold kept meanwhile

    def _finish(self, job: PushJob, why: str) -> None:
        """A job that wrote nothing (or failed): unpin its hold, tell the decode rank (best effort)."""
        with self._lock:
            self.counters.failed += 1
        self.holds.unpin(job.request_id)
        logger.warning("p2pkv: push of request %s to %s: %s", job.request_id[:64], job.agent_name, why)
        try:
            self.agent.send_notif(job.agent_name, encode_pushed(PushedNotification(job.push_id, False, why),
                                                                self.secret))
        except Exception as exc:
            logger.debug("p2pkv: push_failed notification to %s not sent: %s", job.agent_name, exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; queued WRITEs are dropped, WRITEs in flight cancelled (best effort). Idempotent."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        with self._lock:
            jobs = [j for q in self._queued.values() for j in q] + [j for f in self._in_flight.values() for j in f]
            self._queued.clear()
            self._in_flight.clear()
            self._turn.clear()
        for job in jobs:
            if job.handle is not None:
                self.agent.cancel(job.handle)
            self.holds.unpin(job.request_id)


def take_in_turn(queued: dict[str, collections.deque[PushJob]], in_flight: dict[str, int], order: list[str],
                 limit: int) -> list[tuple[str, PushJob]]:
    """Which queued WRITEs to post now, in posting order: one per decode agent per round, agents in ``order``,
    until each agent has ``limit`` in flight or nothing queued (round-robin, so one busy decode rank never
    starves another). Pops what it takes from ``queued``.

    Args:
        queued: decode agent → its waiting jobs, oldest first.
        in_flight: decode agent → WRITEs it has in flight now.
        order: the agents, the one to serve first first.
        limit: most WRITEs in flight per agent.
    """
    flying = {name: in_flight.get(name, 0) for name in order}
    taken: list[tuple[str, PushJob]] = []
    while True:
        round_ = [name for name in order if queued.get(name) and flying[name] < limit]
        if not round_:
            return taken
        for name in round_:
            taken.append((name, queued[name].popleft()))
            flying[name] += 1


def _rows(data: bytes) -> np.ndarray | None:
    """Wire rows → uint64 ``[n, 3]`` (None when the length is not a multiple of 24 bytes)."""
    if len(data) % 24:
        return None
    return np.frombuffer(data, dtype="<u8").reshape(-1, 3).astype(np.uint64)
