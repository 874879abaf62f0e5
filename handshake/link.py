"""One side-channel request and its reply over a ZMQ DEALER socket: on a fresh socket (:func:`exchange`), or on
a long-lived connection to one prefill rank (:class:`HoldLink`). Times are logged at DEBUG on
``p2pkv.handshake.timing``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection

import zmq

from handshake._net import configure_socket, tcp_endpoint
from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.codec import decode
from handshake.errors import HandshakeError
from handshake.messages import ErrorReply, HoldsReply, PushReply

logger = logging.getLogger("p2pkv.handshake")
timing_logger = logging.getLogger("p2pkv.handshake.timing")


def exchange(
    ctx: zmq.Context,
    host: str,
    endpoint: str,
    frames: list[bytes],
    timeout_s: float,
    cancel: threading.Event | None = None,
    secret: bytes | None = None,
    nonce: bytes = b"",
) -> list[bytes] | None:
    """Send one request (its ``nonce``, for the timing log) on a fresh socket (CURVE with ``secret``); the reply
    frames, or None on timeout or cancel."""
    sock = ctx.socket(zmq.DEALER)
    try:
        configure_socket(sock, host, secret=secret)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise HandshakeError(
                f"cannot connect to {endpoint}: {exc}; pass a valid host and port",
                field="host",
                code="config",
            ) from exc
        return await_reply(sock, endpoint, frames, nonce, None, timeout_s, cancel)
    finally:
        sock.close(linger=0)


def await_reply(sock: zmq.Socket, endpoint: str, frames: list[bytes], nonce: bytes,
                 checks: tuple[bytes | None, int] | None, timeout_s: float,
                 cancel: threading.Event | None, earlier: Collection[bytes] = ()) -> list[bytes] | None:
    """Send ``frames`` (the request with ``nonce``) on ``sock`` and wait up to ``timeout_s`` seconds for the
    reply: the first one, or with ``checks`` (secret, size limit: a long-lived connection) the first one that
    decodes to a reply with that nonce or one of the ``earlier`` ones (or none: a refusal of a request that
    did not decode) or does not decode at all (the caller explains it); replies to other earlier requests
    are skipped. None on timeout or cancel, or when ZMQ's send queue is full.

    The socket is looked at once more after the deadline, so a reply that came in time is not lost because
    this thread got the CPU only later. Times are logged at DEBUG on ``p2pkv.handshake.timing``.
    """
    sent = time.monotonic()
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        logger.warning("side-channel request to %s not sent: ZMQ's send queue to it is full", endpoint)
        return None
    deadline, skipped = sent + timeout_s, 0
    while True:
        left = deadline - time.monotonic()
        last = left <= 0 or (cancel is not None and cancel.is_set())
        if not sock.poll(0 if last else max(1, int(min(left, 0.1) * 1000)), zmq.POLLIN):
            if last:
                if timing_logger.isEnabledFor(logging.DEBUG):
                    timing_logger.debug("side channel %s: no reply to %s within %.1f ms (sent at %.6f; %d "
                                        "replies to earlier requests skipped)", endpoint, nonce[:4].hex(),
                                        (time.monotonic() - sent) * 1e3, sent, skipped)
                return None
            continue
        reply = sock.recv_multipart(zmq.NOBLOCK)
        if checks is not None and not _answers(reply, {nonce, *earlier}, *checks):
            skipped += 1
            continue
        if timing_logger.isEnabledFor(logging.DEBUG):
            timing_logger.debug("side channel %s: reply to %s after %.2f ms (sent at %.6f; %d replies to earlier "
                                "requests skipped)", endpoint, nonce[:4].hex(), (time.monotonic() - sent) * 1e3,
                                sent, skipped)
        return reply


def _answers(reply: list[bytes], nonces: Collection[bytes], secret: bytes | None, max_message_bytes: int) -> bool:
    """True unless ``reply`` is a well-formed reply to another request than those with ``nonces``."""
    try:
        answer = decode(reply, secret, max_message_bytes)
    except HandshakeError:
        return True  # the caller explains it
    return not isinstance(answer, HoldsReply | PushReply | ErrorReply) or not answer.nonce or answer.nonce in nonces


class HoldLink:
    """A long-lived connection to one prefill rank's side channel, for fence questions and push requests.

    A fresh socket per question costs a TCP connect and handshake (about
    0.5 ms on loopback, more on a busy host); a decode worker asks each
    prefill rank twice per pull. Calls on one link are serialized (a lock);
    a reply to an earlier call that timed out is recognised by its nonce and
    skipped. ZMQ reconnects by itself after the peer restarts.

    Args:
        host / port: the prefill rank's side channel.
        secret: the shared secret (CURVE; the same one the calls sign with), or None.
        max_message_bytes: largest reply accepted (bytes).
    """

    def __init__(self, host: str, port: int, secret: bytes | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.host, self.port, self.max_message_bytes = host, port, max_message_bytes
        self._lock = threading.Lock()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        configure_socket(self._sock, host, secret=secret)
        self.endpoint = tcp_endpoint(host, port)
        self._sock.connect(self.endpoint)

    def exchange(self, frames: list[bytes], nonce: bytes, secret: bytes | None, timeout_s: float,
                 cancel: threading.Event | None, earlier: Collection[bytes] = ()) -> list[bytes] | None:
        """Send ``frames``; the reply frames to them (matched by ``nonce``, or by one of the ``earlier``
        nonces: requests this one asks again), or None on timeout or cancel.

        Replies to other earlier calls that timed out are skipped. A reply
        that arrived within ``timeout_s`` seconds is taken even when this
        thread gets to look only later (a busy host)."""
        with self._lock:
            return await_reply(self._sock, self.endpoint, frames, nonce, (secret, self.max_message_bytes),
                                timeout_s, cancel, earlier)

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            self._sock.close(linger=0)
