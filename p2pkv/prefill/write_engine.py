"""The one thread that posts and polls a prefill rank's WRITEs, for every way that WRITEs.

A prefill rank WRITEs into decode ranks in two ways: push (a held request's
blocks once its prefill is done, :class:`p2pkv.prefill.pusher.Pusher`) and
stream (each layer as it is computed, :class:`p2pkv.prefill.poster.StreamPoster`).
Both are *sources* of one :class:`WriteEngine`: each turn of its thread asks
every source to post what it may and poll what it has in flight
(:meth:`WriteSource.turn`), progresses the rank's NIXL agent once, and
sleeps as the most pressing source's :class:`Pace` says. What every WRITE
needs lives here once:

- **the decode agents** a WRITE goes to: one table (at most
  ``max_agents``, idle ones unloaded after ``agent_idle_s``,
  :class:`p2pkv.prefill.agents.PushAgents`) and one loader
  (:class:`p2pkv.prefill.loading.DecodeAgentLoader`); a stream keeps its
  decode agent loaded for its life (:meth:`WriteEngine.hold_agent`);
- **the failure word**: a "push_failed" notification
  (:meth:`WriteEngine.tell_failed`), after which the engine keeps progressing
  NIXL for a while, since nothing else may (:meth:`WriteEngine.notified`; after
  a stream's last word, briefly: :meth:`WriteEngine.linger`);
- **the shutdown**: :meth:`WriteEngine.close` stops every source (a stream's
  WRITEs are cancelled and waited out), then has each drop what is left and
  unloads the decode agents.

The window and cancel rule every source applies to its WRITEs is
:func:`past_window`. The engine thread binds
the KV cache's GPU and the ``transfer_cpus`` first (``on_start``). Nothing
here runs on vLLM's engine thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from p2pkv.notification import PushedNotification, encode_pushed
from p2pkv.prefill.agents import Identity, PushAgents
from p2pkv.prefill.loading import DecodeAgentLoader

if TYPE_CHECKING:
    from handshake import AgentInfo
    from p2pkv.dataplane.agent import NixlTransferAgent
    from p2pkv.faults import Faults

__all__ = ["AGENT_IDLE_S", "MAX_AGENTS", "POLL_S", "Pace", "WriteEngine", "WriteSource", "past_window"]

logger = logging.getLogger("p2pkv.prefill")

POLL_S = 0.0002
"""How long the thread sleeps between turns while a source is :attr:`Pace.URGENT` (seconds): the pace of the
decode side's pulls' thread (:data:`p2pkv.decode.progress.INTERVAL_S`), so a pushed request is seen done as soon
as a pulled one."""
WRITES_POLL_S = 0.001
"""How long it sleeps while the sources only have WRITEs in flight (:attr:`Pace.WRITING`; seconds): a new layer
wakes it at once, and polling a link-bound stream's WRITEs every 0.2 ms for a whole prefill took CPU from the
forward (docs/streaming.md)."""
IDLE_S = 0.05
"""How long it sleeps with nothing in flight (:attr:`Pace.IDLE`; seconds): a call wakes it at once; meanwhile the
rank's NIXL agent is still progressed this often (a decode rank's connection to it, and a stream's deadline that
passes while it waits for its destination, are seen within this time)."""
LINGER_S = 0.05
"""After a stream's last word or a "push_failed" notification, how long the thread keeps turning at :data:`POLL_S`
(seconds): NIXL sends it while the agent's worker progresses."""
NOTIFY_PROGRESS_S = 2.0
"""How long it keeps progressing NIXL after a "push_failed" notification (seconds, at :data:`NOTIFY_POLL_S` once
:data:`LINGER_S` is over): to a decode agent loaded just now the notification waits for UCX's wire-up, which needs
this side's worker, and the engine's steps do not run while it is idle."""
NOTIFY_POLL_S = 0.005
"""How often (seconds) it progresses NIXL meanwhile."""


MAX_AGENTS = 256
"""Decode ranks a prefill rank keeps loaded for push and streams (a NIXL remote agent and its WRITE queue each). A
new one past it takes the place of the least recently used one with no WRITE queued, in flight or streaming; when
every one has, its push or stream request is answered ``busy``. A bound on what decode agents that die leave
behind (docs/security.md)."""

AGENT_IDLE_S = 60.0
"""Seconds a decode rank with no WRITE queued, in flight or streaming stays loaded (one whose WRITE failed is
unloaded as soon as it has none); its next push or stream request loads it again."""


