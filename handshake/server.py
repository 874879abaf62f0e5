"""The side-channel server: serves each local rank's AgentInfo over ZMQ."""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

import zmq
from zmq.auth.thread import ThreadAuthenticator

from handshake._net import HANDSHAKE_S, CurveKeys, configure_socket, tcp_address, tcp_endpoint
from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.connections import MAX_CONNECTIONS, MAX_HANDSHAKES, ConnectionLimits
from handshake.dispatch import Dispatcher, RequestTimes
from handshake.errors import HandshakeBindError
from handshake.hold_answers import HoldAnswers, OnDigest, OnHeartbeat, OnPush, OnRelease, OnStream
from handshake.messages import AgentInfo
from handshake.replay import DEFAULT_FUTURE_SKEW_S, DEFAULT_WINDOW_S, ReplayGuard
from handshake.watchdog import StallWatchdog

__all__ = ["HandshakeServer", "RequestTimes"]

logger = logging.getLogger("p2pkv.handshake")
timing_logger = logging.getLogger("p2pkv.handshake.timing")
"""Per-request timings of the server and the client, at DEBUG (one line per request; nothing is formatted
when DEBUG is off)."""

_JOIN_TIMEOUT_S = 2.0


class _ClientKey:
    """ZAP credentials check: admits only the client public key derived from the shared secret."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._client_public


class HandshakeServer:
    """Serves :class:`AgentInfo` per ``tp_rank``, and the hold and push requests, on a ZMQ ROUTER socket.

    Each request is answered with exactly one reply: its handler's (one
    table keyed by request type, :class:`handshake.dispatch.Dispatcher`) or
    an :class:`~handshake.messages.ErrorReply` naming the offending field. Bad
    input never stops the server. Serving happens in a daemon thread that
    polls with a timeout, so :meth:`close` returns within about
    ``poll_interval_s``.

    Args:
        host: interface address to bind (``"0.0.0.0"``, ``"127.0.0.1"``,
            an IPv6 literal, ...).
        port: TCP port; ``0`` picks a free ephemeral port (see :attr:`port`).
        compat_hash: this engine's compatibility fingerprint
            (:mod:`handshake.fingerprints`), published in every ``AgentInfo``. The
            requester compares it with its own and refuses a mismatch; the
            server serves it and logs the differing fields.
        secret: shared HMAC key (bytes); when set, requests must carry a valid
            HMAC frame and replies carry one.
        max_message_bytes: largest accepted request (bytes).
        poll_interval_s: how often (seconds) the serving thread checks for
            :meth:`close`.

        on_heartbeat: called (on the server thread) with the request ids,
            the lease length (seconds) and the block ids (empty for a
            :class:`LeaseHeartbeat`, one list per id for a :class:`HoldQuery`);
            returns a :class:`HoldStatus` (or None: every id held). A server
            without it refuses hold requests. It must be quick and thread-safe.
        on_release: called (on the server thread) with the request ids and
            block ids of a :class:`ReleaseHolds`; returns how many holds with
            exactly those block ids it released. A server without it refuses
            releases.
        on_push: called (on the server thread) with a :class:`PushRequest`;
            returns its ``(status, message)`` (:data:`handshake.messages.PushStatus`).
            A server without it refuses push requests. It must be quick
            (queue the WRITE, never post it there) and thread-safe.
        on_stream: called (on the server thread) with a :class:`StreamRequest`;
            returns its ``(status, message)``. A server without it refuses
            stream requests. Quick and thread-safe, as ``on_push``.
        on_digest: called (on the server thread) for each held request of a
            :class:`HoldQuery` that asks for the digest of its rows; returns it
            (verified KV; :class:`handshake.hold_answers.HoldAnswers`).
        freshness_s: a request's ``sent_at`` may lie at most this many
            seconds before the server's clock, and its nonce is refused if seen
            within it (:class:`handshake.replay.ReplayGuard`).
        future_skew_s: a request's ``sent_at`` may lie at most this many
            seconds after the server's clock.
        max_connections: most peers connected at once; newer connections
            are cut (:class:`handshake.connections.ConnectionLimits`).
        max_handshakes: most connections at once that are not past their
            HELLO (what a peer without the secret never gets past); the
            oldest are cut.
        handshake_s: seconds a connection may take to complete its
            handshake before libzmq drops it (``ZMQ_HANDSHAKE_IVL``).
        stall_s: seconds the serving loop may go without a turn before a
            WARNING with every thread's stack is logged
            (:class:`handshake.watchdog.StallWatchdog`); 0: no watchdog.

    With a ``secret`` the socket speaks CURVE (keys derived from the secret,
    :class:`handshake._net.CurveKeys`): a client without the secret cannot
    complete the ZMTP handshake, so it can send nothing, and every byte
    after the handshake is encrypted. What a connection may cost before its
    handshake completes is bounded: one frame
    (:data:`handshake._net.FRAME_LIMIT` bytes), for at most ``handshake_s``
    seconds, for at most ``max_handshakes`` connections at once.

    A reply whose requester has gone (it stopped waiting and closed its
    connection) or whose queue is full is dropped, logged and counted
    (``replies_dropped``): the socket is a ``ZMQ_ROUTER_MANDATORY`` router, so
    no reply vanishes unseen. Each request's times (:class:`RequestTimes`)
    are logged at DEBUG on ``p2pkv.handshake.timing``.

    Attributes:
        stats: counters: ``"served"``, ``"refused"``, ``"heartbeats"``,
            ``"replies_dropped"``, ``"refused_<code>"`` per refusal code, and
            ``"connections_cut"`` / ``"connections_cut_handshaking"``
            (:class:`handshake.connections.ConnectionLimits`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        compat_hash: str,
        secret: bytes | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        poll_interval_s: float = 0.1,
        on_heartbeat: OnHeartbeat | None = None,
        on_release: OnRelease | None = None,
        freshness_s: float = DEFAULT_WINDOW_S,
        on_push: OnPush | None = None,
        on_stream: OnStream | None = None,
        future_skew_s: float = DEFAULT_FUTURE_SKEW_S,
        max_connections: int = MAX_CONNECTIONS,
        max_handshakes: int = MAX_HANDSHAKES,
        handshake_s: float = HANDSHAKE_S,
        stall_s: float = 0.0,
        on_digest: OnDigest | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = ephemeral), got {port}")
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
        if max_connections < 1 or not 1 <= max_handshakes <= max_connections:
            raise ValueError(f"need 1 <= max_handshakes ({max_handshakes}) <= max_connections ({max_connections})")
        if not handshake_s > 0:
            raise ValueError(f"handshake_s must be > 0 seconds, got {handshake_s}")
        if stall_s < 0:
            raise ValueError(f"stall_s must be >= 0 seconds (0: no watchdog), got {stall_s}")
        self._stall_s = stall_s
        self._watchdog: StallWatchdog | None = None
        self._limits_args = (max_connections, max_handshakes)
        self._handshake_s = handshake_s
        self._limits: ConnectionLimits | None = None
        self._host = host
        self._port = port
        self._secret = secret or None
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._auth: ThreadAuthenticator | None = None
        self.stats: dict[str, int] = {"served": 0, "refused": 0}
        self._dispatch = Dispatcher(compat_hash, self._secret, max_message_bytes,
                                    ReplayGuard(freshness_s, future_skew_s=future_skew_s),
                                    HoldAnswers(on_heartbeat, on_release, self.stats, on_digest), on_push, self.stats,
                                    on_stream)

    @property
    def host(self) -> str:
        """The bound interface address."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port: the actual one after :meth:`start` (also for ``port=0``)."""
        return self._port

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of the listening socket."""
        return tcp_endpoint(self._host, self._port)

    def set_info(self, info: AgentInfo) -> None:
        """Publish (or replace) the :class:`AgentInfo` of worker ``info.rank``.

        May be called before or after :meth:`start`, from any thread.

        Raises:
            MalformedMessageError: ``info`` exceeds a bound of the wire
                contract (e.g. more than
                :data:`~handshake.messages.MAX_AGENT_METADATA_BYTES` of
                metadata), so no peer would take it; ``field`` names it.
            MetadataDigestError: ``info.metadata_digest`` does not match
                ``info.agent_metadata``.
            IncompatiblePeerError: ``info.compat_hash`` differs from the
                server's ``compat_hash``.
        """
        self._dispatch.set_info(info)

    def start(self) -> None:
        """Bind the ROUTER socket and start serving in a daemon thread.

        Raises:
            HandshakeBindError: (an ``OSError``) the address cannot be bound,
                e.g. the port is in use; the message names ``host:port``.
            RuntimeError: already started or closed.
        """
        if self._closed:
            raise RuntimeError("HandshakeServer is closed; create a new one")
        if self._thread is not None:
            raise RuntimeError(f"HandshakeServer already serving on {self.endpoint}")
        ctx = zmq.Context()
        if self._secret:
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("p2pkv.handshake.zap"))
            self._auth.start()
            self._auth.configure_curve_callback("p2pkv", _ClientKey(CurveKeys.derive(self._secret).client_public))
        sock = ctx.socket(zmq.ROUTER)
        try:
            configure_socket(sock, self._host, secret=self._secret, server=True, handshake_s=self._handshake_s)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
            self._limits = ConnectionLimits(sock, *self._limits_args, self.stats)
            if self._port == 0:
                self._port = sock.bind_to_random_port(tcp_address(self._host))
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQBaseError as exc:
            if self._limits is not None:
                self._limits.close()
                self._limits = None
            sock.close(linger=0)
            self._stop_auth()
            ctx.term()
            raise HandshakeBindError(
                f"cannot bind the handshake side channel to {self._host}:{self._port}: {exc}; "
                "pick a free side-channel port (or 0 for an ephemeral one), stop the process "
                "holding it, or check that the host address belongs to this machine",
                errno=getattr(exc, "errno", None),
            ) from exc
        self._ctx, self._sock = ctx, sock
        if self._stall_s > 0:
            self._watchdog = StallWatchdog(f"the side channel on {self.endpoint}", self._stall_s)
        self._thread = threading.Thread(target=self._serve, name=f"p2pkv-handshake:{self._port}", daemon=True)
        self._thread.start()
        if self._watchdog is not None:
            self._watchdog.start()
        logger.info("handshake server listening on %s", self.endpoint)

    def close(self) -> None:
        """Stop serving and release the socket; idempotent.

        Joins the serving thread (at most 2 s), then closes the socket and the
        ZMQ context. Safe to call when never started.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.close()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=_JOIN_TIMEOUT_S)
            if thread.is_alive():  # pragma: no cover - the loop polls with a timeout
                logger.warning("handshake server thread did not stop within %.1f s", _JOIN_TIMEOUT_S)
                return
        elif self._sock is not None:  # pragma: no cover - a socket without its thread: start() failed midway
            if self._limits is not None:
                self._limits.close()
            self._sock.close(linger=0)
        self._sock = self._limits = None
        self._stop_auth()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def __enter__(self) -> HandshakeServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- serving thread ---------------------------------------------------

    def _serve(self) -> None:
        sock, limits = self._sock, self._limits
        assert sock is not None and limits is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(limits.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self._watchdog is not None:
                    self._watchdog.beat()
                try:
                    ready = dict(poller.poll(self._poll_ms))
                    if limits.monitor in ready:
                        limits.update()
                    if sock not in ready:
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                        break
                    logger.error("handshake server receive failed: %s", exc)
                    self._stop.wait(self._poll_ms / 1000)
                    continue
                times = RequestTimes(received=time.monotonic(), received_wall=time.time())
                reply = self._dispatch.respond(frames[1:], times)
                times.ended = time.monotonic()
                try:
                    sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
                    times.sent = time.monotonic()
                except zmq.ZMQError as exc:  # requester gone (EHOSTUNREACH) or its queue full (EAGAIN)
                    self.stats["replies_dropped"] = self.stats.get("replies_dropped", 0) + 1
                    logger.warning("handshake reply dropped (%s): %s", exc, times.describe())
                    continue
                if timing_logger.isEnabledFor(logging.DEBUG):
                    timing_logger.debug("side channel served %s", times.describe())
        finally:
            limits.close()
            sock.close(linger=0)
