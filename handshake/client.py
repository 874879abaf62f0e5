"""The side-channel client: one remote rank's AgentInfo, hold requests and push requests, each to a
:class:`~handshake.destination.Destination`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

import msgspec
import zmq

from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.codec import decode, encode, verify_agent_info
from handshake.destination import Destination
from handshake.errors import (
    AuthenticationError,
    HandshakeCancelledError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    MalformedMessageError,
    MetadataDigestError,
    RemoteRefusedError,
)
from handshake.fingerprints import OPAQUE, describe, mismatches
from handshake.link import HoldLink, exchange
from handshake.messages import (
    MAX_HEARTBEAT_IDS,
    MAX_HOLD_BLOCK_IDS,
    MAX_PUSH_ROWS,
    PROTOCOL_VERSION,
    ROW_BYTES,
    AgentInfo,
    ErrorReply,
    GroupBlocks,
    HeadSlice,
    HoldQuery,
    HoldRequest,
    HoldsReply,
    LeaseHeartbeat,
    MetadataReply,
    MetadataRequest,
    PushReply,
    PushRequest,
    ReleaseHolds,
    StreamRequest,
)

__all__ = ["HoldLink", "fetch_agent_info", "query_holds", "release_holds", "request_push", "request_stream",
           "send_heartbeat"]

NONCE_BYTES = 16
"""Random bytes of each request's nonce."""


def _fresh() -> dict[str, object]:
    """A new request's time and nonce."""
    return {"sent_at": time.time(), "nonce": os.urandom(NONCE_BYTES)}

logger = logging.getLogger("p2pkv.handshake")

R = TypeVar("R", HoldsReply, PushReply)


def fetch_agent_info(
    to: Destination,
    requester_engine_id: str,
    compat_hash: str,
    secret: bytes | None = None,
    timeout_s: float = 5.0,
    retries: int = 3,
    backoff_s: float = 0.2,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    cancel: threading.Event | None = None,
) -> AgentInfo:
    """Ask the side channel of ``to`` for that rank's info.

    Each attempt is a new request (its own nonce and time: the server refuses
    a request it has seen) on a fresh DEALER socket (linger 0, CURVE with a
    ``secret``) and waits up to ``timeout_s`` for the reply. Only timeouts are
    retried, after ``backoff_s * 2**(attempt - 1)`` seconds; every other
    error is final.

    Args:
        to: the rank whose info is wanted (its engine id is the one the peer must have).
        requester_engine_id: this engine's id (shown in the server's logs).
        compat_hash: this engine's compatibility fingerprint (:mod:`handshake.fingerprints`); the
            reply's must equal it, field by field.
        secret: the shared secret (bytes): HMAC on every message and CURVE
            encryption, or ``None`` when not authenticating.
        timeout_s: time to wait for a reply per attempt (seconds).
        retries: total number of attempts (>= 1).
        backoff_s: first pause between attempts (seconds), doubled each time.
        max_message_bytes: largest accepted reply (bytes).
        cancel: when set (by another thread), the wait ends within 0.1 s
            and :class:`HandshakeCancelledError` is raised.

    Returns:
        The verified :class:`AgentInfo` (rank, engine id, compat hash,
        metadata digest and the request's nonce checked).

    Raises:
        HandshakeTimeoutError: no reply after ``retries`` attempts.
        RemoteRefusedError: the server answered with an ``ErrorReply``
            (``code`` e.g. ``"incompatible"``, ``"unknown_rank"``, ``"auth"``).
        AuthenticationError: the reply's HMAC is missing or wrong.
        ProtocolVersionError: the server speaks another protocol version.
        IncompatiblePeerError: the reply is for another rank or engine id, or its
            compatibility fingerprint differs (``field`` ``info.compat_hash.<first
            differing field>``; the message names every differing field and both values).
        MetadataDigestError: the agent metadata does not match its digest.
        MalformedMessageError, MessageTooLargeError: the reply is invalid.
        HandshakeCancelledError: ``cancel`` was set.
        ValueError: bad arguments.
    """
    if retries < 1:
        raise ValueError(f"retries is the total number of attempts and must be >= 1, got {retries}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    endpoint, host, port, engine_id = to.endpoint, to.host, to.port, to.engine_id
    ctx = zmq.Context()
    try:
        for attempt in range(1, retries + 1):
            if attempt > 1 and cancel is not None and cancel.wait(backoff_s * 2 ** (attempt - 2)):
                break
            if attempt > 1 and cancel is None:
                time.sleep(backoff_s * 2 ** (attempt - 2))
            request = MetadataRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=engine_id, to_rank=to.rank,
                                      requester_engine_id=requester_engine_id, compat_hash=compat_hash,
                                      **_fresh())  # type: ignore[arg-type]
            reply = exchange(ctx, host, endpoint, encode(request, secret), timeout_s, cancel,
                              secret, request.nonce)
            if reply is not None:
                info = _check_reply(reply, endpoint, request, secret, max_message_bytes)
                if info.engine_id != engine_id:
                    raise IncompatiblePeerError(
                        f"{endpoint} serves engine_id {info.engine_id[:128]!r}, but kv_transfer_params name "
                        f"remote_engine_id {engine_id[:128]!r}; the request's remote_host/remote_port point at "
                        "another engine than its remote_engine_id", field="info.engine_id")
                return info
            logger.debug("no handshake reply from %s (attempt %d/%d)", endpoint, attempt, retries)
    finally:
        ctx.term()
    if cancel is not None and cancel.is_set():
        raise HandshakeCancelledError(f"handshake with {host}:{port} cancelled (shutting down)")
    raise HandshakeTimeoutError(
        f"no reply from the handshake server at {host}:{port} for rank {to.rank} after "
        f"{retries} attempt(s) of {timeout_s:g} s each; check that the prefill engine is up "
        f"and that its side-channel port {port} is reachable from this host "
        "(host name, firewall, port number)"
        + ("; and that both sides use the same secret (the side channel is encrypted with keys derived from "
           "it: a peer with another secret never answers)" if secret else ""),
        field="",
    )


