"""A prefill rank's layer streams, run on its WRITE thread, so the forward only queues.

Posting a WRITE costs the calling thread: NIXL builds the descriptor lists,
and UCX posts every descriptor (a ``cuda_ipc`` copy per row) or, over
``tcp``, sends the bytes as its worker progresses. Measured on an H200
(docs/benchmarks/stream-h200.md), a forward whose own thread posted each
layer's WRITEs ran up to 77 % longer over ``cuda_ipc`` with a cross-layer
cache, and 20 times longer over ``tcp``: the host fell behind in launching
the layers' kernels. :class:`StreamPoster` takes the forward's calls
(:meth:`~StreamPoster.computed` and the rest) as queued operations; in its
turns on the rank's WRITE thread (:class:`p2pkv.prefill.write_engine.WriteEngine`,
which push's WRITEs share, and which progresses the agent) it applies them and
pumps every :class:`~p2pkv.prefill.layer_stream.LayerStream`.

A request read by several decode ranks (a decode engine of a larger TP size)
has a stream per destination under one key: the first is added
(:meth:`~StreamPoster.add`), each further one forked from it
(:meth:`~StreamPoster.fork`), which replays the layers computed so far into
it; every later call under the key goes to all of them.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv.prefill.layer_stream import LayerStream, StreamTarget
from p2pkv.prefill.write_engine import Pace, WriteEngine

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    """The streams of one key: the first (given the first destination by ``target``) and its forks, with the calls
    made so far (a fork replays them) and whether the key is kept once they have ended."""

    streams: list[LayerStream]
    keep: bool = False
    computed: list[tuple[Any, ...]] = field(default_factory=list)
    finished: bool = False
    aborted: str | None = None
    running: int = 1


class StreamPoster:
    """Layer streams keyed by request id, run on the WRITE engine's thread; every method is thread-safe and never
    blocks on NIXL.

    Args:
        engine: this rank's WRITE engine; the poster takes turns on its thread from now on (:meth:`turn`).
    """

    def __init__(self, engine: WriteEngine) -> None:
        self.engine = engine
        self._ops: queue.SimpleQueue[tuple[str, str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._groups: dict[str, _Group] = {}
        self._ended: queue.SimpleQueue[LayerStream] = queue.SimpleQueue()
        engine.attach(self)

    def add(self, key: str, stream: LayerStream, keep: bool = False) -> None:
        """Run ``stream`` under ``key`` (a request id). Streams already running under ``key`` are aborted, and
        still handed back by :meth:`take_ended` once no WRITE of them can write. ``keep``: the key stays (for
        :meth:`fork`) after its streams have ended, until :meth:`drop`."""
        self._put("add", key, stream, keep)

    def fork(self, key: str, stream: LayerStream, target: StreamTarget) -> None:
        """Run ``stream`` under ``key`` beside its streams: every layer computed so far is replayed into it (and
        :meth:`finish` or :meth:`abort`, if called), then it gets ``target``. An unknown key aborts it."""
        self._put("fork", key, stream, target)

    def drop(self, key: str) -> None:
        """Forget a kept ``key`` (its streams have ended)."""
        self._put("drop", key)

    def computed(self, key: str, layer: int, first_block: int, source_ids: Sequence[int],
                 ready: Callable[[], bool] | None = None, group: int = 0) -> None:
        """:meth:`LayerStream.computed` of ``key``'s stream (ignored for an unknown key)."""
        self._put("computed", key, layer, first_block, tuple(source_ids), ready, group)

    def target(self, key: str, target: StreamTarget) -> None:
        """:meth:`LayerStream.target` of ``key``'s stream."""
        self._put("target", key, target)

    def restart(self, key: str) -> None:
        """:meth:`LayerStream.restart` of ``key``'s streams (its request was preempted); a later fork replays only
        the layers computed from then on."""
        self._put("restart", key)

    def finish(self, key: str) -> None:
        """:meth:`LayerStream.finish` of ``key``'s stream."""
        self._put("finish", key)

    def abort(self, key: str, reason: str) -> None:
        """:meth:`LayerStream.abort` of ``key``'s streams."""
        self._put("abort", key, reason)

    def abort_one(self, key: str, agent: str, reason: str) -> None:
        """:meth:`LayerStream.abort` of the stream of ``key`` whose destination is decode agent ``agent``."""
        self._put("abort_one", key, agent, reason)

    def take_ended(self) -> list[LayerStream]:
        """The streams that have ended since the last call (their source blocks may be freed now)."""
        out = []
        while True:
            try:
                out.append(self._ended.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 2.0) -> None:
        """Close the WRITE engine (:meth:`p2pkv.prefill.write_engine.WriteEngine.close`): every stream still
        running is aborted, and the engine stops once they have ended (or ``timeout_s``). Idempotent."""
        self.engine.close(timeout_s)

    def _put(self, op: str, key: str, *args: Any) -> None:
        self._ops.put((op, key, args))
        self.engine.wake()

    def _apply(self) -> None:
        while True:
            try:
                op, key, args = self._ops.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                old = self._groups.pop(key, None)
                if old is not None:  # still pumped until they have ended, then handed back like any other
                    for stream in old.streams:
                        stream.abort("replaced by a new stream of the same request")
                    self._groups[f"{key} (replaced #{id(old)})"] = old
                self._groups[key] = _Group([args[0]], keep=args[1])
                continue
            group = self._groups.get(key)
            if op == "fork" and group is None:  # handed back, ended, like any other
                args[0].abort("its request's streams ended before this destination came")
                self._groups[f"{key} (unknown #{id(args[0])})"] = _Group([args[0]])
            elif op == "fork":
                self._fork(group, *args)
            elif op == "drop" and group is not None:
                if group.running:  # gone once its streams have ended
                    group.keep = False
                else:
                    del self._groups[key]
            elif group is not None:
                self._call(key, group, op, args)

    @staticmethod
    def _call(key: str, group: _Group, op: str, args: tuple[Any, ...]) -> None:
        """``op`` of a key: ``target`` to its first stream, ``abort_one`` to the stream bound for one agent, the
        rest to every stream (and remembered for a later fork)."""
        if op == "computed":
            group.computed.append(args)
        elif op == "restart":
            group.computed.clear()
        elif op == "finish":
            group.finished = True
        elif op == "abort":
            group.aborted = args[0]
        if op == "target":
            streams = group.streams[:1]
        elif op == "abort_one":
            streams, args = [s for s in group.streams if s.agent == args[0]], args[1:]
            op = "abort"
        else:
            streams = group.streams
        for stream in streams:
            try:
                getattr(stream, op)(*args)
            except ValueError as exc:  # a second destination: the first one stays
                logger.warning("p2pkv: stream of request %s: %s", key, exc)

    @staticmethod
    def _fork(group: _Group, stream: LayerStream, target: StreamTarget) -> None:
        """Replay ``group``'s calls into ``stream``, give it ``target`` and run it beside the group's streams."""
        group.streams.append(stream)
        group.running += 1
        for args in group.computed:
            stream.computed(*args)
        if group.finished:
            stream.finish()
        if group.aborted is not None:
            stream.abort(group.aborted)
            return
        try:
            stream.target(target)
        except ValueError as exc:
            stream.abort(str(exc))

    def turn(self, now: float, stopping: bool) -> Pace:
        """Apply the calls queued since the last turn, pump every stream (``stopping``: abort them first), and
        hand back the ones that have ended. :attr:`Pace.URGENT` while a stream is urgent
        (:attr:`LayerStream.urgent`), :attr:`Pace.WRITING` while streams only have WRITEs in flight,
        :attr:`Pace.IDLE` otherwise (a stream waiting for its destination is woken by that call)."""
        self._apply()
        if stopping:
            for group in self._groups.values():
                for stream in group.streams:
                    stream.abort("the prefill rank is shutting down")
        busy = urgent = False
        for key, group in list(self._groups.items()):
            for stream in group.streams:
                if stream.handed_back:
                    continue
                if stream.pump():
                    busy = busy or stream.busy  # one waiting for its destination is woken by that call
                    urgent = urgent or stream.urgent
                else:
                    stream.handed_back = True
                    group.running -= 1
                    self._ended.put(stream)
                    self.engine.linger()  # its last word goes out as NIXL progresses
            if not group.running and not (group.keep and not stopping):
                del self._groups[key]
        if urgent:
            return Pace.URGENT
        if busy:
            return Pace.WRITING
        return Pace.IDLE

    def drop_all(self) -> None:
        """After the WRITE thread has stopped: nothing left to drop (a stream's source blocks are its caller's,
        freed by :meth:`take_ended`)."""