class Pace(enum.IntEnum):
    """How soon a source needs its next turn; the engine sleeps as the most pressing source says."""

    IDLE = 0
    """Nothing in flight (a stream may wait for its destination): :data:`IDLE_S`; a call wakes the engine."""
    WRITING = 1
    """WRITEs in flight, nothing to post: :data:`WRITES_POLL_S`."""
    URGENT = 2
    """Something to post, or WRITEs whose end the decode rank waits for: :data:`POLL_S`."""


class WriteSource(Protocol):
    """What a way that WRITEs gives the engine: its turns, and its leftovers at shutdown."""

    def turn(self, now: float, stopping: bool) -> Pace:
        """Post what may be posted, poll what is in flight (``now``: the engine's clock, seconds); with
        ``stopping``, post nothing more and stop what is running (aborting streams). The pace it needs next."""
        ...

    def drop_all(self) -> None:
        """After the engine's thread has stopped: cancel what is still in flight and let go of every hold."""
        ...


def past_window(deadline: float, now: float) -> bool:
    """The one window rule of every WRITE: at ``now`` the decode rank's window has passed (``deadline``: when it
    gives the load up, on the engine's clock, seconds). From then on nothing more is posted for it and what is in
    flight is cancelled; a WRITE NIXL will not cancel (still active) is polled until it ends, its source blocks
    kept meanwhile, and the decode rank is told of the failure only then, so no WRITE lands after the word."""
    return now >= deadline


