"""Control channel of a two-node ``p2pkv bench transfer`` (``--role prefill`` / ``--role decode``).

The two processes of the benchmark exchange a few small messages besides
NIXL's own traffic: which side-channel ports serve which cache, what the
prefill registered (blocks per cache, seed, shape), and, at the end, that the
decode side is done and what the prefill measured. On one host
(``--role both``) they travel over multiprocessing queues; across nodes over
this channel: one plain TCP connection from the decode to the prefill's
``--control-port``, carrying one JSON object per line (UTF-8, ``\\n``
terminated), request then reply:

=================================  =========================================
decode → prefill                   prefill → decode
=================================  =========================================
``{"op": "hello", ...}``           ``{"op": "ready", "layouts": ..., ...}``
``{"op": "push_plan", ...}``       ``{"op": "push_planned", ...}``; with
                                   ``--mode push``: the messages of
                                   :mod:`p2pkv.tools.bench.transfer_push`
``{"op": "done"}``                 ``{"op": "bye", "notifs": ..., ...}``
=================================  =========================================

The prefill listens only once its caches are registered and its side
channels serve, so a connection that is accepted means "ready". It serves
one decode connection at a time; a connection that closes without ``done``
(a port probe, a failed decode) is dropped and the next one accepted. After
``bye`` it exits. Units: seconds; messages are at most :data:`MAX_LINE_BYTES`.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

MAX_LINE_BYTES = 1 << 20
"""Longest control message accepted (bytes, one JSON line)."""


class PeerError(ConnectionError):
    """The prefill named by ``--peer`` cannot be reached, or broke the control protocol."""


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def _decode(line: bytes) -> dict[str, Any] | None:
    """One received line (without its newline) as the JSON object it holds; None when it holds none."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


class ControlServer:
    """The prefill's end: a listening TCP socket, one decode connection at a time.

    Args:
        host: address to bind (the prefill's ``--host``).
        port: TCP port (the prefill's ``--control-port``; 0: ephemeral).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind((host, port))
            self._listen.listen(4)
        except OSError:
            self._listen.close()
            raise
        self.port: int = self._listen.getsockname()[1]
        """The bound TCP port."""
        self.peer: str | None = None
        """Address of the decode connected now (None: none)."""
        self._conn: socket.socket | None = None
        self._buf = b""

    def poll(self, timeout_s: float) -> dict[str, Any] | None:
        """Wait up to ``timeout_s`` seconds for the connected decode's next message.

        Accepts a connection when none is open. Returns the message, or
        ``{"op": "closed"}`` when the decode closed its connection (or sent
        something that is not a JSON object line), or None when nothing
        complete arrived in time.
        """
        if self._conn is not None and b"\n" in self._buf:
            return self._take_line()
        ready, _, _ = select.select([self._conn or self._listen], [], [], timeout_s)
        if not ready:
            return None
        if self._conn is None:
            conn, addr = self._listen.accept()
            conn.settimeout(30.0)  # replies are tiny; a decode that stops reading is dropped
            self._conn, self.peer, self._buf = conn, str(addr[0]), b""
            return None
        try:
            data = self._conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            return self._drop()
        self._buf += data
        if b"\n" in self._buf:
            return self._take_line()
        return self._drop() if len(self._buf) > MAX_LINE_BYTES else None

    def _take_line(self) -> dict[str, Any]:
        line, _, self._buf = self._buf.partition(b"\n")
        msg = _decode(line)
        return msg if msg is not None else self._drop()

    def _drop(self) -> dict[str, Any]:
        if self._conn is not None:
            self._conn.close()
        self._conn, self.peer, self._buf = None, None, b""
        return {"op": "closed"}

    def reply(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the connected decode (dropped silently if it is gone)."""
        if self._conn is None:
            return
        try:
            self._conn.sendall(_encode(msg))
        except OSError:
            self._drop()

    def close(self) -> None:
        """Close the connection and the listening socket."""
        self._drop()
        self._listen.close()


class ControlClient:
    """The decode's end: one connection to the prefill at ``--peer``.

    Args:
        host: the prefill's address (``--peer``).
        port: its control port.
        timeout_s: how long to keep trying to connect (seconds; ``--peer-timeout``).

    Raises:
        PeerError: nothing accepted a connection within ``timeout_s`` (the
            message names ``--peer``).
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port = host, port
        deadline = time.monotonic() + timeout_s
        last: OSError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(
                    f"--peer {host}: no prefill answered on control port {port} within {timeout_s:g} s "
                    f"({last or 'no attempt'}); start `p2pkv bench transfer --role prefill` there first, with the "
                    "same --port/--control-port, or raise --peer-timeout")
            try:
                self._sock = socket.create_connection((host, port), timeout=min(left, 5.0))
                break
            except OSError as exc:
                last = exc
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.local_address: str = str(self._sock.getsockname()[0])
        """This side's address on the connection (the decode node's address towards the prefill)."""
        self._buf = b""

    def request(self, msg: dict[str, Any], expect: str, timeout_s: float) -> dict[str, Any]:
        """Send ``msg`` and return the reply, which must have ``"op": expect``.

        Raises:
            PeerError: the prefill closed the connection, did not answer within
                ``timeout_s`` seconds, or answered something else.
        """
        self.send(msg)
        return self.receive(expect, timeout_s, str(msg.get("op")))

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` without waiting for the reply (:meth:`receive` takes it).

        Raises:
            PeerError: the connection failed.
        """
        try:
            self._sock.sendall(_encode(msg))
        except OSError as exc:
            raise PeerError(f"{self._where()}: control connection failed: {exc}") from exc

    def _where(self) -> str:
        return f"--peer {self.host} (control port {self.port})"

    def receive(self, expect: str | None, timeout_s: float, asked: str = "") -> dict[str, Any]:
        """The next reply (waits up to ``timeout_s`` seconds); it must have ``"op": expect`` unless
        ``expect`` is None. ``asked`` names the request in errors.

        Raises:
            PeerError: the prefill closed the connection, did not answer in
                time, or answered something else.
        """
        where = self._where()
        try:
            self._sock.settimeout(timeout_s)
            while b"\n" not in self._buf:
                self._recv_some(asked)
        except TimeoutError as exc:
            raise PeerError(f"{where}: no answer to {asked!r} within {timeout_s:g} s") from exc
        except PeerError:
            raise
        except OSError as exc:
            raise PeerError(f"{where}: control connection failed: {exc}") from exc
        line, _, self._buf = self._buf.partition(b"\n")
        reply = _decode(line)
        if reply is None or (expect is not None and reply.get("op") != expect):
            raise PeerError(f"{where}: expected a {expect or 'JSON object'!r} reply, got {line[:200]!r}")
        return reply

    def _recv_some(self, asked: str) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise PeerError(f"{self._where()}: the prefill closed the control connection before answering "
                            f"{asked!r} (see its log)")
        self._buf += data
        if len(self._buf) > MAX_LINE_BYTES:
            raise PeerError(f"{self._where()}: control reply longer than {MAX_LINE_BYTES} B")

    def try_receive(self) -> dict[str, Any] | None:
        """The next reply if a whole one has arrived, else None (does not wait).

        Raises:
            PeerError: as :meth:`receive`.
        """
        try:
            while b"\n" not in self._buf and select.select([self._sock], [], [], 0)[0]:
                self._recv_some("")
        except OSError as exc:
            raise PeerError(f"{self._where()}: control connection failed: {exc}") from exc
        return self.receive(None, 1.0) if b"\n" in self._buf else None

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()
