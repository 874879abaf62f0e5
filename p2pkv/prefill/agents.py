"""Push mode, prefill side: the decode ranks a prefill rank WRITEs into, each with its queue and NIXL remote agent.

A decode rank is known here by its identity, ``(engine id, tp rank)``: the
engine id its signed push request names as its sender, and the rank of its
:class:`handshake.AgentInfo`, whose agent name must be the one p2pkv gives
that rank (:func:`p2pkv.dataplane.agent.is_agent_name_of`). So one engine's
request can only ever load, reload or replace the remote agent of its own
identity: a restarted decode worker (a new agent name) or one that
registered its staging since (new metadata) takes its own place, never
another's.

Every entry exists only while it has a WRITE queued or in flight (each one
pins a hold, :meth:`p2pkv.prefill.holds.PrefillHolds.pin`) and then for at
most ``idle_s`` seconds (none after a WRITE to it failed), and there are at
most ``max_agents`` of them: a new decode rank past the cap takes the place
of the least recently used idle one (one with nothing queued or in flight;
its next request loads it again, carrying its metadata anyway), and is
answered ``busy`` only when every entry has work. Evicting the idle one
rather than refusing the newcomer keeps a prefill rank serving the decode
ranks that push now, and an agent is never unloaded while a WRITE to it is
in flight. The table is bookkeeping only; the :class:`p2pkv.prefill.pusher.Pusher`
does the NIXL work on its own thread (loads, reloads, removals) and holds
its lock around every call here.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from handshake import AgentInfo
from p2pkv.dataplane.agent import XferHandle

Identity = tuple[str, int]
"""A decode rank: ``(engine id, tp rank)``."""


def rank_name(identity: Identity) -> str:
    """A decode rank as its releases name it (``requester_engine_id``): ``<engine id>:<tp rank>``."""
    return f"{identity[0]}:{identity[1]}"


@dataclass(eq=False)
class PushJob:
    """One WRITE a decode rank asked for.

    Attributes:
        request_id: the held request (prefill-side id).
        push_id: names the WRITE in its notification.
        agent_name: the decode rank's NIXL agent.
        source_rows / target_rows: uint64 ``[n, 3]`` rows (this rank's, the decode rank's).
        received: when the request arrived (seconds on the pusher's clock, ``time.monotonic()``).
        window_s: seconds from ``received`` within which it may start (and be in flight): the
            request's ``window_s``, less the time it took to arrive and be handled (counted from its
            ``sent_at``, so a request handled late never writes after the decode rank stopped waiting).
        info: the decode rank's :class:`handshake.AgentInfo` as this request carried it (NIXL must hold
            this metadata when the WRITE is posted).
        handle: the WRITE once posted.
        digest: verified KV: the WRITE's notification carries the digest of ``source_rows``.
    """

    request_id: str
    push_id: bytes
    agent_name: str
    source_rows: np.ndarray
    target_rows: np.ndarray
    received: float
    window_s: float
    info: AgentInfo | None = None
    handle: XferHandle | None = None
    digest: bool = False

    @property
    def deadline(self) -> float:
        """When the decode rank gives it up (seconds on the pusher's clock):
        :func:`p2pkv.prefill.write_engine.past_window` applies."""
        return self.received + self.window_s


@dataclass(eq=False)
class PushAgent:
    """One decode rank a prefill rank pushes to.

    Attributes:
        identity: ``(engine id, tp rank)``.
        queued: WRITEs waiting, in arrival order.
        in_flight: WRITEs posted.
        starting: WRITEs taken from ``queued`` and being posted (the agent loaded first) right now.
        streams: layer streams into it that keep its agent loaded
            (:meth:`p2pkv.prefill.write_engine.WriteEngine.hold_agent`): their WRITEs are the stream poster's.
        loaded: the :class:`handshake.AgentInfo` whose metadata NIXL holds for it (None: nothing loaded yet).
        last_used: when it last had work (seconds on the table's clock).
        broken: a WRITE to it failed: unloaded as soon as it is idle.
    """

    identity: Identity
    queued: collections.deque[PushJob] = field(default_factory=collections.deque)
    in_flight: list[PushJob] = field(default_factory=list)
    starting: int = 0
    streams: int = 0
    loaded: AgentInfo | None = None
    last_used: float = 0.0
    broken: bool = False

    @property
    def idle(self) -> bool:
        """Nothing queued, being posted or in flight, no stream into it (so nothing pinned for it, nothing NIXL
        moves to it)."""
        return self.pushing_idle and not self.streams

    @property
    def pushing_idle(self) -> bool:
        """No push WRITE queued, being posted or in flight: nothing for the pusher's thread to poll (a stream
        into it may still hold its agent)."""
        return not self.queued and not self.in_flight and not self.starting


class PushAgents:
    """The decode ranks a prefill rank pushes to: at most ``max_agents``, idle ones evicted after ``idle_s``.

    Not thread-safe: the caller serialises (the pusher's lock). Evicted
    entries' loaded agent names are collected for the caller to remove from
    NIXL (:meth:`take_unloads`), before it loads anything again.

    Args:
        max_agents: most entries at once.
        idle_s: seconds an idle entry is kept.
        clock: monotonic clock in seconds (``time.monotonic``; tests pass a fake).
    """

    def __init__(self, max_agents: int = 256, idle_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_agents = max_agents
        self.idle_s = idle_s
        self._clock = clock
        self._agents: dict[Identity, PushAgent] = {}
        self._turn: collections.deque[Identity] = collections.deque()  # the next to post first
        self._unloads: list[str] = []  # evicted entries' agent names NIXL still holds

    def __len__(self) -> int:
        return len(self._agents)

    def get(self, identity: Identity) -> PushAgent | None:
        """The entry of ``identity``, or None."""
        return self._agents.get(identity)

    def values(self) -> list[PushAgent]:
        """Every entry (a copy of the list)."""
        return list(self._agents.values())

    def has_room(self, identity: Identity) -> bool:
        """True when :meth:`admit` would give ``identity`` an entry: it has one, the table is below
        ``max_agents``, or an idle entry can make way."""
        return (identity in self._agents or len(self._agents) < self.max_agents
                or any(a.idle for a in self._agents.values()))

    def admit(self, identity: Identity) -> PushAgent | None:
        """The entry of ``identity``, made when new (the least recently used idle entry evicted at the
        cap), its ``last_used`` now; None when the table is full of entries with work."""
        now = self._clock()
        agent = self._agents.get(identity)
        if agent is None:
            if len(self._agents) >= self.max_agents:
                idle = [a for a in self._agents.values() if a.idle]
                if not idle:
                    return None
                self._evict(min(idle, key=lambda a: a.last_used))
            agent = self._agents[identity] = PushAgent(identity)
            self._turn.append(identity)
        agent.last_used = now
        return agent

    def touch(self, agent: PushAgent) -> None:
        """``agent`` had work now (a WRITE ended): its idle time counts from now."""
        agent.last_used = self._clock()

    def order(self) -> list[Identity]:
        """The entries in posting order, the first first; the next call starts with the next one."""
        order = list(self._turn)
        self._turn.rotate(-1)
        return order

    def evict_idle(self) -> int:
        """Evict the entries idle for ``idle_s`` or broken and idle; how many."""
        horizon = self._clock() - self.idle_s
        gone = [a for a in self._agents.values() if a.idle and (a.broken or a.last_used <= horizon)]
        for agent in gone:
            self._evict(agent)
        return len(gone)

    def clear(self) -> list[PushAgent]:
        """Forget every entry (their loaded names go to :meth:`take_unloads`); the entries."""
        agents = list(self._agents.values())
        for agent in agents:
            self._evict(agent)
        return agents

    def take_unloads(self) -> list[str]:
        """Agent names of entries evicted since the last call, for the caller to remove from NIXL; a name an
        entry has loaded again since (the same decode rank back) is not among them."""
        names, self._unloads = self._unloads, []
        loaded = {a.loaded.agent_name for a in self._agents.values() if a.loaded is not None}
        return [n for n in dict.fromkeys(names) if n not in loaded]

    def _evict(self, agent: PushAgent) -> None:
        del self._agents[agent.identity]
        self._turn.remove(agent.identity)
        if agent.loaded is not None:
            self._unloads.append(agent.loaded.agent_name)