def _check_reply(
    frames: list[bytes],
    endpoint: str,
    request: MetadataRequest,
    secret: bytes | None,
    max_message_bytes: int,
) -> AgentInfo:
    rank, compat_hash = request.to_rank, request.compat_hash
    try:
        msg = decode(frames, secret, max_message_bytes)
    except AuthenticationError as exc:
        refusal = _unsigned_auth_refusal(frames, max_message_bytes)
        if refusal is not None:
            raise RemoteRefusedError(refusal.code, refusal.field, refusal.message, endpoint=endpoint) from exc
        raise AuthenticationError(f"reply from {endpoint}: {exc.message}", field=exc.field) from exc
    except HandshakeError as exc:
        raise type(exc)(f"reply from {endpoint}: {exc.message}", field=exc.field, code=exc.code) from exc
    if isinstance(msg, ErrorReply):
        _check_refusal(msg, request.nonce, endpoint)
    if not isinstance(msg, MetadataReply):
        raise MalformedMessageError(
            f"reply from {endpoint} has type {type(msg).__name__}, expected 'metadata_reply'; "
            "check that the port is a p2pkv handshake side channel",
            field="type",
        )
    if msg.nonce != request.nonce:
        raise MalformedMessageError(f"reply from {endpoint} answers another request (nonce differs)", field="nonce")
    info = msg.info
    if info.rank != rank:
        raise IncompatiblePeerError(
            f"reply from {endpoint}: info.tp_rank {info.tp_rank} and info.pp_rank {info.pp_rank} make rank "
            f"{info.rank}, but rank {rank} was asked for; the server is misbehaving, restart the prefill engine",
            field="info.tp_rank",
        )
    diffs = mismatches(compat_hash, info.compat_hash)
    if diffs:
        field = "info.compat_hash" if diffs[0][0] == OPAQUE else f"info.compat_hash.{diffs[0][0]}"
        raise IncompatiblePeerError(
            f"reply from {endpoint}: {field} differs, the peer cannot exchange KV with this side: "
            f"{describe(diffs, 'this side', 'the peer')}; run the same vLLM version, model, dtype, KV cache "
            "and speculative-decoding configuration on both sides",
            field=field,
        )
    try:
        verify_agent_info(info)
    except MetadataDigestError as exc:
        raise MetadataDigestError(f"reply from {endpoint}: {exc.message}", field=exc.field) from None
    return info


