"""Is the prefill rank of a push or layer stream still one that could WRITE into this rank's blocks?

A stream may wait for its notification as long as its prefill runs
(``stream_timeout_s``, up to an hour). If the prefill process dies mid-way,
no notification ever comes, and the decode rank cannot give the blocks back
before the window passes: a prefill rank that is only slow could still WRITE
into them. And a push or stream this rank has given up (its window passed,
its request ended) may still have a WRITE in flight there, which NIXL would
not cancel: its blocks go back to vLLM only once no WRITE can land
(:mod:`p2pkv.decode.drain`). What ends either wait is proof that no WRITE
can come: the prefill rank's word (its notification), or its answer to a
question. Every :data:`PROBE_EVERY_S` seconds the decode rank asks the
prefill rank that accepted the push or stream (a :class:`handshake.HoldQuery`
naming the prefill request id or the stream id, on the rank's lane):

* ``unknown`` comes only from a process that never took it: a new
  incarnation listening on the same port (the old one's socket is closed, so
  it is gone), or a rank whose stream has long ended. Either way nothing
  WRITEs into the blocks any more: a waiting stream fails at once (its
  failure policy applies), a given-up push or stream has drained.
* any answer but "held" to a part this rank has given up: the hold (a push)
  or the stream has ended there, and a prefill rank ends a hold or a stream
  only once no WRITE from it is in flight (a pinned hold's end waits for its
  WRITEs; a stream's for its WRITEs' end): drained. A part still waiting is
  not failed on it (its word may be on its way).

No reply, or a refused connection, proves nothing. But with each question
the decode rank also asks NIXL whether the prefill agent is still there
(:meth:`p2pkv.dataplane.agent.NixlTransferAgent.reachable`): a remote
disconnect means its process is gone, and none of its WRITEs can land any
more, so the part ends at once, failed (:data:`DISCONNECTED`), a prefill
killed mid-way costing seconds, not the window. Otherwise the part waits on,
for the word, an answer, or the last resort of its drain deadline
(:data:`p2pkv.decode.pushes.QUIET_LIMIT_S` past its window).
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

DISCONNECTED = ("NIXL says the prefill agent disconnected (its process is gone) before the notification came; no "
                "WRITE can come any more")
"""The failure of a push or stream whose prefill agent the transport no longer reaches."""


class StreamWatch:
    """Probes the prefill ranks of streams waiting for their notification, and of given-up pushes and streams.

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

    def ask(self, waiting: list[Part], now: float) -> list[Part]:
        """Ask about each of ``waiting`` (accepted streams, and given-up pushes, not yet notified) whose last
        question is :attr:`every_s` old and answered (the first :attr:`every_s` after ``pushed_at``): one
        question per prefill rank, naming all of its due parts. Returns the parts asked about now."""
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
        return [part for parts in due.values() for part in parts]

    def answers(self) -> list[tuple[Part, str]]:
        """The parts whose prefill rank answered since the last call, each with what it answered: ``held``,
        ``unknown``, ``not_held`` or ``expired``. A question without an answer gives nothing."""
        done, self._questions = take_done(self._questions)
        out = []
        for future, parts in done:
            if future.cancelled() or future.exception() is not None:
                continue  # no answer proves nothing
            reply: HoldsReply = future.result()
            status = {**dict.fromkeys(reply.expired, "expired"), **dict.fromkeys(reply.not_held, "not_held"),
                      **dict.fromkeys(reply.unknown, "unknown")}
            out += [(part, status.get(part.transfer.spec.remote.request_id, "held")) for part in parts]
        return out
