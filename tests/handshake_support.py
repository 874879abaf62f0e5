"""Test support: sample AgentInfo, a handshake server in its own process, a fake side channel in a thread.

Used by the side-channel tests and by tests of code that talks to a side
channel. Imports neither vllm nor torch. The parent and the server process
talk over a ``multiprocessing`` pipe with msgpack-encoded bytes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from handshake._net import CurveKeys, configure_socket
from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.codec import compute_digest
from handshake.messages import AgentInfo, KVLayoutDesc, KVRegion
from handshake.server import HandshakeServer

__all__ = ["ServerProcess", "curve_authenticator", "fake_router", "make_agent_info"]


def make_agent_info(
    tp_rank: int = 0,
    *,
    engine_id: str = "prefill-engine",
    compat_hash: str = "compat-test",
    tp_size: int = 1,
    agent_metadata: bytes | None = None,
) -> AgentInfo:
    """A self-consistent :class:`AgentInfo` (valid digest) for tests."""
    metadata = agent_metadata if agent_metadata is not None else b"nixl-agent-metadata-%d" % tp_rank
    num_blocks, block_len = 16, 4096
    layout = KVLayoutDesc(
        kv_layout="LBHNC",
        attn_layout="HND",
        dtype="bfloat16",
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        num_blocks=num_blocks,
        block_len=block_len,
        block_stride=block_len,
        mem_type="DRAM",
        regions=[
            KVRegion(
                base_addr=0x7F00_0000_0000 + i * num_blocks * block_len,
                length=num_blocks * block_len,
                layer_start=i // 2,
                num_layers=1,
                kv_index=i % 2,
            )
            for i in range(4)
        ],
    )
    return AgentInfo(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        agent_name=f"{engine_id}-rank{tp_rank}",
        agent_metadata=metadata,
        metadata_digest=compute_digest(metadata),
        compat_hash=compat_hash,
        layout=layout,
    )


def curve_authenticator(ctx: zmq.Context, secret: bytes) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that admits only the client key derived from ``secret``.

    What :class:`HandshakeServer` runs when it has a secret, for test fakes that
    play a server with their own ROUTER socket (configured with
    ``handshake._net.configure_socket(sock, host, secret=secret, server=True)``).
    Stop it (``.stop()``) before terminating ``ctx``.
    """
    client_public = CurveKeys.derive(secret).client_public

    class _Key:
        @staticmethod
        def callback(domain: str, key: bytes) -> bool:
            return key == client_public

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("p2pkv", _Key())
    return auth


@contextlib.contextmanager
def fake_router(respond: Callable[[list[bytes]], list[bytes] | None] | None, *, secret: bytes | None = None,
                port: int = 0, host: str = "127.0.0.1",
                delay_s: float | Callable[[list[bytes]], float] = 0.0) -> Iterator[tuple[int, list[list[bytes]]]]:
    """A side channel played by a ROUTER socket in a thread (a CURVE server of ``secret`` when set, on ``port`` or
    a random one): records each request and answers it with ``respond(body)`` after ``delay_s`` (seconds, or
    ``delay_s(body)``); ``respond=None``, or an answer ``None`` or ``[]``, leaves it unanswered. Yields
    ``(port, requests received)``."""
    ctx = zmq.Context()
    auth = curve_authenticator(ctx, secret) if secret else None
    sock = ctx.socket(zmq.ROUTER)
    configure_socket(sock, host, secret=secret, server=True)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    received: list[list[bytes]] = []
    stop = threading.Event()

    def loop() -> None:
        due: list[tuple[float, list[bytes]]] = []
        while not stop.is_set():
            if sock.poll(5):
                identity, *body = sock.recv_multipart()
                received.append(body)
                if respond is not None and (reply := respond(body)):
                    delay = delay_s(body) if callable(delay_s) else delay_s
                    due.append((time.monotonic() + delay, [identity, *reply]))
            now = time.monotonic()
            for item in [x for x in due if x[0] <= now]:
                due.remove(item)
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(item[1], zmq.NOBLOCK)
        sock.close(0)

    thread = threading.Thread(target=loop, name="fake-side-channel", daemon=True)
    thread.start()
    try:
        yield port, received
    finally:
        stop.set()
        thread.join(2)
        if auth is not None:
            auth.stop()
        ctx.term()


