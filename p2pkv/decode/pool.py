"""A bounded pool of threads that destinations share fairly.

A decode worker makes blocking side-channel calls (handshakes, releases,
fence questions) on behalf of requests whose destination anyone who reaches
its HTTP API chooses. One thread per call let a single request start
hundreds of threads (``tp_size`` 512 at an unreachable host); a plain
bounded pool instead lets one unreachable host hold every thread for a
timeout each, delaying calls to every other host. :class:`FairPool` bounds
both: at most ``max_threads`` threads in all, at most ``per_key`` calls of
one *key* (a destination) running at once, keys taking turns for a free
thread, and at most ``max_queued`` calls waiting per key (more are refused
at once).

The trade-off: a call waits when its key already runs ``per_key`` calls, or
when ``max_threads`` calls of other keys run. One unreachable destination
therefore delays only calls to itself; it takes ``max_threads / per_key``
unreachable destinations, each with calls queued, before calls to a good
destination wait for a thread (at most one call's timeout, since keys take
turns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("p2pkv.decode")

IDLE_EXIT_S = 30.0
"""A thread with nothing to run for this long (seconds) ends; the next call starts one again."""


class PoolFull(RuntimeError):
    """A call refused: its key already has ``max_queued`` calls waiting, or the pool is closed."""


@dataclass(eq=False)
class _Call:
    name: str
    fn: Callable[[], Any]
    future: Future


@dataclass(eq=False)
class _Key:
    queue: deque[_Call] = field(default_factory=deque)
    running: int = 0
    listed: bool = False  # in the pool's turn order (has a call that may start now)
    warned: bool = False  # a refusal was logged since the queue last emptied


class FairPool:
    """Runs calls on at most ``max_threads`` daemon threads, ``per_key`` at most per key, keys in turn.

    Args:
        name: thread name prefix (a running thread takes its call's name).
        max_threads: most threads at once (>= 1).
        per_key: most calls of one key running at once (>= 1; 1 runs a key's calls in order).
        max_queued: most calls of one key waiting; more fail at once with :class:`PoolFull`.
    """

    def __init__(self, name: str, max_threads: int, per_key: int, max_queued: int = 1024) -> None:
        if max_threads < 1 or per_key < 1 or max_queued < 1:
            raise ValueError(f"max_threads ({max_threads}), per_key ({per_key}) and max_queued ({max_queued}) "
                             "must be >= 1")
        self.name, self.max_threads, self.per_key, self.max_queued = name, max_threads, per_key, max_queued
        self._cv = threading.Condition()
        self._keys: dict[str, _Key] = {}
        self._turns: deque[str] = deque()  # keys with a call that may start now
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for a call
        self._wakeups = 0  # of those, woken for a call and not yet running
        self._closed = False
        self._spawned = 0

    def submit(self, key: str, name: str, fn: Callable[[], Any]) -> Future:
        """Queue ``fn()`` under ``key``; a Future with its result or exception.

        Never raises: a refused call (queue full, pool closed) is a Future
        holding :class:`PoolFull`.
        """
        future: Future = Future()
        with self._cv:
            k = self._keys.get(key)
            if self._closed or (k is not None and len(k.queue) >= self.max_queued):
                if k is not None and not k.warned and not self._closed:
                    k.warned = True
                    logger.warning("p2pkv: %d side-channel calls already wait for %s; refusing more (%s)",
                                   self.max_queued, key or "(unkeyed)", name)
                future.set_exception(PoolFull(f"{self.name}: closed" if self._closed else
                                              f"{self.name}: {self.max_queued} calls already wait for {key!r}"))
                return future
            if k is None:
                k = self._keys[key] = _Key()
            k.queue.append(_Call(name, fn, future))
            self._list(key, k)
            if k.running + len(k.queue) > self.per_key:
                pass  # starts when one of its key's calls ends
            elif self._idle > self._wakeups:
                self._wakeups += 1
                self._cv.notify()
            elif len(self._threads) < self.max_threads:
                self._spawned += 1
                thread = threading.Thread(target=self._work, name=f"{self.name}-{self._spawned}", daemon=True)
                self._threads.add(thread)
                thread.start()
        return future

    def close(self, timeout_s: float = 2.0) -> None:
        """Cancel every call not yet started and wait (``timeout_s`` seconds in all) for the threads. Idempotent.

        Calls already running must end by themselves (the caller's cancel event).
        """
        with self._cv:
            self._closed = True
            for k in self._keys.values():
                while k.queue:
                    k.queue.popleft().future.cancel()
            self._turns.clear()
            self._cv.notify_all()
            threads = list(self._threads)
        end = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, end - time.monotonic()))

    # ---- under self._cv --------------------------------------------------------------------
    def _list(self, key: str, k: _Key) -> None:
        if not k.listed and k.queue and k.running < self.per_key:
            k.listed = True
            self._turns.append(key)

    def _forget_if_empty(self, key: str, k: _Key) -> None:
        if not k.queue and not k.running:
            k.warned = False
            if not k.listed:
                self._keys.pop(key, None)

    def _take(self) -> tuple[str, _Key, _Call] | None:
        """The next call to run (keys in turn), or None."""
        while self._turns:
            key = self._turns.popleft()
            k = self._keys[key]
            k.listed = False
            while k.queue:
                call = k.queue.popleft()
                if call.future.set_running_or_notify_cancel():
                    k.running += 1
                    self._list(key, k)  # its next call waits for its next turn
                    return key, k, call
            self._forget_if_empty(key, k)
        return None

    # ---- the threads -------------------------------------------------------------------------
    def _work(self) -> None:
        me = threading.current_thread()
        own_name = me.name
        while True:
            with self._cv:
                taken = None if self._closed else self._take()
                timed_out = False
                while taken is None and not self._closed and not timed_out:
                    self._idle += 1
                    woken = self._cv.wait(IDLE_EXIT_S)
                    self._idle -= 1
                    self._wakeups = min(max(0, self._wakeups - 1) if woken else self._wakeups, self._idle)
                    timed_out = not woken
                    taken = None if self._closed else self._take()
                if taken is None:
                    self._threads.discard(me)
                    return
            key, k, call = taken
            me.name = call.name
            try:
                call.future.set_result(call.fn())
            except BaseException as exc:  # delivered to whoever reads the Future
                call.future.set_exception(exc)
            finally:
                me.name = own_name
                with self._cv:
                    k.running -= 1
                    self._list(key, k)
                    self._forget_if_empty(key, k)