def _check_refusal(reply: ErrorReply, nonce: bytes, endpoint: str) -> None:
    """Raise the refusal ``reply`` stands for, if it refuses this request (its nonce, or none: the request did
    not decode there, e.g. another protocol version).

    Raises:
        RemoteRefusedError: the server refused this request.
        MalformedMessageError: the refusal answers another request.
    """
    if reply.nonce and reply.nonce != nonce:
        raise MalformedMessageError(f"refusal from {endpoint} answers another request (nonce differs)",
                                    field="nonce")
    raise RemoteRefusedError(reply.code, reply.field, reply.message, endpoint=endpoint)


def _unsigned_auth_refusal(frames: list[bytes], max_message_bytes: int) -> ErrorReply | None:
    """An unsigned ``auth`` ErrorReply, trusted only to explain the failure."""
    try:
        msg = decode(frames[:1], None, max_message_bytes)
    except HandshakeError:
        return None
    if isinstance(msg, ErrorReply) and msg.code == "auth":
        return msg
    return None


def send_heartbeat(
    to: Destination,
    request_ids: list[str],
    requester_engine_id: str,
    extend_s: float,
    secret: bytes | None = None,
    timeout_s: float = 1.0,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    cancel: threading.Event | None = None,
) -> HoldsReply:
    """Ask prefill rank ``to`` to extend the leases of
    ``request_ids`` to ``extend_s`` seconds from now.

    One attempt (a heartbeat is repeated anyway); ids are sent in chunks of
    :data:`~handshake.messages.MAX_HEARTBEAT_IDS`. ``cancel`` ends the wait
    early (raises :class:`HandshakeCancelledError`).

    Returns:
        A :class:`HoldsReply` summing every chunk's answer: ``accepted``
        ids, and the ids ``expired``, ``not_held`` and ``unknown`` there.

    Raises:
        HandshakeTimeoutError: no reply within ``timeout_s`` seconds.
        RemoteRefusedError: the server refused (e.g. it holds no leases, or it
            is another engine or rank).
        HandshakeError: any other failure (bad reply, authentication, a reply
            to another request).
    """
    msgs = _hold_requests(LeaseHeartbeat, to, request_ids, None, requester_engine_id, extend_s=extend_s)
    return _hold_exchange(to, msgs, secret, timeout_s, max_message_bytes, cancel)


def query_holds(
    to: Destination,
    request_ids: list[str],
    block_ids: list[list[int]],
    requester_engine_id: str,
    extend_s: float,
    secret: bytes | None = None,
    timeout_s: float = 1.0,
    cancel: threading.Event | None = None,
    link: HoldLink | None = None,
    attempts: int = 1,
    digest_rows: list[bytes] | None = None,
) -> HoldsReply:
    """A pull's fence question (:class:`HoldQuery`): does prefill rank ``to`` hold
    ``request_ids`` with ``block_ids`` (one list per id)? Held ones are extended to ``extend_s`` from now.
    With ``digest_rows`` (one :data:`~handshake.messages.Rows` per id, ``b""`` for none), the reply's
    ``digests`` has the digest of each id's rows, in the order of ``request_ids``.

    With ``link`` (to ``to``'s side channel) the question goes over that long-lived
    connection instead of a fresh one. A batch over the bounds of one
    :class:`HoldQuery` (:data:`~handshake.messages.MAX_HEARTBEAT_IDS` ids,
    :data:`~handshake.messages.MAX_HOLD_BLOCK_IDS` block ids) is asked in
    several, one after the other.

    A question without a reply within ``timeout_s`` seconds is asked again,
    as a new request (its own nonce and time), up to ``attempts`` times in
    all; over ``link`` a reply to any of them answers it: the earlier ones
    asked the same, so a reply that comes only while the next one waits is
    as good (a busy host can hold either side's thread for longer than a
    timeout).

    Returns:
        A :class:`HoldsReply`: ids ``expired``, ``not_held`` (released, or
        without those blocks) and ``unknown`` there; the others are held.

    Raises:
        ValueError: ``block_ids`` does not have one list per request id, or one
            is longer than :data:`~handshake.messages.MAX_HOLD_BLOCK_IDS`.
        The errors of :func:`send_heartbeat`.
    """
    msgs = _hold_requests(HoldQuery, to, request_ids, block_ids, requester_engine_id, digest_rows,
                          extend_s=extend_s)
    return _hold_exchange(to, msgs, secret, timeout_s, MAX_MESSAGE_BYTES, cancel, link, attempts)


