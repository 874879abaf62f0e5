"""Push mode, decode side: ask prefill ranks to WRITE, collect their replies and the WRITEs' notifications.

A pulled request whose prefill rank pushes has the same descriptor rows as
a READ (:func:`p2pkv.decode.reads.plan_read`: local blocks, or staging when
a fixup follows). Instead of posting a READ, :meth:`Pushes.post` sends them
in a :class:`handshake.PushRequest` on the prefill rank's lane (the fence's
long-lived connection); the prefill rank WRITEs and its NIXL notification
(:class:`p2pkv.notification.PushedNotification`) arrives after
the bytes. Until a push request is answered ``accepted`` or refused, and an
accepted one notified, its target memory may still be written: a pull that
gives up waits for that before its blocks go back to vLLM — the prefill
rank's word (it sends one for every accepted push and stream, only once no
WRITE of it is in flight, and cancels what is in flight at the window), or
its answer that the hold or stream has ended there
(:mod:`p2pkv.decode.stream_watch`), or, with no answer at all,
:data:`QUIET_LIMIT_S` past the window.

Whether a prefill rank pushes is :func:`p2pkv.decode.direction.choose`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future

from handshake import (
    AgentInfo,
    Destination,
    HandshakeTimeoutError,
    PushReply,
    RemoteRefusedError,
    request_push,
)
from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.decode.background import Background, take_done
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.fence import Fence, Hold, failure_of
from p2pkv.decode.stream_watch import DISCONNECTED, GONE, StreamWatch
from p2pkv.decode.transfer import Part
from p2pkv.notification import PUSH_PREFIX, PushedNotification, parse_pushed
from p2pkv.ways import Window

logger = logging.getLogger("p2pkv.decode")

PUSH_ID_BYTES = 16
"""Random bytes naming one push (its notification carries them in hex)."""

QUIET_LIMIT_S = 60.0
"""Longest (seconds, past its window) a given-up push or stream keeps this rank's blocks from vLLM while its
prefill rank neither notifies nor answers (dead, or cut off): the last resort, since nothing then proves that no
WRITE can land. The prefill rank cancels its WRITEs at the window, and a WRITE NIXL cannot cancel outlives it
only by the transport's own timeout (UCX's rc and tcp endpoints fail a peer that stops acknowledging within
seconds), so a minute is well past any WRITE of a live link."""

RETRY_UNKNOWN_S = 0.002
"""Pause (seconds) before asking again a prefill rank that does not know the hold yet (it learns of a
finished request at its engine's next step, which may come after its HTTP answer reached the proxy)."""
RETRY_BUSY_S = 0.5
"""Pause (seconds) before sending again a stream request its prefill rank answered ``busy`` (as many destinations
for streams it does not know yet wait there as it keeps for one decode rank: a burst of streams whose prefill legs
have not reached its scheduler); asked again until the stream's window ends."""


class PushNotSent(RuntimeError):
    """A push request that was never sent (so nothing can have been queued for it): its window passed while
    it waited for its lane, or it was taken off the lane because an earlier request to the same prefill
    rank got no reply."""


class Pushes:
    """A decode rank's push requests and their outcomes.

    The requests to one prefill rank go one at a time on its lane (the
    fence's connection), each waiting up to ``timeout_s`` for its reply.
    So that a request queued behind others never grants the prefill rank
    more time than this rank waits for it, its window is counted from when
    it was posted (what is left of it when it is sent; none left: not sent).
    And once one request to a prefill rank (that incarnation of it) got no
    reply, the requests to it still waiting for the lane are taken off and
    their pulls retried at once (after a new handshake), as every READ of a
    failed peer is, rather than each waiting out its own reply timeout.

    Args:
        background: where the side-channel calls run (on each prefill rank's lane).
        fence: owns the long-lived connection to each prefill rank (:meth:`p2pkv.decode.fence.Fence.link`).
        agent: this rank's NIXL agent (its notifications are read here).
        engine_id: this (decode) engine's id.
        secret: side-channel secret (requests, and the notifications' MAC), or None.
        timeout_s: wait for each reply (seconds).
        window_s: how long the prefill rank may take to start the WRITE, from
            the request's arrival (seconds, the pull's ``transfer_timeout_s``).
        stream_window_s: a stream request's window: how long the prefill rank
            may take to end the stream, its queue and forward included
            (seconds, ``stream_timeout_s``; None: ``window_s``).

    Attributes:
        make_info: builds this rank's :class:`AgentInfo` from its agent's current
            metadata (set by the worker); sent with every request, rebuilt after
            more memory is registered (staging), so the prefill rank can WRITE there.
    """

    def __init__(self, background: Background, fence: Fence, agent: NixlTransferAgent, engine_id: str,
                 secret: bytes | None, timeout_s: float, window_s: float,
                 stream_window_s: float | None = None) -> None:
        self.background = background
        self.fence = fence
        self.agent = agent
        self.engine_id = engine_id
        self.secret = secret
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.stream_window_s = window_s if stream_window_s is None else stream_window_s
        self._windows: dict[Window, float] = {"transfer_timeout_s": window_s,
                                              "stream_timeout_s": self.stream_window_s}
        self.make_info: Callable[[], AgentInfo] | None = None
        self._info: AgentInfo | None = None
        self._info_registrations = -1
        self._open: dict[bytes, Part] = {}  # push id → its READ part, until notified or given up
        self._replies: list[tuple[Future, Part]] = []
        self._again: list[tuple[float, Part]] = []  # (time.monotonic() to send again at, part)
        self.posters: dict[str, Callable[[Part], None]] = {}
        """A part's direction (its value) → how a part moved that way is sent again
        (:func:`p2pkv.decode.movers.movers` sets each mover's ``post``); a direction not named: as a push
        (:meth:`post`)."""
        self.watch = StreamWatch(background, fence, engine_id, secret, timeout_s)
        agent.take_notifs(PUSH_PREFIX)  # from now on the engine thread's get_notifs leaves these to us

    def post(self, read: Part) -> None:
        """Send ``read``'s push request (its rows: the prefill rank's ``remote_descs`` into our ``local_descs``).

        Raises:
            RuntimeError: the worker has not set :attr:`make_info`.
        """
        info = self.open(read)
        remote = read.transfer.spec.remote
        self.send(read, _send_push, remote.request_id, list(remote.block_ids), read.push_id, info,
                  read.remote_descs.astype("<u8").tobytes(), read.local_descs.astype("<u8").tobytes(), self.engine_id,
                  kv_digest=read.transfer.verify)

    def open(self, part: Part) -> AgentInfo:
        """Open ``part`` for a request asking its prefill rank to WRITE it: its push id drawn (its notification
        names it) and its send time set; this rank's :class:`AgentInfo`, for the request.

        Raises:
            RuntimeError: the worker has not set :attr:`make_info` (nothing is opened).
        """
        info = self.info()
        part.push_id, part.pushed_at = os.urandom(PUSH_ID_BYTES), time.monotonic()
        part.first_pushed_at = part.first_pushed_at or part.pushed_at
        self._open[part.push_id] = part
        return info

    def send(self, part: Part, call: Callable[..., PushReply], *args: object, **kwargs: object) -> None:
        """Send the request of ``part`` (:meth:`open` first) on its prefill rank's lane: ``call(deadline,
        destination, *args, secret=, timeout_s=, link=, lane=, **kwargs)``, ``deadline`` its window from now
        (:func:`_send_push`; a stream's, :func:`p2pkv.decode.stream_parts.post_stream`); its reply is
        collected by :meth:`collect`."""
        pid = part.peer_id
        future = self.background.call(
            f"p2pkv-push-{pid.host}:{pid.port}", call, part.pushed_at + self.window(part), pid.destination, *args,
            secret=self.secret, timeout_s=self.timeout_s, link=self.fence.link(pid.host, pid.port),
            lane=f"{pid.host}:{pid.port}", **kwargs)
        self._replies.append((future, part))

    def window(self, part: Part) -> float:
        """``part``'s window (seconds): the one its way's wait has (:attr:`p2pkv.ways.Way.window`: a layer
        stream's ``stream_timeout_s``, else a push's)."""
        return self._windows[part.transfer.way.window]

    def info(self) -> AgentInfo:
        """This rank's :class:`AgentInfo`, rebuilt when memory was registered since the last one.

        Raises:
            RuntimeError: the worker has not set :attr:`make_info`.
        """
        if self.make_info is None:
            raise RuntimeError("push requested before this rank's AgentInfo was known")
        if self._info is None or self._info_registrations != self.agent.registrations:
            self._info_registrations = self.agent.registrations
            self._info = self.make_info()
        return self._info

    def again(self, read: Part, delay_s: float = RETRY_UNKNOWN_S) -> None:
        """Send ``read``'s request again after ``delay_s`` seconds (its hold was not known yet there, or its
        prefill rank was busy)."""
        self._again.append((time.monotonic() + delay_s, read))

    def send_due(self, now: float) -> None:
        """Send the requests :meth:`again` scheduled for ``now`` or earlier (parts abandoned since: dropped)."""
        due, self._again = [r for t, r in self._again if t <= now], [(t, r) for t, r in self._again if t > now]
        for read in due:
            if read.attempt == read.transfer.attempt and not read.transfer.finished:
                self.posters.get(read.direction.value if read.direction else "", self.post)(read)

    def unknown_for(self, read: Part, now: float) -> float:
        """Seconds since ``read``'s first push request (how long its hold has been unknown there)."""
        return now - read.first_pushed_at

    def collect(self, now: float, grace_s: float) -> list[tuple[Part, FailureKind, str, bool]]:
        """Send what is due again, read replies and notifications at ``now`` (``time.monotonic()``).

        A notification sets its part's ``arrived`` (and ``failure``). A reply
        ``unknown`` within ``grace_s`` seconds of the first request is asked
        again (the prefill rank is told of a hold at its next engine step); a
        ``busy`` one of a way that lasts the prefill (a stream) after
        :data:`RETRY_BUSY_S`, until its window fails the pull.

        Returns:
            The parts of the current attempts whose request failed: the part,
            the failure kind, why, and whether the pull may retry
            (:func:`failure_of_push`).
        """
        self.send_due(now)
        failed = []
        for read, reply in self.replies():
            if read.attempt != read.transfer.attempt or read.transfer.finished:
                continue
            if (isinstance(reply, PushReply) and reply.status == "unknown"
                    and self.unknown_for(read, now) < grace_s):
                self.again(read)
                continue
            if isinstance(reply, PushReply) and reply.status == "busy" and read.transfer.way.lasts_prefill:
                self.again(read, RETRY_BUSY_S)
                continue
            why = failure_of_push(reply, read.transfer.spec.remote.request_id, retried=read.transfer.way.retried)
            if why is not None:
                failed.append((read, *why))
        for read, note in self.arrivals(now):
            read.arrived, read.failure = note.ok, note.reason
            if read.transfer.verify:  # verified KV: what the WRITE read, by the prefill rank's word
                read.digest = note.digest
        self._watch_streams(now)
        return failed

    def _watch_streams(self, now: float) -> None:
        """Ask the prefill ranks of accepted streams still waiting, and of given-up pushes and streams, whether
        they can still WRITE (:mod:`p2pkv.decode.stream_watch`): a stream whose rank does not know it (it
        restarted) is over, failed; a given-up part whose hold or stream has ended there has drained."""
        asking = {id(part) for _, part in self._replies}
        asked = self.watch.ask([p for p in self._open.values() if (p.transfer.way.watched or p.abandoned)
                                and id(p) not in asking], now)
        gone = {name for name in {p.peer.agent_name for p in asked} if not self.agent.reachable(name)}
        for push_id, part in list(self._open.items()) if gone else ():
            if part.peer.agent_name in gone:
                del self._open[push_id]
                part.arrived, part.failure = False, DISCONNECTED
        for part, status in self.watch.answers():
            if status == "held" or self._open.get(part.push_id) is not part:
                continue
            if status == "unknown" or part.abandoned:
                del self._open[part.push_id]
                part.arrived, part.failure = False, GONE if status == "unknown" else (
                    f"the prefill rank answered {status}: nothing of it is in flight there")

    def replies(self) -> list[tuple[Part, PushReply | Exception]]:
        """Answered push requests: the READ part and the reply (or why there is none).

        A request refused (a reply other than ``accepted``, or the server's
        refusal of the request itself) or never sent (:class:`PushNotSent`)
        writes nothing: its part is no longer open. One without a reply (an
        exception) may still have been queued there: it stays open until
        notified or its window passes. Requests still waiting for the lane
        to a prefill rank whose earlier request got no reply are taken off
        it (answered :class:`PushNotSent`).
        """
        done, self._replies = take_done(self._replies)
        silent = [r.peer for f, r in done if not f.cancelled() and isinstance(f.exception(), HandshakeTimeoutError)]
        if silent:
            waiting = [(f, r) for f, r in self._replies if any(r.peer is p for p in silent) and f.cancel()]
            self._replies = [(f, r) for f, r in self._replies if not f.cancelled()]
            done += waiting
            if waiting:
                logger.warning("p2pkv: a push request to %s got no reply; %d more waiting for it retried at once",
                               silent[0].agent_name, len(waiting))
        out: list[tuple[Part, PushReply | Exception]] = []
        for future, read in done:
            try:
                reply: PushReply | Exception = future.result()
            except Exception as exc:  # a cancelled future too
                reply = exc
            if future.cancelled():
                reply = PushNotSent("not sent: an earlier push request to that prefill rank got no reply (it may "
                                    "have restarted)")
            refused = isinstance(reply, RemoteRefusedError | PushNotSent)
            if refused or (isinstance(reply, PushReply) and reply.status != "accepted"):
                self._open.pop(read.push_id, None)  # nothing was queued there
            out.append((read, reply))
        return out

    def arrivals(self, now: float) -> list[tuple[Part, PushedNotification]]:
        """The WRITE notifications received since the last call, each with its open READ part.

        Notifications that parse badly, carry a bad MAC or name no open push
        are dropped (logged). Open pushes older than their window (a
        stream's own) and :data:`QUIET_LIMIT_S` are forgotten (logged: their
        prefill rank never answered).
        """
        out = []
        dropped = 0
        try:
            msgs = self.agent.take_notifs(PUSH_PREFIX)
        except Exception as exc:  # NIXL could not hand its notifications over: the questions still end the waits
            logger.warning("p2pkv: reading push notifications failed: %s", exc)
            msgs = []
        for msg in msgs:
            note = parse_pushed(msg, self.secret)
            read = self._open.pop(note.push_id, None) if note is not None else None
            if read is None or note is None:
                dropped += 1
                continue
            out.append((read, note))
        if dropped:
            logger.warning("p2pkv: %d push notification(s) dropped (unknown push, or MAC wrong)", dropped)
        for push_id in [p for p, r in self._open.items() if r.pushed_at + self.window(r) + QUIET_LIMIT_S < now]:
            part = self._open.pop(push_id)
            logger.error("p2pkv: push %s to %s: no word and no answer from its prefill rank %.0f s past its window; "
                         "its blocks go back to vLLM now", push_id.hex(), part.peer.agent_name, QUIET_LIMIT_S)
        return out

    def forget(self, read: Part) -> None:
        """``read`` can write nothing more (its prefill agent disconnected): no longer open."""
        self._open.pop(read.push_id, None)

    def ended(self, read: Part) -> bool:
        """True once ``read``'s push can write nothing more (notified, refused, or forgotten)."""
        return read.push_id not in self._open

    def drain_deadline(self, read: Part) -> float:
        """``time.monotonic()`` until which a given-up push or stream keeps its blocks from vLLM at the most:
        its window from sending plus :data:`QUIET_LIMIT_S` (it drains as soon as its prefill rank's word or
        answer proves that no WRITE can land: :meth:`ended`)."""
        return read.pushed_at + self.window(read) + QUIET_LIMIT_S


def _send_push(deadline: float, to: Destination, request_id: str, block_ids: list[int], push_id: bytes,
               agent: AgentInfo, source_rows: bytes, target_rows: bytes, requester_engine_id: str,
               **kwargs: object) -> PushReply:
    """:func:`handshake.request_push` (on the lane's thread) with what is left at the time of ``deadline``
    (``time.monotonic()``: when it was posted plus its window) as its window.

    Raises:
        PushNotSent: nothing is left (it waited for the lane that long); nothing was sent.
        The errors of :func:`handshake.request_push`.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise PushNotSent("not sent: its window passed while it waited behind earlier requests to that prefill rank")
    return request_push(to, request_id, block_ids, push_id, agent, source_rows, target_rows, left,
                        requester_engine_id, **kwargs)  # type: ignore[arg-type]


def failure_of_push(reply: PushReply | Exception, request_id: str,
                    retried: bool = True) -> tuple[FailureKind, str, bool] | None:
    """What a push request's answer means for its pull: None when accepted, else the failure kind, the
    reason, and whether the pull may retry (after a re-handshake, once) rather than fail.

    ``expired`` / ``not_held`` / ``unknown`` read as the fence's answers
    (:func:`p2pkv.decode.fence.failure_of`); ``busy`` fails the pull;
    ``refused`` (rows or agent) and no reply (timeout, a closed connection)
    retry after a new handshake, since the prefill engine may have
    restarted (its memory, and so the rows, changed). A refused request of a
    way that is not retried (``retried`` False, :attr:`p2pkv.ways.Way.retried`:
    a stream request) does not: the prefill rank planned nothing from
    this rank's view of it, and a stream id gets one destination, so a
    retry could only be refused again (a restarted prefill engine no longer
    knows the request at all).
    """
    if isinstance(reply, RemoteRefusedError):
        return FailureKind.REFUSED, f"the prefill rank refused the push request: {reply}", False
    if isinstance(reply, Exception):
        return FailureKind.TRANSFER, f"no answer to the push request: {reply}", True
    if reply.status == "accepted":
        return None
    if reply.status in ("expired", "not_held", "unknown"):
        kind, why = failure_of(Hold(reply.status), request_id)
        return kind, why, False
    if reply.status == "busy":
        return FailureKind.TRANSFER, f"the prefill rank is busy: {reply.message}", False
    # rows or agent refused: planned on another incarnation of that rank (a restart), so handshake again
    return FailureKind.REFUSED, f"the prefill rank refused the push: {reply.message}", retried
