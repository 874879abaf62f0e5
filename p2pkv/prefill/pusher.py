"""Push mode, prefill side: WRITE held requests' blocks into the decode ranks that ask, off the engine thread.

A decode rank in push mode sends a :class:`handshake.PushRequest` naming a
held request, its block ids and descriptor rows on both sides. The side-channel
thread (:meth:`Pusher.on_push`) checks it and queues it; in its turns on the
rank's WRITE thread (:class:`p2pkv.prefill.write_engine.WriteEngine`, which
a layer stream's WRITEs share) the pusher posts NIXL WRITEs, at most
``max_in_flight`` per decode rank, taking the decode ranks in turn (one slow
or busy decode rank never starves another), polls them, and drops or cancels
what the decode rank has given up on (``window_s``,
:func:`p2pkv.prefill.write_engine.past_window`). The decode agents are the
engine's (loaded, kept and unloaded once idle: :mod:`p2pkv.prefill.agents`,
:mod:`p2pkv.prefill.loading`). vLLM's engine thread does none of this work.

Before a WRITE is queued, the request is checked
(:func:`p2pkv.prefill.push_requests.check_push_request`: rows, agent,
source and target bytes, window), then the hold itself
(:meth:`p2pkv.prefill.holds.PrefillHolds.check`) and room for the decode
rank (``max_queued``, ``max_agents``: else ``busy``), each refusing with
nothing loaded, pinned or queued. Then the hold is pinned
(:meth:`p2pkv.prefill.holds.PrefillHolds.pin`): nothing ends it until the
WRITE has ended, so a WRITE never reads blocks vLLM has been given back.
NIXL loads the decode agent then, on the side-channel thread, when that
decode rank has nothing queued or in flight (so NIXL's refusal is the reply,
``refused``); otherwise the WRITE thread loads it again just before the
WRITE, once no WRITE to its previous metadata is in flight (new metadata:
staging registered since; a new agent name: the decode worker restarted).
The WRITE's NIXL notification (:func:`p2pkv.notification.encode_pushed`)
reaches the decode rank after its bytes; a WRITE that never happens or fails is reported with a
"push_failed" notification instead. A request that asks for the WRITE's digest (verified KV,
``PushRequest.kv_digest``) gets it in that notification, computed over the source rows just before the WRITE
is posted (:func:`p2pkv.dataplane.digest.digest_rows`), while the hold is pinned; a rank whose KV cache is
not in host memory refuses such a request (the decode rank's load fails closed).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from handshake import PushRequest
from handshake.messages import PushStatus
from p2pkv.dataplane.digest import DigestError, check_host, digest_rows
from p2pkv.dataplane.layout import KVLayout
from p2pkv.notification import PushedNotification, encode_pushed
from p2pkv.prefill.agents import Identity, PushAgent, PushJob
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.loading import same_agent
from p2pkv.prefill.push_requests import check_push_request
from p2pkv.prefill.write_engine import Pace, WriteEngine, past_window

__all__ = ["PushCounters", "PushJob", "Pusher", "take_in_turn"]

logger = logging.getLogger("p2pkv.prefill")

K = TypeVar("K", bound=Hashable)

MAX_IN_FLIGHT = 4
"""WRITEs a prefill rank posts at once for one decode rank (others wait; decode ranks are served in turn, so one
decode rank's long queue does not hold the others back: tests/test_push_fairness.py). A bound, not a measured
optimum: one request's WRITE already carries all its blocks."""

MAX_QUEUED = 256
"""WRITEs a prefill rank lets wait for one decode rank; past it a push request is answered ``busy`` (the pull
fails and vLLM recomputes per ``kv_load_failure_policy``). A bound on what one decode rank can queue, above
the requests a decode engine has waiting at once."""

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
    """The WRITEs one prefill rank posts for decode ranks in push mode: a source of its WRITE engine.

    Args:
        engine: this rank's WRITE engine (its NIXL agent, decode agents and secret); the pusher takes turns on
            its thread from now on (:meth:`turn`).
        holds: this rank's holds (pinned while a WRITE from them is queued or in flight).
        layout: this rank's KV layout (where held blocks lie).
        max_in_flight: WRITEs in flight per decode rank at once.
        max_queued: WRITEs waiting per decode rank; more are answered ``busy``.
        device: the KV cache's torch device type (a WRITE's digest is computed only from host memory:
            :func:`p2pkv.dataplane.digest.check_host`).
    """

    def __init__(self, engine: WriteEngine, holds: PrefillHolds, layout: KVLayout, *,
                 max_in_flight: int = MAX_IN_FLIGHT, max_queued: int = MAX_QUEUED, device: str = "cpu") -> None:
        self.engine = engine
        self.holds = holds
        self.layout = layout
        self.device = device
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.counters = PushCounters()
        self._lock = engine.lock
        self._agents = engine.agents
        self.loader = engine.loader
        engine.attach(self)

    def agents(self) -> dict[Identity, str | None]:
        """The decode ranks known now: identity → the agent name NIXL holds for it (None: not loaded yet)."""
        return self.engine.loaded_agents()

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts since the start: push requests answered by reply status (``by_status``), WRITEs
        ``written`` and ``failed``, ``bytes`` written, decode agents ``unloaded`` from NIXL."""
        with self._lock:
            c = self.counters
            return {"by_status": dict(c.by_status), "written": c.written, "failed": c.failed, "bytes": c.bytes,
                    "unloaded": self.loader.unloaded}

    def writes_left(self) -> int:
        """WRITEs queued, being posted or in flight, over every decode rank."""
        with self._lock:
            return sum(len(a.queued) + a.starting + a.streams + len(a.in_flight) for a in self._agents.values())

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
        checked = check_push_request(msg, self.layout, time.time())
        if isinstance(checked, str):
            return "refused", checked
        identity = checked.identity
        if msg.kv_digest:
            try:
                check_host(self.device)
            except DigestError as exc:
                return "refused", f"digest: {exc}"
        block_ids = list(msg.block_ids)
        held = self.holds.check(msg.request_id, block_ids)
        if held != "held":
            return held, ""
        job = PushJob(msg.request_id, msg.push_id, msg.agent.agent_name, checked.source, checked.target,
                      self.engine.clock(), checked.window_s, msg.agent, digest=msg.kv_digest)
        with self._lock:  # room, pin and queue at once: the pusher thread sees all of it or none
            known = self._agents.get(identity)
            if known is not None and len(known.queued) >= self.max_queued:
                return "busy", f"{self.max_queued} WRITEs already wait for this decode rank; retry or pull"
            if not self._agents.has_room(identity):
                return "busy", (f"{self._agents.max_agents} decode ranks already have WRITEs queued or in flight "
                                "here (MAX_AGENTS); retry or pull")
            held = self.holds.pin(msg.request_id, block_ids)
            if held != "held":  # ended since the check
                return held, ""
            entry = self._agents.admit(identity)
            assert entry is not None  # has_room, under the same lock
            load_now = entry.idle and not same_agent(entry.loaded, msg.agent)
            if load_now:  # nothing of it queued or in flight: loaded here, so a refusal is the reply
                entry.starting += 1
            else:  # loaded (again) by the pusher thread before this WRITE, once none is in flight
                entry.queued.append(job)
        if load_now:
            ready, why = self.loader.load(entry, msg.agent)
            with self._lock:
                entry.starting -= 1
                if ready:
                    entry.queued.append(job)
                else:
                    entry.broken = True
            if not ready:
                self.holds.unpin(msg.request_id)
                return "refused", why
        self.engine.wake()
        return "accepted", ""

    # ---- the WRITE thread -----------------------------------------------------------------
    def turn(self, now: float, stopping: bool) -> Pace:
        """Post what fits (decode agents in turn), poll the WRITEs in flight (``now``: the engine's clock,
        seconds); :attr:`Pace.URGENT` while any is queued or in flight (the decode rank waits for its end),
        :attr:`Pace.IDLE` otherwise. ``stopping``: nothing is posted or polled (:meth:`drop_all` follows)."""
        if stopping:
            return Pace.IDLE
        self._post_in_turn(now)
        with self._lock:
            posted = [(agent, job) for agent in self._agents.values() for job in agent.in_flight]
        for agent, job in posted:
            if self._poll(agent, job, now):
                with self._lock:
                    agent.in_flight.remove(job)
                    self._agents.touch(agent)
        with self._lock:  # a stream's WRITEs are the stream poster's to poll
            busy = any(not a.pushing_idle for a in self._agents.values())
        return Pace.URGENT if busy else Pace.IDLE

    def _post_in_turn(self, now: float) -> None:
        """Post what fits now: decode agents in turn (:func:`take_in_turn`), each up to ``max_in_flight``,
        each one's agent loaded (or reloaded, once nothing is in flight to it) before its WRITE; WRITEs that
        must wait for a reload go back to the front of their queue, in order."""
        with self._lock:
            agents = {a.identity: a for a in self._agents.values()}
            flying = {i: len(a.in_flight) + a.starting + a.streams for i, a in agents.items()}
            taken = take_in_turn({i: a.queued for i, a in agents.items()}, flying, self._agents.order(),
                                 self.max_in_flight)
            for identity, _ in taken:
                agents[identity].starting += 1
        deferred: dict[Identity, list[PushJob]] = {}
        for identity, job in taken:
            agent = agents[identity]
            posted = False
            if identity in deferred:
                deferred[identity].append(job)
                continue
            if past_window(job.deadline, now):
                if agent.loaded is None:  # loaded only to tell the decode rank (a notification needs its agent)
                    assert job.info is not None
                    self.loader.load(agent, job.info)
                self._finish(agent, job, "the decode rank's window passed before the WRITE could start")
            else:
                assert job.info is not None
                ready, why = self.loader.load(agent, job.info)
                if ready is None:
                    deferred[identity] = [job]
                    continue
                if not ready:
                    self._finish(agent, job, why, broken=True)
                else:
                    posted = self._start(agent, job)
            with self._lock:
                agent.starting -= 1
                if posted:
                    agent.in_flight.append(job)
        with self._lock:
            for identity, jobs in deferred.items():
                agents[identity].queued.extendleft(reversed(jobs))
                agents[identity].starting -= len(jobs)

    def _start(self, agent: PushAgent, job: PushJob) -> bool:
        """Post ``job``'s WRITE (its notification with the digest of its source rows, when asked); False (and the
        job finished as failed) when NIXL refused it."""
        digest = digest_rows(job.source_rows) if job.digest else b""
        notif = encode_pushed(PushedNotification(job.push_id, True, digest=digest), self.engine.secret)
        source, target = job.source_rows, job.target_rows
        if self.engine.faults is not None:  # an operator's injected fault may drop most of the WRITE
            source, target = self.engine.faults.write_rows(source, target, job.request_id)
        try:
            job.handle = self.engine.agent.start_write(job.agent_name, source, target, notif)
        except Exception as exc:
            self._finish(agent, job, f"WRITE could not start: {exc}", broken=True)
            return False
        return True

    def _poll(self, agent: PushAgent, job: PushJob, now: float) -> bool:
        """Poll one WRITE; True once it has ended (done, failed, or cancelled past its window)."""
        assert job.handle is not None
        try:
            done = self.engine.agent.poll(job.handle)
        except Exception as exc:
            self._finish(agent, job, f"WRITE failed: {exc}", broken=True)
            return True
        if done:
            with self._lock:
                self.counters.written += 1
                self.counters.bytes += job.handle.num_bytes
            self.holds.unpin(job.request_id)
            return True
        if past_window(job.deadline, now) and self.engine.agent.cancel(job.handle):
            self._finish(agent, job, "WRITE cancelled: still in flight when the decode rank's window passed")
            return True
        return False  # not cancelled (still active): polled until it ends, the hold kept meanwhile

    def _finish(self, agent: PushAgent, job: PushJob, why: str, broken: bool = False) -> None:
        """A job that wrote nothing (or failed): unpin its hold, tell the decode rank (best effort); ``broken``:
        the agent itself failed (unloaded as soon as it is idle)."""
        with self._lock:
            self.counters.failed += 1
            agent.broken = agent.broken or broken
        self.holds.unpin(job.request_id)
        logger.warning("p2pkv: push of request %s to %s: %s", job.request_id[:64], job.agent_name[:96], why)
        self.engine.tell_failed(job.agent_name, job.push_id, why)

    def drop_all(self) -> None:
        """After the WRITE thread has stopped: queued WRITEs are dropped, WRITEs in flight cancelled (best
        effort), their holds unpinned."""
        with self._lock:
            jobs = [j for a in self._agents.values() for j in (*a.queued, *a.in_flight)]
            for agent in self._agents.values():
                agent.queued.clear()
                agent.in_flight.clear()
        for job in jobs:
            if job.handle is not None:
                self.engine.agent.cancel(job.handle)
            self.holds.unpin(job.request_id)

    def close(self, timeout_s: float = 2.0) -> None:
        """Close the WRITE engine (:meth:`p2pkv.prefill.write_engine.WriteEngine.close`: every source it runs
        stops, :meth:`drop_all`, the decode agents removed from NIXL). Idempotent."""
        self.engine.close(timeout_s)


def take_in_turn(queued: dict[K, collections.deque[PushJob]], in_flight: dict[K, int], order: list[K],
                 limit: int) -> list[tuple[K, PushJob]]:
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
    taken: list[tuple[K, PushJob]] = []
    while True:
        round_ = [name for name in order if queued.get(name) and flying[name] < limit]
        if not round_:
            return taken
        for name in round_:
            taken.append((name, queued[name].popleft()))
            flying[name] += 1
