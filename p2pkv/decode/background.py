"""Side-channel calls of a decode worker, on bounded thread pools, cancellable as a whole."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from p2pkv.decode.pool import FairPool

logger = logging.getLogger("p2pkv.decode")

CALL_THREADS = 16
"""Most threads running one-off calls (handshakes, releases) at once."""
CALLS_PER_HOST = 4
"""Most one-off calls to one destination (``key``) running at once."""
LANE_THREADS = 16
"""Most threads running lane calls (fence questions) at once."""
MAX_QUEUED = 1024
"""Most calls waiting per destination or lane; more fail at once (:class:`p2pkv.decode.pool.PoolFull`)."""
FLUSH_S = 0.5
"""Seconds :meth:`Background.close` gives the calls queued with ``flush=True`` (releases of prefill holds) before
it cancels them: a worker stopped right after a failed pull still frees that pull's hold at once, unless the prefill
rank is slow to answer (its lease frees it then)."""


Pending = TypeVar("Pending", bound=tuple)


def take_done(pending: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """Split ``pending`` (tuples whose first item is a call's :class:`Future`) into ``(done, still pending)``.

    Each future is asked once: its call runs on another thread, so one that
    ends between two passes over the list (one for the done, one for the
    rest) would land in neither and its answer be lost.
    """
    done: list[Pending] = []
    rest: list[Pending] = []
    for item in pending:
        (done if item[0].done() else rest).append(item)
    return done, rest


class Background:
    """Runs blocking side-channel calls (handshakes, releases, fence questions) off the engine thread.

    Every call gets ``cancel=`` :attr:`stop`, so :meth:`close` ends it within
    the side channel's poll interval (about 0.1 s), after giving the calls
    queued with ``flush=True`` up to :data:`FLUSH_S` to end. One-off calls share a pool
    of at most ``call_threads`` threads, at most ``per_key`` of them for one
    ``key`` (a destination host): an unreachable host delays only the calls to
    itself until ``call_threads / per_key`` such hosts have calls queued (see
    :mod:`p2pkv.decode.pool` for the trade-off). Calls with ``lane=`` run in
    order, one at a time per lane, on a second pool of at most ``lane_threads``
    threads; a lane holds nothing once its calls have ended.

    Args:
        on_done: called (on the call's thread) when any call ends, e.g. to wake
            whoever waits for the answers.
        call_threads / per_key / lane_threads / max_queued: the pools' bounds
            (defaults :data:`CALL_THREADS`, :data:`CALLS_PER_HOST`,
            :data:`LANE_THREADS`, :data:`MAX_QUEUED`).
    """

    def __init__(self, on_done: Callable[[], None] | None = None, *, call_threads: int = CALL_THREADS,
                 per_key: int = CALLS_PER_HOST, lane_threads: int = LANE_THREADS,
                 max_queued: int = MAX_QUEUED) -> None:
        self.stop = threading.Event()
        self._on_done = on_done
        self._calls = FairPool("p2pkv-calls", call_threads, per_key, max_queued)
        self._lanes = FairPool("p2pkv-lanes", lane_threads, 1, max_queued)
        self._flushed: set[Future] = set()
        self._flushed_lock = threading.Lock()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, lane: str | None = None, key: str | None = None,
             flush: bool = False, **kwargs: Any) -> Future:
        """Queue ``fn(*args, cancel=self.stop, **kwargs)``; the thread running it is named ``name``.

        Args:
            name: the call's name (its thread's while it runs).
            fn: the blocking call; must return soon after ``cancel`` is set.
            lane: run in order after the lane's earlier calls (one at a time).
            key: the destination (host) the call goes to, for the per-host bound;
                None: one shared key for every call without one.
            flush: :meth:`close` waits for it (at most ``flush_s``) before it cancels the calls.

        Returns:
            A Future holding the result, or the exception ``fn`` raised, or
            :class:`p2pkv.decode.pool.PoolFull` (too many calls queued, or closed);
            cancelled when :meth:`close` came first.
        """
        def run() -> Any:
            return fn(*args, cancel=self.stop, **kwargs)

        pool, k = (self._lanes, lane) if lane is not None else (self._calls, key or "")
        future = pool.submit(k, name, run)
        if flush:
            with self._flushed_lock:
                self._flushed.add(future)
            future.add_done_callback(self._unflush)
        if self._on_done is not None:
            future.add_done_callback(self._done)
        return future

    def _unflush(self, future: Future) -> None:
        with self._flushed_lock:
            self._flushed.discard(future)

    def _done(self, _: Future) -> None:
        try:
            self._on_done()  # type: ignore[misc]
        except Exception:
            logger.exception("p2pkv: a side-channel call's completion hook failed")

    def close(self, timeout_s: float = 2.0, flush_s: float = FLUSH_S) -> None:
        """Give the calls queued with ``flush=True`` up to ``flush_s`` seconds to end, then cancel every call and
        wait for the threads (at most ``timeout_s`` seconds more in all). Idempotent."""
        with self._flushed_lock:
            flushed = set(self._flushed)
        if flushed and not self.stop.is_set():
            wait(flushed, timeout=flush_s)
        self.stop.set()
        end = time.monotonic() + timeout_s
        for pool in (self._calls, self._lanes):
            pool.close(0.0)  # nothing queued starts any more
        for pool in (self._calls, self._lanes):
            pool.close(max(0.0, end - time.monotonic()))
