"""A watchdog for a serving loop: when the loop stops turning, say so with every thread's stack.

A side-channel thread that stops answering is the start of every "fence
question timed out" and "push request unanswered" a decode engine reports,
and its cause is in another thread: a handler blocked on a lock, or the
engine thread holding the GIL (torch.compile at run time held one for tens of
seconds). :class:`StallWatchdog` is told each turn of the loop
(:meth:`StallWatchdog.beat`, an assignment); its own daemon thread looks every
quarter of ``stall_s`` and, once a turn is more than ``stall_s`` seconds late,
logs one WARNING with the stack of every thread of the process
(``sys._current_frames``), then one INFO line with the stall's length when the
loop turns again. A watchdog thread needs the GIL too, so a stall caused by a
thread that never releases it is reported when it ends, stacks included.

Python's ``faulthandler.dump_traceback_later`` does the same for one timer per
process and writes to a file descriptor; this one can run per loop and logs
through ``logging``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["StallWatchdog", "thread_stacks"]

logger = logging.getLogger("p2pkv.handshake")


def thread_stacks() -> str:
    """Every thread's current stack in this process, innermost call last, one block per thread (text)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f"thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "\n".join(blocks)


class StallWatchdog:
    """Logs a loop that has not turned for ``stall_s`` seconds, with every thread's stack.

    Args:
        what: the loop, as log lines name it (e.g. ``"the side channel on 127.0.0.1:5600"``).
        stall_s: seconds without a turn that make a stall (> 0).
        clock: monotonic clock in seconds (``time.monotonic``; tests pass a fake).

    Raises:
        ValueError: ``stall_s`` is not > 0.
    """

    def __init__(self, what: str, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0 seconds, got {stall_s}")
        self.what = what
        self.stall_s = stall_s
        self.stalls = 0
        """Stalls reported so far (count)."""
        self._clock = clock
        self._last = clock()
        self._reported_at: float | None = None  # the turn a reported stall is counted from
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The loop turned (call once per turn, from the loop's thread)."""
        self._last = self._clock()

    def check(self) -> str | None:
        """Look once, now: log a new stall (WARNING, with stacks) or the end of a reported one (INFO).

        Returns:
            ``"stalled"``, ``"resumed"`` or None (nothing to say).
        """
        last, now = self._last, self._clock()
        if self._reported_at is not None:
            if last == self._reported_at:
                return None  # still the stall already reported
            logger.info("p2pkv: %s turned again after %.1f s", self.what, last - self._reported_at)
            self._reported_at = None
            return "resumed"
        if now - last <= self.stall_s:
            return None
        self._reported_at = last
        self.stalls += 1
        logger.warning("p2pkv: %s has not turned for %.1f s (stall_s=%.1f): requests to it wait meanwhile; "
                       "every thread's stack:\n%s", self.what, now - last, self.stall_s, thread_stacks())
        return "stalled"

    def start(self) -> None:
        """Start looking every ``stall_s / 4`` seconds on a daemon thread."""
        self._last = self._clock()
        self._thread = threading.Thread(target=self._run, name="p2pkv-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop looking. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.stall_s / 4):
            try:
                self.check()
            except Exception:  # pragma: no cover - logging must never end the watchdog
                logger.exception("p2pkv: the watchdog of %s failed a check", self.what)
