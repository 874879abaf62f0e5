"""How many peers may be connected to a side-channel server at once, and how many of them may not yet be past
their HELLO.

libzmq accepts every TCP connection, and one that offers CURVE but never completes the handshake costs the
server what it buffered of the frame it is sending (at most :data:`handshake._net.FRAME_LIMIT` bytes) until
libzmq drops it (:data:`handshake._net.HANDSHAKE_S`). :class:`ConnectionLimits` bounds how many such
connections there are at once.

It follows the server socket's connections with a ZMQ socket monitor (``ACCEPTED``, with the connection's
file descriptor, and ``DISCONNECTED``) and tells the connections whose HELLO the server has answered from the
others by the kernel's count of bytes the server sent on each (``TCP_INFO``): more than the 64-byte ZMTP
greeting means a WELCOME went out, which only a peer that knows the server's public key (derived from the
secret) gets; without a secret (no CURVE), more than the greeting means the handshake is done. Connections
beyond the limits are cut by shutting their TCP socket down; libzmq then closes them as if the peer had:

* more than ``max_handshakes`` connections not past their HELLO: the oldest of them are cut (an honest peer
  is past it within about a millisecond, a hostile one never);
* more than ``max_connections`` in all: the newest are cut, those not past their HELLO first.

libzmq reports a server socket's connections in the order they happen (the server's context has one I/O
thread) and a connection's ``DISCONNECTED`` before its descriptor is closed, and a cut connection leaves the
books at once: so a descriptor number reused for a later connection names that connection. Linux only
(``TCP_INFO``); elsewhere every connection counts as past its HELLO and only ``max_connections`` applies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["MAX_CONNECTIONS", "MAX_HANDSHAKES", "ConnectionLimits"]

logger = logging.getLogger("p2pkv.handshake")

MAX_CONNECTIONS = 1024
"""Default for the peers connected to one side channel at once. A prefill rank's side channel holds one
long-lived connection per decode rank that reads from it (fence questions and push requests) and a few
short-lived ones per decode rank (first handshake, lease heartbeats, releases; the proxy's releases), each
closed within milliseconds: 1024 leaves room for about 900 decode ranks."""

MAX_HANDSHAKES = 64
"""Default for the connections not yet past their HELLO at once: honest ones are past it within about a
millisecond, so only a burst of new connections (many decode ranks starting at the same moment) has more
than a few; hostile ones cost at most :data:`handshake._net.FRAME_LIMIT` bytes each (about 16 MiB for 64)."""

GREETING_BYTES = 64
"""Bytes of the ZMTP 3 greeting, all a server sends on a connection before it has answered a HELLO."""

_TCPI_BYTES_ACKED = 120
"""Offset in Linux's ``struct tcp_info`` of ``tcpi_bytes_acked`` (u64, since Linux 4.2): bytes sent and acknowledged."""

_WARN_EVERY_S = 10.0


def _shut_down(fd: int) -> None:
    """Shut the TCP connection on ``fd`` down (both ways), leaving ``fd`` to its owner; errors ignored."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket (any more)
        os.close(dup)
        return
    with sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _past_hello(fd: int) -> bool | None:
    """Whether the server has sent more than its greeting on ``fd`` (None: the kernel does not say)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with sock:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_ACKED + 8)
        except (OSError, AttributeError):
            return None
    if len(info) < _TCPI_BYTES_ACKED + 8:
        return None
    return struct.unpack_from("=Q", info, _TCPI_BYTES_ACKED)[0] > GREETING_BYTES


class ConnectionLimits:
    """Cuts a server socket's connections beyond ``max_connections``, and those not past their HELLO beyond
    ``max_handshakes`` (see the module's text). Used from one thread (the server's).

    Args:
        sock: the server's socket, before it binds (its monitor must see every connection).
        max_connections: most connections at once.
        max_handshakes: most connections not yet past their HELLO at once.
        stats: counters ``"connections_cut"`` (all cuts) and ``"connections_cut_handshaking"`` (cuts over
            ``max_handshakes``) are added to it.

    Raises:
        ValueError: a limit below 1, or ``max_handshakes`` above ``max_connections``.
    """

    def __init__(self, sock: zmq.Socket, max_connections: int, max_handshakes: int, stats: dict[str, int]) -> None:
        if max_connections < 1 or not 1 <= max_handshakes <= max_connections:
            raise ValueError(f"need 1 <= max_handshakes ({max_handshakes}) <= max_connections ({max_connections})")
        self.max_connections, self.max_handshakes = max_connections, max_handshakes
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        """The monitor's socket: poll it for input, then call :meth:`update`."""
        self._sock = sock
        self._open: dict[int, bool] = {}  # descriptor -> past its HELLO; in the order accepted
        self._stats = stats
        self._unreported = 0
        self._warned_at = 0.0

    @property
    def connections(self) -> int:
        """Connections open now, as far as the monitor has said."""
        return len(self._open)

    def update(self) -> int:
        """Take every event the monitor has queued, then cut the connections beyond the limits.

        Returns:
            How many connections were cut.
        """
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.pop(fd, None)
                self._open[fd] = False
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.pop(fd, None)
        return self._enforce()

    def _enforce(self) -> int:
        handshaking = [fd for fd, past in self._open.items() if not past and not self._check(fd)]
        cut = 0
        while len(handshaking) > self.max_handshakes:  # the oldest first
            cut += self._cut(handshaking.pop(0), "handshaking")
        while len(self._open) > self.max_connections:  # the newest first, those not past their HELLO before
            cut += self._cut(handshaking.pop() if handshaking else next(reversed(self._open)), "")
        return cut

    def _check(self, fd: int) -> bool:
        """Whether ``fd`` is past its HELLO now (remembered once it is; unknown counts as past)."""
        past = _past_hello(fd)
        if past is None or past:
            self._open[fd] = True
            return True
        return False

    def _cut(self, fd: int, why: str) -> int:
        self._open.pop(fd, None)
        _shut_down(fd)
        self._stats["connections_cut"] = self._stats.get("connections_cut", 0) + 1
        if why:
            key = f"connections_cut_{why}"
            self._stats[key] = self._stats.get(key, 0) + 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            logger.warning("side channel: cut %d connection(s) over its limits (%d connected at most, %d of them "
                           "before their handshake; MAX_CONNECTIONS, MAX_HANDSHAKES in handshake.connections)",
                           self._unreported, self.max_connections, self.max_handshakes)
            self._warned_at, self._unreported = now, 0
        return 1

    def close(self) -> None:
        """Stop the monitor and close its socket (on the thread that used it, before the context ends)."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(linger=0)