def release_holds(to: Destination, request_ids: list[str], block_ids: list[list[int]],
                  requester_engine_id: str, secret: bytes | None = None, timeout_s: float = 1.0,
                  cancel: threading.Event | None = None) -> HoldsReply:
    """Tell prefill rank ``to`` that nobody will pull ``request_ids``: it frees each
    hold whose block ids are exactly its ``block_ids`` list at its next step.

    Returns:
        A :class:`HoldsReply`; ``accepted`` counts the holds released.

    Raises:
        ValueError: ``block_ids`` does not have one list per request id, or one
            is longer than :data:`~handshake.messages.MAX_HOLD_BLOCK_IDS`.
        The errors of :func:`send_heartbeat`.
    """
    msgs = _hold_requests(ReleaseHolds, to, request_ids, block_ids, requester_engine_id)
    return _hold_exchange(to, msgs, secret, timeout_s, MAX_MESSAGE_BYTES, cancel)


def _push_exchange(to: Destination, msg: PushRequest | StreamRequest, secret: bytes | None, timeout_s: float,
                   cancel: threading.Event | None, link: HoldLink | None) -> PushReply:
    """Send a push or stream request (over ``link`` when given) and read its :class:`PushReply`."""
    frames = encode(msg, secret)
    endpoint = to.endpoint
    reply = (link.exchange(frames, msg.nonce, secret, timeout_s, cancel) if link is not None else
             exchange(zmq.Context.instance(), to.host, endpoint, frames, timeout_s, cancel, secret,
                       msg.nonce))
    return _answer(reply, PushReply, [msg.nonce], endpoint, secret, timeout_s, cancel, MAX_MESSAGE_BYTES)


def request_stream(to: Destination, grant: str, block_ids: list[int], first_block: int, num_tokens: int,
                   prompt_digest: str, push_id: bytes, agent: AgentInfo, window_s: float, requester_engine_id: str,
                   secret: bytes | None = None, timeout_s: float = 1.0, cancel: threading.Event | None = None,
                   link: HoldLink | None = None, staging_addrs: list[int] | None = None,
                   readers: int = 1, group_blocks: list[GroupBlocks] | None = None,
                   head_slice: HeadSlice | None = None, kv_digest: bool = False) -> PushReply:
    """Give prefill rank ``to`` this rank's destination for a granted stream (:class:`StreamRequest`: its
    fields, units and checks).

    Returns:
        The :class:`PushReply` (``accepted``: the stream's notification follows).

    Raises:
        The errors of :func:`request_push`.
    """
    msg = StreamRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=to.engine_id, to_rank=to.rank,
                        requester_engine_id=requester_engine_id, grant=grant, block_ids=block_ids,
                        first_block=first_block, num_tokens=num_tokens, prompt_digest=prompt_digest,
                        push_id=push_id, agent=agent, window_s=window_s, staging_addrs=list(staging_addrs or []),
                        readers=readers, group_blocks=list(group_blocks or []), head_slice=head_slice,
                        kv_digest=kv_digest, **_fresh())  # type: ignore[arg-type]
    return _push_exchange(to, msg, secret, timeout_s, cancel, link)


