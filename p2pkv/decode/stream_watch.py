"""Is the prefill rank of a layer stream still the one that took its destination?

A stream may wait for its notification as long as its prefill runs
(``stream_timeout_s``, up to an hour). If the prefill process dies mid-way,
no notification ever comes, and the decode rank cannot give the blocks back
before the window passes: a prefill rank that is only slow could still WRITE
into them. What ends the wait early is proof that no WRITE can come: every
:data:`PROBE_EVERY_S` seconds the decode rank asks the prefill rank that
accepted the stream (a :class:`handshake.HoldQuery` naming the stream id,
on the rank's lane) whether it knows the stream. A prefill rank keeps every
stream id it took a destination for until the grant has expired
(:meth:`p2pkv.prefill.streams.PrefillStreams.on_heartbeat`), so ``unknown``
comes only from a process that never took it: a new incarnation listening
on the same port (the old one's socket is closed, so it is gone), or a
rank whose stream has long ended. Either way nothing WRITEs into the
blocks any more, and the load fails at once (its failure policy applies).
No reply, or a refused connection, proves nothing: the stream waits on, as
before, for its notification or its window.
"""

from __future__ import annotations

from concurrent.futures import Future

from handshake import HoldsReply, query_holds
from p2pkv.decode.background import Background, take_done
from p2pkv.decode.fence import FENCE_EXTEND_S, Fence
from p2pkv.decode.peers import PeerId
from p2pkv.decode.transfer import Part

PROBE_EVERY_S = 2.0
"""How often (seconds) a stream waiting for its notification asks its prefill rank whether it knows it."""

GONE = ("the prefill rank no longer knows the stream: it restarted (or the stream ended long ago) before the "
        "stream's notification came; no WRITE can come any more")
"""The failure of a stream whose prefill rank answered ``unknown``."""


class StreamWatch:
    """Probes the prefill ranks of streams waiting for their notification.

    Args:
        background: where the side-channel calls run (on each prefill rank's lane).
        fence: owns the long-lived connection to each prefill rank.
        engine_id: this (decode) engine's id (the question's requester).
        secret: side-channel secret, or None.
        timeout_s: wait for each reply (seconds).
        every_s: seconds between two questions about one stream.
    """

    def __init__(self, background: Background, fence: Fence, engine_id: str, secret: bytes | None,
                 timeout_s: float, every_s: float = PROBE_EVERY_S) -> None:
        self.background = background
        self.fence = fence
        self.engine_id = engine_id
        self.secret = secret
        self.timeout_s = timeout_s
        self.every_s = every_s
        self._asked: dict[bytes, float] = {}  # push id → time.monotonic() of its last question
        self._questions: list[tuple[Future, list[Part]]] = []  # one question per prefill rank, its parts

    def ask(self, waiting: list[Part], now: float) -> None:
        """Ask about each of ``waiting`` (accepted streams not yet notified) whose last question is
        :attr:`every_s` old and answered (the first :attr:`every_s` after ``pushed_at``): one question per
        prefill rank, naming all of its due streams."""
        busy = {part.push_id for _, parts in self._questions for part in parts}
        live = {part.push_id for part in waiting}
        self._asked = {pid: t for pid, t in self._asked.items() if pid in live}
        due: dict[PeerId, list[Part]] = {}
        for part in waiting:
            if part.push_id not in busy and now - self._asked.get(part.push_id, part.pushed_at) >= self.every_s:
                self._asked[part.push_id] = now
                due.setdefault(part.peer_id, []).append(part)
        for pid, parts in due.items():
            future = self.background.call(
                f"p2pkv-stream-probe-{pid.host}:{pid.port}", query_holds, pid.destination,
                [part.transfer.spec.remote.request_id for part in parts], [[] for _ in parts], self.engine_id,
                FENCE_EXTEND_S, secret=self.secret, timeout_s=self.timeout_s,
                link=self.fence.link(pid.host, pid.port), lane=f"{pid.host}:{pid.port}")
            self._questions.append((future, parts))

    def gone(self) -> list[Part]:
        """The parts whose prefill rank answered that it does not know their stream (since the last call)."""
        done, self._questions = take_done(self._questions)
        out = []
        for future, parts in done:
            if future.cancelled() or future.exception() is not None:
                continue  # no answer proves nothing
            reply: HoldsReply = future.result()
            unknown = set(reply.unknown)
            out += [part for part in parts if part.transfer.spec.remote.request_id in unknown]
        return out
