"""Small ZMQ helpers shared by the server and the client: addresses, limits, CURVE encryption."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from handshake.codec import FRAME_BYTES

__all__ = ["FRAME_LIMIT", "HANDSHAKE_S", "CurveKeys", "configure_socket", "tcp_address", "tcp_endpoint"]

RECEIVE_QUEUE_MESSAGES = 64
"""Messages a side-channel socket queues before ZMQ stops reading from that peer (``ZMQ_RCVHWM``)."""

CURVE_FRAME_OVERHEAD = 33
"""Bytes CURVE adds to a frame on the wire (its MESSAGE command: name 8, nonce 8, MAC 16, flags 1); ZMQ's
per-frame limit counts them."""

FRAME_LIMIT = FRAME_BYTES + 64
"""Per-frame limit (bytes) given to ``ZMQ_MAXMSGSIZE``: the largest payload frame
(:data:`handshake.codec.FRAME_BYTES`) plus the CURVE framing (:data:`CURVE_FRAME_OVERHEAD`, rounded up).

A peer sending a longer frame is disconnected by libzmq before the frame is buffered, and this holds before
the CURVE handshake too (its commands are frames): so it is also the most a connection that never completes
the handshake can make a side channel buffer (``docs/security.md``)."""

HANDSHAKE_S = 5.0
"""Seconds a connection may take to complete the ZMTP/CURVE handshake (``ZMQ_HANDSHAKE_IVL``; libzmq's
default is 30): a peer that has not completed it by then is disconnected. An honest one takes about 3 ms."""


def _is_ipv6(host: str) -> bool:
    return ":" in host


def tcp_address(host: str) -> str:
    """``tcp://host`` (no port), with IPv6 literals in brackets."""
    if _is_ipv6(host) and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}"


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port``, with IPv6 literals in brackets."""
    return f"{tcp_address(host)}:{port}"


@dataclass(frozen=True)
class CurveKeys:
    """The side channel's CURVE key pairs (Z85 text, 40 bytes each), derived from the shared secret.

    Every server has the server pair and every client the client pair: a
    client that completes the CURVE handshake (CurveZMQ, the CurveCP
    handshake of D. J. Bernstein as ZMTP 3 specifies it) knows the server
    holds the secret, the server's ZAP check admits only the client public
    key, and everything after the handshake is encrypted, so a passive
    observer of the network learns no agent metadata.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def derive(secret: bytes) -> CurveKeys:
        """The key pairs of ``secret`` (SHA-256 of a per-role label and the secret as each secret key)."""
        server = z85.encode(hashlib.sha256(b"p2pkv side channel CURVE server key\0" + secret).digest())
        client = z85.encode(hashlib.sha256(b"p2pkv side channel CURVE client key\0" + secret).digest())
        return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def configure_socket(sock: zmq.Socket, host: str, *, secret: bytes | None = None, server: bool = False,
                     handshake_s: float = HANDSHAKE_S) -> None:
    """Linger 0, frame size limit, handshake time limit, receive queue, IPv6 support and (with ``secret``)
    CURVE on a fresh socket.

    Args:
        sock: a new ZMQ socket (before bind/connect).
        host: the address it binds or connects to.
        secret: the shared secret; when set the socket speaks CURVE with the
            keys :meth:`CurveKeys.derive` makes of it.
        server: the socket binds (CURVE server; its context needs the ZAP
            handler of :func:`handshake.server` to check client keys).
        handshake_s: seconds a connection may take to complete its handshake
            (``ZMQ_HANDSHAKE_IVL``; :data:`HANDSHAKE_S`).

    Raises:
        ValueError: ``handshake_s`` is not positive.
    """
    if not handshake_s > 0:
        raise ValueError(f"handshake_s must be > 0 seconds, got {handshake_s}")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, FRAME_LIMIT)
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_s * 1000)))
    sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
    if _is_ipv6(host):
        sock.setsockopt(zmq.IPV6, 1)
    if secret:
        keys = CurveKeys.derive(bytes(secret))
        if server:
            sock.curve_server = True
            sock.curve_secretkey = keys.server_secret
            sock.zap_domain = b"p2pkv"
        else:
            sock.curve_serverkey = keys.server_public
            sock.curve_publickey = keys.client_public
            sock.curve_secretkey = keys.client_secret
