"""Small ZMQ helpers shared by the server and the client."""

from __future__ import annotations

import zmq

__all__ = ["configure_socket", "tcp_address", "tcp_endpoint", "transport_limit"]


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


def configure_socket(sock: zmq.Socket, host: str, max_message_bytes: int) -> None:
    """Linger 0, frame size limit and IPv6 support on a fresh socket."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, transport_limit(max_message_bytes))
    if _is_ipv6(host):
        sock.setsockopt(zmq.IPV6, 1)
