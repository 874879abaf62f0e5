"""The thread that runs a prefill rank's layer streams, so the forward only queues.

Posting a WRITE costs the calling thread: NIXL builds the descriptor lists,
and UCX posts every descriptor (a ``cuda_ipc`` copy per row) or, over
``tcp``, sends the bytes as its worker progresses. Measured on an H200
(docs/benchmarks/stream-h200.md), a forward whose own thread posted each
layer's WRITEs ran up to 77 % longer over ``cuda_ipc`` with a cross-layer
cache, and 20 times longer over ``tcp``: the host fell behind in launching
the layers' kernels. :class:`StreamPoster` takes the forward's calls
(:meth:`~StreamPoster.computed` and the rest) as queued operations and
applies them, pumps every :class:`~p2pkv.prefill.streamer.LayerStream` and
progresses the agent on a thread of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from p2pkv.prefill.streamer import LayerStream, StreamTarget

logger = logging.getLogger(__name__)

POLL_S = 0.0002
"""How long the thread sleeps between turns while a stream is busy (:attr:`LayerStream.busy`; seconds);
otherwise it sleeps until the next call, or 50 ms."""
LINGER_S = 0.05
"""How long the thread keeps turning at :data:`POLL_S` after a stream ended: NIXL sends the stream's last
notification while the agent's worker progresses (seconds)."""


class StreamPoster:
    """Layer streams keyed by request id, run on one thread; every method is thread-safe and never blocks on NIXL.

    Args:
        progress: progresses the rank's NIXL agent (its notifications go out as it progresses).
        poll_s: sleep between turns while a stream has work left (seconds).
    """

    def __init__(self, progress: Callable[[], None], poll_s: float = POLL_S) -> None:
        self._progress = progress
        self._poll_s = poll_s
        self._ops: queue.SimpleQueue[tuple[str, str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, LayerStream] = {}
        self._ended: queue.SimpleQueue[LayerStream] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2pkv-stream-poster", daemon=True)
        self._thread.start()

    def add(self, key: str, stream: LayerStream) -> None:
        """Run ``stream`` under ``key`` (a request id). A stream already running under ``key`` is aborted, and
        still handed back by :meth:`take_ended` once no WRITE of it can write."""
        self._put("add", key, stream)

    def computed(self, key: str, layer: int, first_block: int, source_ids: Sequence[int],
                 ready: Callable[[], bool] | None = None) -> None:
        """:meth:`LayerStream.computed` of ``key``'s stream (ignored for an unknown key)."""
        self._put("computed", key, layer, first_block, tuple(source_ids), ready)

    def target(self, key: str, target: StreamTarget) -> None:
        """:meth:`LayerStream.target` of ``key``'s stream."""
        self._put("target", key, target)

    def finish(self, key: str) -> None:
        """:meth:`LayerStream.finish` of ``key``'s stream."""
        self._put("finish", key)

    def abort(self, key: str, reason: str) -> None:
        """:meth:`LayerStream.abort` of ``key``'s stream."""
        self._put("abort", key, reason)

    def take_ended(self) -> list[LayerStream]:
        """The streams that have ended since the last call (their source blocks may be freed now)."""
        out = []
        while True:
            try:
                out.append(self._ended.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 2.0) -> None:
        """Abort every stream still running, and stop the thread once they have ended (or ``timeout_s``)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _put(self, op: str, key: str, *args: Any) -> None:
        self._ops.put((op, key, args))
        self._wake.set()

    def _apply(self) -> None:
        while True:
            try:
                op, key, args = self._ops.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                old = self._streams.pop(key, None)
                if old is not None:  # still pumped until it has ended, then handed back like any other
                    old.abort("replaced by a new stream of the same request")
                    self._streams[f"{key} (replaced #{id(old)})"] = old
                self._streams[key] = args[0]
                continue
            stream = self._streams.get(key)
            if stream is None:
                continue
            try:
                getattr(stream, op)(*args)
            except ValueError as exc:  # a second destination: the first one stays
                logger.warning("p2pkv: stream of request %s: %s", key, exc)

    def _run(self) -> None:
        linger = 0.0
        while True:
            self._wake.clear()
            stopping = self._stop.is_set()  # read before the queue: every call made before close() is in it
            self._apply()
            if stopping:
                for stream in self._streams.values():
                    stream.abort("the prefill rank is shutting down")
            busy = False
            for key, stream in list(self._streams.items()):
                if stream.pump():
                    busy = busy or stream.busy  # one waiting for its destination is woken by that call
                else:
                    del self._streams[key]
                    self._ended.put(stream)
                    linger = time.monotonic() + LINGER_S
            try:
                self._progress()
            except Exception as exc:  # a progress that fails must not end the thread
                logger.debug("p2pkv: stream poster: progress failed: %s", exc)
            if stopping and not busy:
                return
            self._wake.wait(self._poll_s if busy or time.monotonic() < linger else 0.05)
