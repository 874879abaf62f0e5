"""Side-channel calls of a decode worker, each on its own daemon thread, cancellable as a whole."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Background:
    """Runs blocking side-channel calls (handshakes, fence confirmations) off the engine thread.

    Every call gets ``cancel=`` :attr:`stop`, so :meth:`close` ends it within
    the side channel's poll interval (about 0.1 s). One thread per call (an
    unreachable peer never delays calls to the others), or, with ``lane=``,
    one long-lived thread per lane running its calls in order (no thread
    start per call).

    Args:
        on_done: called (on the call's thread) when any call ends, e.g. to wake
            whoever waits for the answers.
    """

    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self.stop = threading.Event()
        self._on_done = on_done
        self._threads: list[threading.Thread] = []
        self._lanes: dict[str, ThreadPoolExecutor] = {}

    def call(self, name: str, fn: Callable[..., Any], *args: Any, lane: str | None = None, **kwargs: Any) -> Future:
        """Start ``fn(*args, cancel=self.stop, **kwargs)`` on a daemon thread named ``name`` (or on ``lane``'s).

        Returns:
            A Future holding the result, or the exception ``fn`` raised.
        """
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, cancel=self.stop, **kwargs))
            except BaseException as exc:  # delivered to the step that polls the future
                future.set_exception(exc)
            if self._on_done is not None:
                self._on_done()

        if lane is not None:
            if lane not in self._lanes:
                self._lanes[lane] = ThreadPoolExecutor(1, thread_name_prefix=name)
            self._lanes[lane].submit(run)
            return future
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return future

    def close(self, timeout_s: float = 2.0) -> None:
        """Cancel every call and join its thread (at most ``timeout_s`` seconds each). Idempotent."""
        self.stop.set()
        for pool in self._lanes.values():
            pool.shutdown(wait=True, cancel_futures=True)
        self._lanes.clear()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        self._threads.clear()
