"""Advancing pulls between engine steps, on a thread of their own.

vLLM calls the worker once per engine step; a pull advanced only then sees
its READ done, its fence answered and its KV handed over one step late each
time, and an engine step costs milliseconds when the engine waits on nothing
but KV (an empty step, then a 1 ms sleep in vLLM's busy loop). So while any
pull is in flight, a daemon thread polls them every ``interval_s``
(:data:`INTERVAL_S`, 0.2 ms), and side-channel answers wake it;
it sleeps on an event otherwise. The engine step still advances them too and
collects what finished.

Every access to the pulls holds :attr:`Progress.lock`. Work that must run
where vLLM runs its model (a staged READ's fixup kernels, on vLLM's CUDA
stream) is left to the engine step (:meth:`Progress.on_thread`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("p2pkv.decode")

INTERVAL_S = 0.0002
"""Poll interval (seconds) of a decode worker's pulls' thread while a pull is in flight (0: no thread). With
it a READ was seen done 12x sooner at concurrency 1 and the decode engine's own TTFT halved (84 against 156 ms;
docs/benchmarks/handover.md, "Pull thread off vs on"). The thread sleeps when nothing is in flight."""


class Progress:
    """Calls ``advance()`` (under :attr:`lock`) every ``interval_s`` while it returns True.

    A call that raises (anything) is logged; the thread lives on and calls
    again at the next :meth:`wake`.

    Args:
        advance: moves every pull as far as it can go now; returns True while
            any is still in flight (so polling goes on).
        name: the thread's name.
        interval_s: seconds between two calls while in flight; 0: no thread
            (only the engine step advances the pulls).
        on_start: called first on the thread (e.g. to make the KV cache's GPU current there).
        wait_s: the seconds to wait before the next call, asked after each call that returned True
            (default: ``interval_s``), so that what is in flight can set the pace.
    """

    def __init__(self, advance: Callable[[], bool], name: str, interval_s: float = INTERVAL_S,
                 on_start: Callable[[], None] | None = None, wait_s: Callable[[], float] | None = None) -> None:
        self.lock = threading.RLock()
        self._advance, self._interval_s, self._on_start = advance, interval_s, on_start
        self._wait_s = wait_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """New work: start polling (no-op while already polling)."""
        self._wake.set()

    @property
    def threaded(self) -> bool:
        """True when a thread polls (``interval_s`` > 0); else pulls advance only when the engine steps."""
        return self._thread is not None

    def on_thread(self) -> bool:
        """True when called on this thread (not on vLLM's engine thread)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:
                logger.exception("p2pkv: preparing the pulls' thread failed; pulls advance at engine steps only")
                return
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            active = True
            while active and not self._stop.is_set():
                try:
                    with self.lock:
                        active = self._advance()
                except BaseException:  # any exception of one call: the engine step advances the pulls as well
                    logger.exception("p2pkv: advancing the pulls between engine steps failed")
                    active = False
                if active:
                    self._stop.wait(self._interval_s if self._wait_s is None else self._wait_s())

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and wait for it (at most ``timeout_s`` seconds). Idempotent."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=timeout_s)
