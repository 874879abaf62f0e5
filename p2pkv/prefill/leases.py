"""Prefill-side leases on held blocks, in an expiry-ordered heap.

A finished prefill request's blocks are held for a decode engine until the
first of: its completion notification, or its lease deadline. The heap
keeps every lease in deadline order, so one long-lived lease never hides
expired ones behind it (no head-of-line stranding); extending or releasing
a lease leaves a stale heap entry that is skipped when it surfaces.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable


class LeaseTable:
    """Request id → deadline (seconds on ``clock``), released exactly once.

    Args:
        clock: monotonic clock in seconds (``time.monotonic``; tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deadline: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deadline

    def hold(self, request_id: str, deadline: float) -> None:
        """Hold ``request_id`` until ``deadline`` (a later deadline extends, never shortens)."""
        if deadline <= self._deadline.get(request_id, float("-inf")):
            return
        self._deadline[request_id] = deadline
        heapq.heappush(self._heap, (deadline, request_id))

    def extend(self, request_id: str, seconds: float) -> bool:
        """Push a held lease to ``now + seconds``; False when it is not held (any more)."""
        if request_id not in self._deadline:
            return False
        self.hold(request_id, self._clock() + seconds)
        return True

    def release(self, request_id: str) -> bool:
        """End a lease early (notification arrived); True only the first time."""
        return self._deadline.pop(request_id, None) is not None

    def pop_expired(self) -> list[str]:
        """Every lease whose deadline has passed, earliest first, each returned once."""
        now = self._clock()
        out: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, request_id = heapq.heappop(self._heap)
            if self._deadline.get(request_id) == deadline:
                del self._deadline[request_id]
                out.append(request_id)
        return out