def request_push(to: Destination, request_id: str, block_ids: list[int], push_id: bytes, agent: AgentInfo,
                 source_rows: bytes, target_rows: bytes, window_s: float, requester_engine_id: str,
                 secret: bytes | None = None, timeout_s: float = 1.0, cancel: threading.Event | None = None,
                 link: HoldLink | None = None, kv_digest: bool = False) -> PushReply:
    """Ask prefill rank ``to`` to WRITE ``request_id``'s blocks into this rank's memory
    (:class:`PushRequest`: its fields, units and checks; ``kv_digest``: its notification carries the WRITE's
    digest, verified KV).

    With ``link`` (to ``to``'s side channel) the request goes over that long-lived connection.

    Returns:
        The :class:`PushReply` (``accepted``: the WRITE's notification follows).

    Raises:
        HandshakeTimeoutError: no reply within ``timeout_s`` seconds (the WRITE
            may still have been queued: wait out ``window_s`` before reusing
            the target memory).
        RemoteRefusedError: the server refused the request (another engine or
            rank, stale, or a server that takes no pushes).
        HandshakeError: any other failure (bad reply, authentication, a reply to another request).
    """
    msg = PushRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=to.engine_id, to_rank=to.rank,
                      requester_engine_id=requester_engine_id, request_id=request_id, block_ids=block_ids,
                      push_id=push_id, agent=agent, source_rows=source_rows, target_rows=target_rows,
                      window_s=window_s, kv_digest=kv_digest, **_fresh())  # type: ignore[arg-type]
    return _push_exchange(to, msg, secret, timeout_s, cancel, link)


def _answer(reply: list[bytes] | None, kind: type[R], nonces: list[bytes], endpoint: str, secret: bytes | None,
            timeout_s: float, cancel: threading.Event | None, max_message_bytes: int) -> R:
    """The ``kind`` reply to the request sent last under ``nonces`` (or an earlier one: a question asked again),
    checked in this order: a reply at all (cancelled, else timed out), an unsigned refusal of our
    authentication, the codec's checks, a refusal, the message type, the nonce.

    Raises:
        HandshakeCancelledError: no reply and ``cancel`` is set.
        HandshakeTimeoutError: no reply within ``timeout_s`` seconds.
        RemoteRefusedError: the server refused the request.
        HandshakeError: any other failure (bad reply, authentication, another type, a reply to another request).
    """
    if reply is None and cancel is not None and cancel.is_set():
        raise HandshakeCancelledError(f"side-channel call to {endpoint} cancelled (shutting down)")
    if reply is None:
        raise HandshakeTimeoutError(f"no reply from {endpoint} within {timeout_s:g} s")
    if (refusal := _unsigned_auth_refusal(reply, max_message_bytes)) is not None:
        raise RemoteRefusedError(refusal.code, refusal.field, refusal.message, endpoint=endpoint)
    answer = decode(reply, secret, max_message_bytes)
    if isinstance(answer, ErrorReply):
        _check_refusal(answer, answer.nonce if answer.nonce in nonces else nonces[-1], endpoint)
    if not isinstance(answer, kind):
        raise MalformedMessageError(f"{endpoint} answered with {type(answer).__name__}", field="type")
    if answer.nonce not in nonces:
        raise MalformedMessageError(f"reply from {endpoint} answers another request", field="nonce")
    return answer


