"""Push mode, prefill side: WRITE held requests' blocks into the decode ranks that ask, off the engine thread.

A decode rank in push mode sends a :class:`handshake.PushRequest` naming a
held request, its block ids and descriptor rows on both sides. The side-channel
thread (:meth:`Pusher.on_push`) checks it and queues it; the pusher thread
posts NIXL WRITEs, at most ``max_in_flight`` per decode rank, taking the
decode ranks in turn (one slow or busy decode rank never starves another),
polls them, drops or cancels what the decode rank has given up on
(``window_s``), and unloads decode ranks that have been idle
(:mod:`p2pkv.prefill.agents`; NIXL loads and removals: :mod:`p2pkv.prefill.loading`). The engine
thread does none of this work.

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
``refused``); otherwise the pusher thread loads it again just before the
WRITE, once no WRITE to its previous metadata is in flight (new metadata:
staging registered since; a new agent name: the decode worker restarted).
The WRITE's NIXL notification (:func:`p2pkv.notification.encode_pushed`)
reaches the decode rank after its bytes; a WRITE that never happens or fails is reported with a
"push_failed" notification instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from handshake import AgentInfo, PushRequest
from handshake.messages import PushStatus
from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.layout import KVLayout
from p2pkv.notification import PushedNotification, encode_pushed
from p2pkv.prefill.agents import Identity, PushAgent, PushAgents, PushJob
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.loading import DecodeAgentLoader, same_agent
from p2pkv.prefill.push_requests import check_push_request

__all__ = ["PushCounters", "PushJob", "Pusher", "take_in_turn"]

logger = logging.getLogger("p2pkv.prefill")

K = TypeVar("K", bound=Hashable)

NOTIFY_PROGRESS_S = 2.0
"""How long (seconds) the pusher thread keeps progressing NIXL after a "push_failed" notification, so that it
is delivered while nothing else progresses the prefill agent (NIXL's UCX backend sends it without blocking)."""
NOTIFY_POLL_S = 0.005
"""How often (seconds) it progresses NIXL meanwhile."""

MAX_IN_FLIGHT = 4
"""WRITEs a prefill rank posts at once for one decode rank (others wait; decode ranks are served in turn, so one
decode rank's long queue does not hold the others back: tests/test_push_fairness.py). A bound, not a measured
optimum: one request's WRITE already carries all its blocks."""

MAX_QUEUED = 256
"""WRITEs a prefill rank lets wait for one decode rank; past it a push request is answered ``busy`` (the pull
fails and vLLM recomputes per ``kv_load_failure_policy``). A bound on what one decode rank can queue, above
the requests a decode engine has waiting at once."""

MAX_AGENTS = 256
"""Decode ranks a prefill rank keeps loaded for push (a NIXL remote agent and its WRITE queue each). A new one
past it takes the place of the least recently used one with no WRITE queued or in flight; when every one has,
its push request is answered ``busy``. A bound on what decode agents that die leave behind (docs/security.md)."""

AGENT_IDLE_S = 60.0
"""Seconds a decode rank with no WRITE queued or in flight stays loaded (one whose WRITE failed is unloaded as
soon as it has none); its next push request loads it again."""

POLL_INTERVAL_S = 0.0002
"""How often (seconds) the push thread polls the WRITEs in flight: the pace of the decode side's pulls' thread
(:data:`p2pkv.decode.progress.INTERVAL_S`), so a pushed request is seen done as soon as a pulled one."""


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
        max_agents: decode ranks loaded at once (:class:`p2pkv.prefill.agents.PushAgents`).
        agent_idle_s: seconds a decode rank with nothing queued or in flight stays loaded.
        poll_interval_s: how often (seconds) the thread polls WRITEs in flight.
        on_start: run first on the pusher thread (binds the KV cache's GPU).
        clock: monotonic clock in seconds for windows and idle times (``time.monotonic``; tests pass a fake).
    """

    def __init__(self, agent: NixlTransferAgent, holds: PrefillHolds, layout: KVLayout, secret: bytes | None, *,
                 max_in_flight: int = MAX_IN_FLIGHT, max_queued: int = MAX_QUEUED, max_agents: int = MAX_AGENTS,
                 agent_idle_s: float = AGENT_IDLE_S, poll_interval_s: float = POLL_INTERVAL_S,
                 on_start: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.agent = agent
        self.holds = holds
        self.layout = layout
        self.secret = secret
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.poll_interval_s = poll_interval_s
        self.counters = PushCounters()
        self._on_start = on_start
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._agents = PushAgents(max_agents, agent_idle_s, clock)
        self.loader = DecodeAgentLoader(agent, self._agents, self._lock)
        self._notify_until = float("-inf")  # progress NIXL until then: a push_failed notification may be queued
        self._thread = threading.Thread(target=self._run, name="p2pkv-push", daemon=True)
        self._thread.start()

    def agents(self) -> dict[Identity, str | None]:
        """The decode ranks known now: identity → the agent name NIXL holds for it (None: not loaded yet)."""
        with self._lock:
            return {a.identity: a.loaded.agent_name if a.loaded is not None else None for a in self._agents.values()}

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
        block_ids = list(msg.block_ids)
        held = self.holds.check(msg.request_id, block_ids)
        if held != "held":
            return held, ""
        job = PushJob(msg.request_id, msg.push_id, msg.agent.agent_name, checked.source, checked.target,
                      self._clock(), checked.window_s, msg.agent)
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
        self._wake.set()
        return "accepted", ""

    # ---- streams (p2pkv.prefill.prefill_streams) ----------------------------------------------------
    def hold_agent(self, identity: Identity, info: AgentInfo) -> tuple[bool, str]:
        """Load ``info``'s agent for a stream and keep it loaded (counted in its ``streams``, so never evicted or
        reloaded) until :meth:`release_agent`; ``(False, why)`` when there is no room or NIXL refused it."""
        with self._lock:
            if not self._agents.has_room(identity):
                return False, (f"{self._agents.max_agents} decode ranks already have WRITEs queued or in flight "
                               "here (MAX_AGENTS)")
            entry = self._agents.admit(identity)
            assert entry is not None  # has_room, under the same lock
            entry.streams += 1
        ready, why = self.loader.load(entry, info)
        if not ready:
            with self._lock:
                entry.streams -= 1
                entry.broken = entry.broken or ready is False
            return False, why or "a WRITE to this decode rank's previous agent metadata is still in flight; retry"
        return True, ""

    def release_agent(self, identity: Identity) -> None:
        """A stream into ``identity``'s agent has ended: it may be evicted once idle."""
        with self._lock:
            entry = self._agents.get(identity)
            if entry is not None and entry.streams > 0:
                entry.streams -= 1
                self._agents.touch(entry)

    # ---- pusher thread ------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            try:
                busy = self._cycle(self._clock())
            except Exception:
                logger.exception("p2pkv: the push thread failed a cycle")
                busy = True
            if busy:
                self._wake.wait(self.poll_interval_s)
            elif self._clock() < self._notify_until:
                self.agent.progress()
                self._wake.wait(NOTIFY_POLL_S)
            else:
                self._wake.wait(1.0)
            self._wake.clear()

    def _cycle(self, now: float) -> bool:
        """Unload evicted decode agents, post what fits (decode agents in turn), poll WRITEs in flight; True
        while any is queued or in flight."""
        self.loader.sweep(now)
        self._post_in_turn(now)
        with self._lock:
            posted = [(agent, job) for agent in self._agents.values() for job in agent.in_flight]
        for agent, job in posted:
            if self._poll(agent, job, now):
                with self._lock:
                    agent.in_flight.remove(job)
                    self._agents.touch(agent)
        with self._lock:  # a stream's WRITEs are the stream poster's to poll
            return any(not a.pushing_idle for a in self._agents.values())

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
            if job.overdue(now):
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
        """Post ``job``'s WRITE; False (and the job finished as failed) when NIXL refused it."""
        notif = encode_pushed(PushedNotification(job.push_id, True), self.secret)
        try:
            job.handle = self.agent.start_write(job.agent_name, job.source_rows, job.target_rows, notif)
        except Exception as exc:
            self._finish(agent, job, f"WRITE could not start: {exc}", broken=True)
            return False
        return True

    def _poll(self, agent: PushAgent, job: PushJob, now: float) -> bool:
        """Poll one WRITE; True once it has ended (done, failed, or cancelled past its window)."""
        assert job.handle is not None
        try:
            done = self.agent.poll(job.handle)
        except Exception as exc:
            self._finish(agent, job, f"WRITE failed: {exc}", broken=True)
            return True
        if done:
            with self._lock:
                self.counters.written += 1
                self.counters.bytes += job.handle.num_bytes
            self.holds.unpin(job.request_id)
            return True
        if job.overdue(now) and self.agent.cancel(job.handle):
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
        self.tell_failed(job.agent_name, job.push_id, why)

    def tell_failed(self, agent_name: str, push_id: bytes, why: str) -> None:
        """Tell the decode agent ``agent_name`` (loaded in NIXL) that its push or stream ``push_id`` WRITEs
        nothing, with ``why`` (a "push_failed" notification, best effort; any thread): the decode rank fails that
        part at once instead of at its window."""
        try:
            self.agent.send_notif(agent_name, encode_pushed(PushedNotification(push_id, False, why), self.secret))
        except Exception as exc:
            logger.debug("p2pkv: push_failed notification to %s not sent: %s", agent_name[:96], exc)
            return
        # Without a WRITE to poll, nothing else progresses this agent: to a decode agent loaded just now the
        # notification waits for UCX's wire-up, which needs this side's worker (the engine's steps do not run
        # while it is idle).
        self._notify_until = self._clock() + NOTIFY_PROGRESS_S
        self._wake.set()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; queued WRITEs are dropped, WRITEs in flight cancelled (best effort), the decode
        agents removed from NIXL. Idempotent."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        with self._lock:
            agents = self._agents.clear()
            jobs = [j for a in agents for j in (*a.queued, *a.in_flight)]
            for agent in agents:
                agent.queued.clear()
                agent.in_flight.clear()
        for job in jobs:
            if job.handle is not None:
                self.agent.cancel(job.handle)
            self.holds.unpin(job.request_id)
        self.loader.remove_evicted()


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
