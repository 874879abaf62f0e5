"""Which remote agents one NIXL agent holds, why, and loading or removing them under one lock.

A worker loads a remote agent's metadata into NIXL for a reason (a
:data:`PeerRole`): the ``prefill`` rank its decode side pulls from (or asks to
push), or the ``decode`` rank its prefill side pushes to. An engine with
``role: both`` does both, from different threads (the decode side's progress
thread, the prefill side's side-channel and pusher threads), possibly for the
same remote agent under its two roles. The agent leaves NIXL when no role
needs it any more, and a load for one role must never be undone by the other
role's removal running at the same moment: every load, removal and look at
the table holds one lock (NIXL's own calls included), taken after any lock of
the callers and never before one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from handshake import AgentInfo

logger = logging.getLogger("p2pkv.dataplane")

PeerRole = Literal["prefill", "decode"]
"""Why a worker loaded a remote agent: a ``prefill`` rank it pulls from (or asks to push), or a ``decode`` rank
that asked it to push. One remote agent may be both (engines with ``role: both``); it leaves NIXL when neither
needs it any more."""


class WrongAgentName(ValueError):
    """NIXL read another agent name from a peer's metadata than the peer declared."""


class RemoteAgents:
    """The remote agents a NIXL agent holds: name → the digest of the metadata loaded, and the roles needing it.

    Args:
        load: NIXL's ``add_remote_agent`` (metadata bytes → the agent name it read from them; raises on refusal).
        unload: NIXL's ``remove_remote_agent`` (agent name; may raise, which is logged).
    """

    def __init__(self, load: Callable[[bytes], str | bytes], unload: Callable[[str], object]) -> None:
        self._load, self._unload = load, unload
        self._digests: dict[str, bytes] = {}
        self._roles: dict[str, set[PeerRole]] = {}
        self._lock = threading.Lock()

    def add(self, info: AgentInfo, role: PeerRole) -> str:
        """Load ``info``'s metadata for ``role`` unless the same metadata is loaded (then only ``role`` is added).

        Returns:
            The remote agent name.

        Raises:
            WrongAgentName: NIXL read another agent name from the metadata than ``info`` declares (nothing loaded).
            Exception: whatever ``load`` raised (NIXL refused the metadata).
        """
        with self._lock:
            if self._digests.get(info.agent_name) == info.metadata_digest:
                self._roles.setdefault(info.agent_name, set()).add(role)
                return info.agent_name  # known, same metadata (a new digest: it registered more memory, reloaded)
            loaded = self._load(info.agent_metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != info.agent_name:  # checked by the caller; only a NIXL that reads metadata otherwise
                if name not in self._digests:
                    self._unload(name)
                raise WrongAgentName(f"peer metadata names agent {name!r} but the side channel said "
                                 f"{info.agent_name!r}")
            self._digests[name] = info.metadata_digest
            self._roles.setdefault(name, set()).add(role)
            return name

    def remove(self, name: str, role: PeerRole) -> bool:
        """``role`` no longer needs ``name``; NIXL removes it once no role does. Idempotent.

        Returns:
            True when this call removed it from NIXL (no role needs it any more).
        """
        with self._lock:
            roles = self._roles.get(name)
            if roles is not None:
                roles.discard(role)
                if roles:
                    return False
                del self._roles[name]
            if self._digests.pop(name, None) is None:
                return False
            try:
                self._unload(name)
            except Exception as exc:
                logger.warning("p2pkv: remove_remote_agent(%s) failed: %s", name, exc)
            return True

    def names(self, role: PeerRole | None = None) -> list[str]:
        """The remote agents loaded now (for ``role`` only, when given)."""
        with self._lock:
            return [n for n in self._digests if role is None or role in self._roles.get(n, ())]

    def clear(self) -> None:
        """Remove every remote agent from NIXL, whatever needed it (the local agent is closing)."""
        with self._lock:
            names = list(self._digests)
            self._roles.clear()
        for name in names:
            self.remove(name, "prefill")
