"""NIXL notifications sorted by prefix, for the readers that share one agent.

NIXL hands a agent's notifications over all at once (``get_new_notifs``:
remote agent name → messages), and reading them also progresses the agent's
workers. Two readers share a decode worker's agent (its pulls thread takes
the "pushed" notifications, its engine thread the rest), so what NIXL hands
over is sorted into one inbox per prefix asked for; each reader takes its
own. A liveness probe's notification (:data:`ALIVE_PREFIX`,
:meth:`p2pkv.dataplane.agent.NixlTransferAgent.reachable`) is dropped on
arrival: it says nothing but that its sender could send it. No I/O but the
fetch it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

ALIVE_PREFIX = b"p2pkv:alive:"
"""The notification a liveness probe sends; its receiver drops it."""

Fetch = Callable[[], dict[str, list[bytes]]]
"""What NIXL received since the last call (``nixl_agent.get_new_notifs``): remote agent name → messages."""


class Inboxes:
    """Per-prefix inboxes of one agent's notifications. Thread-safe.

    Args:
        fetch: takes what NIXL received since its last call (and progresses the agent's workers).
    """

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._lock = threading.Lock()
        self._inbox: dict[bytes, list[bytes]] = {b"": []}  # prefix → notifications not yet taken

    def take(self, prefix: bytes) -> list[bytes]:
        """Notifications starting with ``prefix`` received since the last call (``b""``: those no other prefix
        asked for takes). A prefix is known, and its notifications kept apart, once it has been asked for."""
        with self._lock:
            self._inbox.setdefault(prefix, [])
            self._sort()
            out, self._inbox[prefix] = self._inbox[prefix], []
        return out

    def progress(self) -> None:
        """Fetch (progressing NIXL's workers) and sort, taking nothing."""
        with self._lock:
            self._sort()

    def _sort(self) -> None:
        for msgs in self._fetch().values():
            for msg in msgs:
                if msg.startswith(ALIVE_PREFIX):
                    continue
                key = next((p for p in self._inbox if p and msg.startswith(p)), b"")
                self._inbox[key].append(msg)