def _hold_requests(kind: type[HoldRequest], to: Destination, request_ids: list[str],
                   block_ids: list[list[int]] | None, requester_engine_id: str,
                   digest_rows: list[bytes] | None = None, **fields: float) -> list[HoldRequest]:
    """``kind`` requests for ``request_ids`` (with their ``block_ids``, unless None, and their
    ``digest_rows``, unless None or all empty) to rank ``to``, each with its own time and nonce: as many as it
    takes to carry at most :data:`~handshake.messages.MAX_HEARTBEAT_IDS` ids,
    :data:`~handshake.messages.MAX_HOLD_BLOCK_IDS` block ids and :data:`~handshake.messages.MAX_PUSH_ROWS` digest
    rows each (one request when there are no ids).

    Raises:
        ValueError: ``block_ids`` or ``digest_rows`` does not have one entry per request id, or one is longer
            than :data:`~handshake.messages.MAX_HOLD_BLOCK_IDS` block ids or
            :data:`~handshake.messages.MAX_PUSH_ROWS` rows.
    """
    if block_ids is not None and len(block_ids) != len(request_ids):
        raise ValueError(f"block_ids has {len(block_ids)} lists for {len(request_ids)} request ids")
    if digest_rows is not None and not any(digest_rows):
        digest_rows = None
    if digest_rows is not None and len(digest_rows) != len(request_ids):
        raise ValueError(f"digest_rows has {len(digest_rows)} entries for {len(request_ids)} request ids")
    chunks: list[tuple[int, int]] = []  # [start, end) of each request's ids
    start, blocks, rows = 0, 0, 0
    for i in range(len(request_ids)):
        n = 0 if block_ids is None else len(block_ids[i])
        r = 0 if digest_rows is None else len(digest_rows[i]) // ROW_BYTES
        if n > MAX_HOLD_BLOCK_IDS or r > MAX_PUSH_ROWS:
            raise ValueError(f"request {request_ids[i][:64]!r} has {n} block ids and {r} digest rows, more than a "
                             f"hold request carries ({MAX_HOLD_BLOCK_IDS}, {MAX_PUSH_ROWS})")
        if i - start == MAX_HEARTBEAT_IDS or blocks + n > MAX_HOLD_BLOCK_IDS or rows + r > MAX_PUSH_ROWS:
            chunks.append((start, i))
            start, blocks, rows = i, 0, 0
        blocks += n
        rows += r
    chunks.append((start, len(request_ids)))
    out = []
    for a, b in chunks:
        extra: dict[str, object] = {} if block_ids is None else {"block_ids": block_ids[a:b]}
        if digest_rows is not None:
            extra["digest_rows"] = digest_rows[a:b]
        out.append(kind(protocol_version=PROTOCOL_VERSION, to_engine_id=to.engine_id, to_rank=to.rank,
                        requester_engine_id=requester_engine_id, request_ids=request_ids[a:b],
                        **extra, **fields, **_fresh()))  # type: ignore[arg-type]
    return out


def _hold_exchange(to: Destination, msgs: list[HoldRequest], secret: bytes | None, timeout_s: float,
                   max_message_bytes: int, cancel: threading.Event | None,
                   link: HoldLink | None = None, attempts: int = 1) -> HoldsReply:
    """Send each message (each up to ``attempts`` times, see :func:`query_holds`), check each reply is that
    message's answer, and sum them."""
    endpoint = to.endpoint
    ctx = zmq.Context.instance()  # shared: a heartbeat also fences every finished pull, so it must be cheap
    total = HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=0)
    for msg in msgs:
        reply, nonces = None, []
        for sent in _attempts(msg, attempts):
            nonces.append(sent.nonce)
            frames = encode(sent, secret)
            reply = (link.exchange(frames, sent.nonce, secret, timeout_s, cancel, nonces[:-1]) if link is not None
                     else exchange(ctx, to.host, endpoint, frames, timeout_s, cancel, secret, sent.nonce))
            if reply is not None or (cancel is not None and cancel.is_set()):
                break
        answer = _answer(reply, HoldsReply, nonces, endpoint, secret, timeout_s, cancel, max_message_bytes)
        if answer.request_ids != msg.request_ids:
            raise MalformedMessageError(f"reply from {endpoint} answers another request", field="nonce")
        asked = len(getattr(msg, "digest_rows", ()))
        if asked and len(answer.digests) != asked:
            raise MalformedMessageError(f"reply from {endpoint} has {len(answer.digests)} digests for {asked} "
                                        "requests", field="digests")
        digests = answer.digests if asked else [b""] * len(msg.request_ids)
        total = HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=total.accepted + answer.accepted,
                           expired=total.expired + answer.expired, not_held=total.not_held + answer.not_held,
                           unknown=total.unknown + answer.unknown, digests=total.digests + digests)
    return total


def _attempts(msg: HoldRequest, attempts: int) -> Iterator[HoldRequest]:
    """``msg``, then up to ``attempts - 1`` copies of it, each with its own time and nonce."""
    yield msg
    for _ in range(attempts - 1):
        yield msgspec.structs.replace(msg, **_fresh())
