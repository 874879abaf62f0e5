"""Small ZMQ helpers shared by the server and the client: addresses, limits, CURVE encryption."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

__all__ = ["CurveKeys", "configure_socket", "tcp_address", "tcp_endpoint", "transport_limit"]

RECEIVE_QUEUE_MESSAGES = 64
"""Messages a side-channel socket queues before ZMQ stops reading from that peer (``ZMQ_RCVHWM``)."""


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


def transport_limit(max_message_bytes: int) -> int:
    """Per-frame limit (bytes) given to ZMQ_MAXMSGSIZE.

    Twice the application limit: frames slightly over ``max_message_bytes``
    still reach the application and get a typed ``too_large`` refusal, while
    grossly oversized frames are dropped by libzmq before they are buffered
    (the sending peer is disconnected, so it sees a timeout).
    """
    return 2 * max_message_bytes


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


def configure_socket(sock: zmq.Socket, host: str, max_message_bytes: int, secret: bytes | None = None,
                     server: bool = False) -> None:
    """Linger 0, frame size limit, receive queue, IPv6 support and (with ``secret``) CURVE on a fresh socket.

    Args:
        sock: a new ZMQ socket (before bind/connect).
        host: the address it binds or connects to.
        max_message_bytes: application message limit (bytes); see :func:`transport_limit`.
        secret: the shared secret; when set the socket speaks CURVE with the
            keys :meth:`CurveKeys.derive` makes of it.
        server: the socket binds (CURVE server; its context needs the ZAP
            handler of :func:`handshake.server` to check client keys).
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, transport_limit(max_message_bytes))
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