def _serve_child(
    conn: Connection,
    host: str,
    compat_hash: str,
    infos: list[bytes],
    secret: bytes | None,
    max_message_bytes: int,
    log_level: int,
    options: dict[str, float],
) -> None:
    """Entry point of the server process: serve until the parent says stop."""
    logging.getLogger("p2pkv.handshake").setLevel(log_level)
    decoder = msgspec.msgpack.Decoder(AgentInfo)
    server = HandshakeServer(host, 0, compat_hash, secret=secret, max_message_bytes=max_message_bytes,
                             **options)  # type: ignore[arg-type]
    try:
        for raw in infos:
            server.set_info(decoder.decode(raw))
        server.start()
    except Exception as exc:
        conn.send_bytes(msgspec.msgpack.encode({"error": repr(exc)}))
        return
    conn.send_bytes(msgspec.msgpack.encode({"port": server.port}))
    try:
        conn.recv_bytes()  # "stop", or EOFError when the parent is gone
    except (EOFError, OSError):
        pass
    finally:
        server.close()
    with contextlib.suppress(OSError):
        conn.send_bytes(msgspec.msgpack.encode({"stats": server.stats}))


class ServerProcess:
    """A :class:`HandshakeServer` on an ephemeral port in a spawned process.

    Args:
        compat_hash: the server's compatibility hash.
        infos: the AgentInfo to publish (one per rank).
        secret: shared HMAC key (bytes) or ``None``.
        max_message_bytes: the server's request size limit (bytes).
        host: interface to bind.
        start_timeout_s: how long (seconds) to wait for the server to listen.
        log_level: level of the ``p2pkv.handshake`` logger in the child.
        server_options: more keyword arguments of :class:`HandshakeServer`
            (``max_connections``, ``max_handshakes``, ``handshake_s``).

    Raises (from :meth:`start`):
        RuntimeError: the server did not start within ``start_timeout_s``.
    """

    def __init__(
        self,
        compat_hash: str,
        infos: list[AgentInfo],
        *,
        secret: bytes | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        host: str = "127.0.0.1",
        start_timeout_s: float = 30.0,
        log_level: int = logging.ERROR,
        server_options: dict[str, float] | None = None,
    ) -> None:
        self.host = host
        self.port = 0
        self.stats: dict[str, int] = {}
        self._timeout_s = start_timeout_s
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        payloads = [msgspec.msgpack.encode(info) for info in infos]
        self._proc = ctx.Process(
            target=_serve_child,
            args=(child_conn, host, compat_hash, payloads, secret, max_message_bytes, log_level,
                  dict(server_options or {})),
            name="p2pkv-handshake-test-server",
            daemon=True,
        )
        self._child_conn = child_conn
        self._closed = False

    def start(self) -> ServerProcess:
        """Spawn the process and wait until it listens; returns ``self``."""
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(self._timeout_s):
            self.close()
            raise RuntimeError(f"handshake test server did not start within {self._timeout_s} s")
        try:
            reply = msgspec.msgpack.decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            self.close()
            raise RuntimeError(
                f"handshake test server process exited (code {self._proc.exitcode}) before listening"
            ) from None
        if "error" in reply:
            self.close()
            raise RuntimeError(f"handshake test server failed to start: {reply['error']}")
        self.port = reply["port"]
        return self

    def is_alive(self) -> bool:
        """Whether the server process is still running."""
        return self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        """The server process's id (None before :meth:`start`)."""
        return self._proc.pid

    def close(self, timeout_s: float = 5.0) -> dict[str, int]:
        """Stop the server and the process; returns the server's ``stats``."""
        if self._proc.pid is None or self._closed:
            return self.stats
        self._closed = True
        try:
            self._conn.send_bytes(b"stop")
            if self._conn.poll(timeout_s):
                self.stats = msgspec.msgpack.decode(self._conn.recv_bytes()).get("stats", {})
        except (EOFError, OSError):
            pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout_s)
        self._conn.close()
        return self.stats

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