class WriteEngine:
    """One prefill rank's WRITE thread, its decode agents and their failure word.

    Args:
        agent: this rank's NIXL agent (KV memory registered); progressed every turn.
        secret: the side-channel secret (signs the notifications), or None.
        max_agents: decode ranks loaded at once (:class:`p2pkv.prefill.agents.PushAgents`).
        agent_idle_s: seconds a decode rank with nothing queued, in flight or streaming stays loaded.
        on_start: run first on the thread (binds the KV cache's GPU and ``transfer_cpus``:
            :func:`p2pkv.transfer_threads.start_transfer_thread`).
        clock: monotonic clock in seconds for windows and idle times (``time.monotonic``; tests pass a fake);
            the thread's own pacing uses ``time.monotonic``.
        poll_s: :data:`POLL_S`, writes_poll_s: :data:`WRITES_POLL_S` (seconds; tests slow them).
        faults: the operator's injected faults every source applies to its WRITEs
            (:meth:`p2pkv.faults.Faults.write_rows`; None: none).

    Attributes:
        lock: guards :attr:`agents` and their entries (held only around reads and writes of them, never around a
            NIXL call).
        agents: the decode ranks WRITEs go to.
        loader: loads them into NIXL and unloads them.
    """

    def __init__(
        self,
        agent: NixlTransferAgent,
        secret: bytes | None,
        *,
        max_agents: int = MAX_AGENTS,
        agent_idle_s: float = AGENT_IDLE_S,
        on_start: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
        writes_poll_s: float = WRITES_POLL_S,
        faults: Faults | None = None,
    ) -> None:
        self.agent = agent
        self.faults = faults if faults is not None and faults.drop_write else None
        self.secret = secret
        self.clock = clock
        self.lock = threading.Lock()
        self.agents = PushAgents(max_agents, agent_idle_s, clock)
        self.loader = DecodeAgentLoader(agent, self.agents, self.lock)
        self._sleeps = {Pace.IDLE: IDLE_S, Pace.WRITING: max(poll_s, writes_poll_s), Pace.URGENT: poll_s}
        self._on_start = on_start
        self._sources: list[WriteSource] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._linger_until = float("-inf")  # time.monotonic(): turn at POLL_S until then
        self._notify_until = float("-inf")  # time.monotonic(): progress NIXL at NOTIFY_POLL_S until then
        self._thread = threading.Thread(target=self._run, name="p2pkv-write", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The engine's thread (``p2pkv-write``)."""
        return self._thread

    def attach(self, source: WriteSource) -> None:
        """Give ``source`` turns from the next one on (any thread)."""
        with self.lock:
            self._sources = [*self._sources, source]
        self._wake.set()

    def wake(self) -> None:
        """Turn now: a source has work (any thread)."""
        self._wake.set()

    def linger(self) -> None:
        """A stream's last word is on its way: turn at :data:`POLL_S` for :data:`LINGER_S` so that NIXL sends it
        (any thread). Its decode agent's connection is up (its WRITEs used it)."""
        self._linger_until = time.monotonic() + LINGER_S
        self._wake.set()

    def notified(self) -> None:
        """A notification was sent outside a WRITE, maybe to a decode agent loaded just now: :meth:`linger`, then
        keep progressing NIXL for :data:`NOTIFY_PROGRESS_S` so that it goes out once UCX's wire-up completes (any
        thread)."""
        self._notify_until = time.monotonic() + NOTIFY_PROGRESS_S
        self.linger()

    # ---- decode agents ------------------------------------------------------------------
    def loaded_agents(self) -> dict[Identity, str | None]:
        """The decode ranks known now: identity → the agent name NIXL holds for it (None: not loaded yet)."""
        with self.lock:
            return {a.identity: a.loaded.agent_name if a.loaded is not None else None for a in self.agents.values()}

    def hold_agent(self, identity: Identity, info: AgentInfo) -> tuple[bool, str]:
        """Load ``info``'s agent for a stream and keep it loaded (counted in its ``streams``, so never evicted or
        reloaded) until :meth:`release_agent`; ``(False, why)`` when there is no room or NIXL refused it."""
        with self.lock:
            if not self.agents.has_room(identity):
                return False, (
                    f"{self.agents.max_agents} decode ranks already have WRITEs queued or in flight here (MAX_AGENTS)"
                )
            entry = self.agents.admit(identity)
            assert entry is not None  # has_room, under the same lock
            entry.streams += 1
        ready, why = self.loader.load(entry, info)
        if not ready:
            with self.lock:
                entry.streams -= 1
                entry.broken = entry.broken or ready is False
            return False, why or "a WRITE to this decode rank's previous agent metadata is still in flight; retry"
        return True, ""

    def release_agent(self, identity: Identity) -> None:
        """A stream into ``identity``'s agent has ended: it may be unloaded once idle."""
        with self.lock:
            entry = self.agents.get(identity)
            if entry is not None and entry.streams > 0:
                entry.streams -= 1
                self.agents.touch(entry)

    def tell_failed(self, agent_name: str, push_id: bytes, why: str) -> None:
        """Tell the decode agent ``agent_name`` (loaded in NIXL) that its push or stream ``push_id`` WRITEs
        nothing, with ``why`` (a "push_failed" notification, best effort; any thread): the decode rank fails that
        part at once instead of at its window."""
        try:
            self.agent.send_notif(agent_name, encode_pushed(PushedNotification(push_id, False, why), self.secret))
        except Exception as exc:
            logger.debug("p2pkv: push_failed notification to %s not sent: %s", agent_name[:96], exc)
            return
        self.notified()

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            self._wake.clear()
            stopping = self._stop.is_set()  # read before the turns: every call made before close() is in them
            pace = self._turn(stopping)
            if stopping and pace is Pace.IDLE:
                return
            self._wake.wait(self.sleep_s(pace, time.monotonic()))

    def sleep_s(self, pace: Pace, now: float) -> float:
        """How long the thread sleeps after a turn whose most pressing source asked ``pace``, at ``now``
        (``time.monotonic()``, seconds): :data:`POLL_S` within a :meth:`linger`, at most :data:`NOTIFY_POLL_S`
        within a :meth:`notified` window, else the pace's own sleep (seconds). Pure given the two windows."""
        if now < self._linger_until:
            pace = Pace.URGENT
        sleep_s = self._sleeps[pace]
        if now < self._notify_until:
            sleep_s = min(sleep_s, NOTIFY_POLL_S)
        return sleep_s

    def _turn(self, stopping: bool) -> Pace:
        """One turn: unload idle decode agents, every source's turn, then progress NIXL once."""
        with self.lock:
            sources = self._sources
        pace = Pace.IDLE
        try:
            self.loader.sweep(self.clock())
        except Exception:
            logger.exception("p2pkv: unloading idle decode agents failed")
        for source in sources:
            try:
                pace = max(pace, source.turn(self.clock(), stopping))
            except Exception:
                logger.exception("p2pkv: the WRITE thread failed a turn of %s", type(source).__name__)
                pace = max(pace, Pace.URGENT) if not stopping else pace
        try:
            self.agent.progress()
        except Exception as exc:  # a progress that fails must not end the thread
            logger.debug("p2pkv: WRITE thread: progress failed: %s", exc)
        return pace

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every source (streams aborted, their WRITEs cancelled and waited out up to ``timeout_s``), then
        have each drop what is left (queued WRITEs dropped, WRITEs in flight cancelled, holds unpinned) and
        remove the decode agents from NIXL. Idempotent; closing any source that shares the engine closes it."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        with self.lock:
            sources = self._sources
        for source in sources:
            try:
                source.drop_all()
            except Exception:
                logger.exception("p2pkv: dropping what %s had left failed", type(source).__name__)
        with self.lock:
            self.agents.clear()
        self.loader.remove_evicted()
