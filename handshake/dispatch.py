"""What the side-channel server answers: one request's checks, then its handler, from one table.

:class:`HandshakeServer <handshake.server.HandshakeServer>` owns the socket,
the serving thread and the connection limits; :class:`Dispatcher` turns one
request's frames into the reply's frames. The checks run in a fixed order
(frames, size and HMAC, the message type, the destination, freshness and the
nonce) and only then does the request's handler run, looked up in
:attr:`Dispatcher.handlers` by the request's type. A request type the table
lacks is refused naming the field ``type``; a new request type is one entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import handshake.messages as messages
from handshake.codec import check_bounds, decode, encode, error_from_exception, verify_agent_info
from handshake.errors import (
    HandshakeError,
    IncompatiblePeerError,
    MalformedMessageError,
    UnknownRankError,
    WrongDestinationError,
)
from handshake.fingerprints import describe, mismatches
from handshake.hold_answers import HoldAnswers, OnPush, OnStream
from handshake.messages import PROTOCOL_VERSION, AgentInfo
from handshake.replay import ReplayGuard

__all__ = ["Dispatcher", "Handler", "Reply", "RequestTimes"]

logger = logging.getLogger("p2pkv.handshake")

Reply = messages.MetadataReply | messages.HoldsReply | messages.PushReply
"""What a handler answers (an :class:`~handshake.messages.ErrorReply` comes from a raised
:class:`~handshake.errors.HandshakeError` instead)."""
Handler = Callable[[Any, AgentInfo], Reply]
"""(a checked request of the handler's type, the served rank's AgentInfo it names) → its reply; raises a
:class:`~handshake.errors.HandshakeError` to refuse."""


@dataclass(slots=True)
class RequestTimes:
    """When the serving thread took one request through its steps (``time.monotonic()`` seconds, one clock
    for every process of a host), and what the request was.

    Attributes:
        received: its frames were read off the socket.
        started: its checks (size, HMAC, destination, freshness) passed and its handler began.
        ended: the handler returned (the reply was encoded).
        sent: the reply was handed to ZMQ (0.0: dropped).
        kind: the request's type tag (``"hold_query"``, ...; ``""`` when it did not decode).
        nonce: its nonce (``b""`` when it did not decode).
        sent_at: its ``sent_at`` (the requester's ``time.time()``; 0.0 when it did not decode).
        received_wall: ``time.time()`` at ``received``: ``received_wall - sent_at`` is the time it spent on
            the wire and in the server's receive queue (across hosts, plus their clock offset).
    """

    received: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    sent: float = 0.0
    kind: str = ""
    nonce: bytes = b""
    sent_at: float = 0.0
    received_wall: float = 0.0

    def describe(self) -> str:
        """One log line's worth (milliseconds)."""
        started = self.started or self.ended
        wire = f"{(self.received_wall - self.sent_at) * 1e3:.1f} ms" if self.sent_at else "?"
        sent = f"reply sent {(self.sent - self.ended) * 1e3:.2f} ms after" if self.sent else "reply dropped"
        return (f"{self.kind or 'undecodable request'} {self.nonce[:4].hex() or '-'}: on the wire and queued "
                f"{wire} (since its sent_at), checks {(started - self.received) * 1e3:.2f} ms, handler "
                f"{(self.ended - started) * 1e3:.2f} ms, {sent}; received at {self.received:.6f}")


class Dispatcher:
    """Checks requests and answers each from the handler its type names.

    Args:
        compat_hash: this engine's compatibility fingerprint; every published
            ``AgentInfo`` must carry it.
        secret: shared HMAC key (None: unsigned).
        max_message_bytes: largest accepted request (bytes).
        replay: the freshness and nonce check.
        holds: the prefill worker's answers to hold requests.
        on_push: the prefill worker's push handler (None: push requests refused).
        stats: the server's counters; ``"served"``, ``"refused"``,
            ``"refused_<code>"``, ``"pushes"`` and ``"streams"`` are counted here.
        on_stream: the prefill worker's stream handler (None: stream requests refused).

    Attributes:
        handlers: request type → its :data:`Handler`.
    """

    def __init__(self, compat_hash: str, secret: bytes | None, max_message_bytes: int, replay: ReplayGuard,
                 holds: HoldAnswers, on_push: OnPush | None, stats: dict[str, int],
                 on_stream: OnStream | None = None) -> None:
        self._compat_hash = compat_hash
        self._secret = secret
        self._max_message_bytes = max_message_bytes
        self._replay = replay
        self._holds = holds
        self._on_push = on_push
        self._on_stream = on_stream
        self.stats = stats
        self._infos: dict[int, AgentInfo] = {}
        self._lock = threading.Lock()
        self.handlers: dict[type[messages.Request], Handler] = {
            messages.MetadataRequest: self._metadata,
            messages.LeaseHeartbeat: self._hold,
            messages.HoldQuery: self._hold,
            messages.ReleaseHolds: self._hold,
            messages.PushRequest: self._push,
            messages.StreamRequest: self._stream,
        }

    def set_info(self, info: AgentInfo) -> None:
        """Publish (or replace) the :class:`AgentInfo` of worker ``info.rank``; any thread.

        Raises:
            MalformedMessageError: ``info`` exceeds a bound of the wire contract; ``field`` names it.
            MetadataDigestError: ``info.metadata_digest`` does not match ``info.agent_metadata``.
            IncompatiblePeerError: ``info.compat_hash`` differs from the server's.
        """
        check_bounds(info)
        verify_agent_info(info)
        if info.compat_hash != self._compat_hash:
            raise IncompatiblePeerError(
                f"AgentInfo for rank {info.rank} has compat_hash {info.compat_hash!r} but the "
                f"server was created with {self._compat_hash!r}; build both from the same config",
                field="compat_hash",
            )
        with self._lock:
            self._infos[info.rank] = info

    def respond(self, body: list[bytes], times: RequestTimes | None = None) -> list[bytes]:
        """Reply frames for one request (its frames after the ROUTER's identity); never raises.

        Checks, in order: frames, size and HMAC (:func:`handshake.codec.decode`),
        the message type, the destination, freshness and the nonce; only then
        is the request's handler called. ``times`` gets the request's kind,
        nonce and ``sent_at``, and when its handler started.
        """
        nonce = b""
        try:
            msg = decode(body, self._secret, self._max_message_bytes)
            handler = self.handlers.get(type(msg))
            if handler is None:
                tags = ", ".join(t.__struct_config__.tag for t in self.handlers)
                raise MalformedMessageError(f"a server takes requests (type {tags}), got {type(msg).__name__}",
                                            field="type")
            nonce = msg.nonce
            if times is not None:
                times.kind, times.nonce, times.sent_at = msg.__struct_config__.tag, msg.nonce, msg.sent_at
            info = self._destination(msg)
            self._replay.check(msg.nonce, msg.sent_at)
            if times is not None:
                times.started = time.monotonic()
            frames = encode(handler(msg, info), self._secret)
        except HandshakeError as exc:
            return self._refuse(exc, nonce)
        except Exception as exc:  # a bug must not stop the server
            logger.exception("handshake server failed on a request")
            return self._refuse(
                HandshakeError(f"internal server error: {exc!r}; see the server log", code="internal"), nonce)
        self.stats["served"] += 1
        return frames

    def _metadata(self, msg: messages.MetadataRequest, info: AgentInfo) -> messages.MetadataReply:
        """The named rank's AgentInfo; a requester with another compatibility fingerprint is logged."""
        diffs = mismatches(self._compat_hash, msg.compat_hash)
        if diffs:  # the requester refuses us on its side (it sees both values); say why here too
            logger.warning("requester %r cannot exchange KV with this engine: %s", msg.requester_engine_id[:64],
                           describe(diffs, "this engine", "the requester"))
        return messages.MetadataReply(protocol_version=PROTOCOL_VERSION, info=info, nonce=msg.nonce)

    def _hold(self, msg: messages.LeaseHeartbeat | messages.HoldQuery | messages.ReleaseHolds,
              info: AgentInfo) -> messages.HoldsReply:
        """A hold request, answered by the prefill worker's hold callbacks."""
        return self._holds.answer(msg)

    def _push(self, msg: messages.PushRequest, info: AgentInfo) -> messages.PushReply:
        """Hand a push request to ``on_push``; refused (``malformed``, field ``type``) without one."""
        return self._write_request(msg, self._on_push, "pushes", "push requests (it holds no requests, or its "
                                   "p2pkv predates push); use transfer_mode pull")

    def _stream(self, msg: messages.StreamRequest, info: AgentInfo) -> messages.PushReply:
        """Hand a stream request to ``on_stream``; refused (``malformed``, field ``type``) without one."""
        return self._write_request(msg, self._on_stream, "streams", "stream requests (it streams no requests, or "
                                   "its p2pkv predates streaming); use transfer_mode push")

    def _write_request(self, msg: messages.PushRequest | messages.StreamRequest,
                       handler: OnPush | OnStream | None, counted: str, refused: str) -> messages.PushReply:
        """A request for the prefill worker to WRITE (a push or a stream), answered by ``handler`` and counted in
        ``stats[counted]``; refused (``malformed``, field ``type``) naming what this side channel takes no
        ``refused`` of, without a handler."""
        if handler is None:
            raise MalformedMessageError(f"this side channel takes no {refused}", field="type")
        status, message = handler(msg)  # type: ignore[arg-type]
        self.stats[counted] = self.stats.get(counted, 0) + 1
        return messages.PushReply(protocol_version=PROTOCOL_VERSION, status=status, message=message[:1024],
                                  nonce=msg.nonce)

    def _destination(self, msg: messages.Request) -> AgentInfo:
        """The served rank the request names; refuses another rank or engine id."""
        with self._lock:
            info = self._infos.get(msg.to_rank)
            known = sorted(self._infos)
        requester = msg.requester_engine_id[:64]
        if info is None:
            raise UnknownRankError(
                f"no AgentInfo for to_rank {msg.to_rank} (requested by {requester!r}); this server "
                f"has ranks {known}; check the tensor- and pipeline-parallel sizes and that the rank has started",
                field="to_rank",
            )
        if msg.to_engine_id != info.engine_id:
            raise WrongDestinationError(
                f"the request names another engine (to_engine_id {msg.to_engine_id[:64]!r}) than the one serving "
                "this address; check remote_host/remote_port of the kv_transfer_params (a replayed or misrouted "
                "request)", field="to_engine_id")
        return info

    def _refuse(self, exc: HandshakeError, nonce: bytes = b"") -> list[bytes]:
        reply = error_from_exception(exc, nonce)
        self.stats["refused"] += 1
        key = f"refused_{reply.code}"
        self.stats[key] = self.stats.get(key, 0) + 1
        logger.warning("handshake request refused (%s, field %r): %s", reply.code, reply.field, reply.message)
        # An "auth" refusal goes unsigned: the requester does not share our key.
        return encode(reply, None if reply.code == "auth" else self._secret)
