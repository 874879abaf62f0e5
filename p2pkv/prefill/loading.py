"""Push mode, prefill side: loading decode ranks' NIXL metadata into this rank's agent, and removing it.

A :class:`p2pkv.prefill.pusher.Pusher` WRITEs only into decode agents NIXL
holds. :class:`DecodeAgentLoader` is the one place that adds them
(``add_peer``), replaces them (a restarted decode worker: a new agent name)
and removes the ones :class:`p2pkv.prefill.agents.PushAgents` evicted
(``remove_peer``). Both the side-channel thread (a decode rank's first
request, so NIXL's refusal is the reply) and the pusher thread (a reload
before a WRITE) load; loads and removals are serialised by one lock of their
own (taken before the pusher's state lock, never inside it), so a name is
never removed while it is being loaded again.
"""

from __future__ import annotations

import threading

from handshake import AgentInfo
from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.prefill.agents import PushAgent, PushAgents

__all__ = ["SWEEP_S", "DecodeAgentLoader", "same_agent"]

SWEEP_S = 0.05
"""How often (seconds, on the pusher's clock) the pusher thread looks for idle decode ranks to unload."""


class DecodeAgentLoader:
    """Adds, replaces and removes the decode agents a prefill rank WRITEs into.

    Args:
        nixl: this rank's NIXL agent.
        agents: the pusher's decode-rank table (bookkeeping only).
        state_lock: the pusher's lock over ``agents`` and its entries; held only around reads and writes of
            them, never around a NIXL call.

    Attributes:
        unloaded: decode agents removed from NIXL so far (count).
    """

    def __init__(self, nixl: NixlTransferAgent, agents: PushAgents, state_lock: threading.Lock) -> None:
        self.nixl = nixl
        self.unloaded = 0
        self._agents = agents
        self._state = state_lock
        self._lock = threading.Lock()  # loads and removals of decode agents (both threads); before the state lock
        self._next_sweep = float("-inf")

    def sweep(self, now: float) -> None:
        """Evict idle (or broken) decode ranks every :data:`SWEEP_S` seconds (``now``: the pusher's clock),
        then remove every evicted one's agent from NIXL."""
        with self._state:
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_S
                self._agents.evict_idle()
        self.remove_evicted()

    def remove_evicted(self) -> None:
        """Remove the evicted decode agents from NIXL (they have nothing in flight)."""
        with self._lock:
            self._remove_evicted()

    def load(self, agent: PushAgent, info: AgentInfo) -> tuple[bool | None, str]:
        """Make NIXL hold ``info``'s metadata for ``agent`` (evicted agents removed first).

        Returns:
            ``(True, "")`` when it does; ``(None, "")`` when a WRITE to the agent's current metadata is still
            in flight (load again only after it); ``(False, why)`` when NIXL refused it (``agent.loaded`` is
            then None). Never raises for NIXL's refusal.
        """
        if same_agent(agent.loaded, info):
            return True, ""
        with self._state:
            if agent.in_flight:
                return None, ""
        with self._lock:
            self._remove_evicted()
            loaded = agent.loaded
            if loaded is not None and loaded.agent_name != info.agent_name:  # a restarted decode worker
                self.nixl.remove_peer(loaded.agent_name, "decode")
                with self._state:
                    agent.loaded = None
            try:
                self.nixl.add_peer(info, "decode")
            except Exception as exc:
                self.nixl.remove_peer(info.agent_name, "decode")
                with self._state:
                    agent.loaded = None
                return False, f"agent: {exc}"
            with self._state:
                agent.loaded = info
        return True, ""

    def _remove_evicted(self) -> None:
        """:meth:`remove_evicted` with the loader's lock held, so no load of the same name runs meanwhile (a
        name an entry has loaded again is kept)."""
        with self._state:
            names = self._agents.take_unloads()
            self.unloaded += len(names)
        for name in names:
            self.nixl.remove_peer(name, "decode")


def same_agent(loaded: AgentInfo | None, info: AgentInfo) -> bool:
    """``loaded`` is ``info``'s agent with the same metadata (agent name and metadata digest)."""
    return loaded is not None and (loaded.agent_name, loaded.metadata_digest) == (info.agent_name,
                                                                                 info.metadata_digest)
