"""Attacks on the side channel (protocol 5): replay, redirection, forged refusals, eavesdropping,
impersonation and memory exhaustion, each against real servers and real sockets on 127.0.0.1.

Every engine of a deployment shares one secret, so the attacker of these tests is either someone on
the network without the secret, or a peer that saw a signed request (or refusal) and sends it again,
elsewhere or later.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from handshake import (
    PROTOCOL_VERSION,
    Destination,
    ErrorReply,
    HandshakeServer,
    HandshakeTimeoutError,
    HoldsReply,
    MalformedMessageError,
    MetadataReply,
    MetadataRequest,
    ReleaseHolds,
    RemoteRefusedError,
    ReplayedRequestError,
    ReplayGuard,
    StaleRequestError,
    decode,
    encode,
    fetch_agent_info,
    release_holds,
)
from handshake._net import CurveKeys, configure_socket
from tests.clock import FakeClock
from tests.handshake_support import ServerProcess, fake_router, make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"side-channel-security-test"
ENGINE = "prefill-engine"  # make_agent_info's engine id
MiB = 1 << 20


# -- helpers -----------------------------------------------------------------


def head(**overrides: object) -> dict:
    """The fields every request carries: for rank 0 of ENGINE, sent now, with a fresh nonce."""
    return {"protocol_version": PROTOCOL_VERSION, "to_engine_id": ENGINE, "to_rank": 0, "sent_at": time.time(),
            "nonce": os.urandom(16), "requester_engine_id": "decode-engine", **overrides}


def metadata_request(**overrides: object) -> MetadataRequest:
    return MetadataRequest(**head(**overrides), compat_hash=COMPAT)


def release_request(**overrides: object) -> ReleaseHolds:
    return ReleaseHolds(**head(**overrides), request_ids=["r1"], block_ids=[[1, 2]])


def exchange(port: int, frames: list[bytes], secret: bytes | None = SECRET, timeout_s: float = 5.0,
             keys: tuple[bytes, bytes, bytes] | None = None) -> list[bytes] | None:
    """Send ``frames`` on a fresh DEALER (CURVE with ``secret``, or the given (server public, public, secret)
    ``keys``); the reply frames, or None when none came within ``timeout_s``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        configure_socket(sock, HOST, secret=secret)
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(0)
        ctx.term()


class Released:
    """An ``on_release`` callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[list[int]]]] = []

    def __call__(self, ids: list[str], blocks: list[list[int]], requester: str) -> int:
        self.calls.append((ids, blocks))
        return len(ids)


@contextlib.contextmanager
def serving(engine_id: str = ENGINE, secret: bytes | None = SECRET, metadata: bytes | None = None
            ) -> Iterator[tuple[HandshakeServer, Released]]:
    """An in-process server of rank 0 of ``engine_id`` (publishing ``metadata``) that takes releases (recorded)."""
    released = Released()
    srv = HandshakeServer(HOST, 0, COMPAT, secret=secret, on_release=released)
    srv.set_info(make_agent_info(0, engine_id=engine_id, agent_metadata=metadata))
    with srv:
        yield srv, released


def fake_server(respond: Callable[[list[bytes]], list[bytes]] | None, secret: bytes | None
                ) -> contextlib.AbstractContextManager[tuple[int, list[list[bytes]]]]:
    """A fake side channel (a CURVE server of ``secret`` when set) that records each request it receives and
    answers it with ``respond`` (None: never answers). Yields its port and the requests received."""
    return fake_router(respond, secret=secret)


def fetch(port: int, secret: bytes | None = SECRET, timeout_s: float = 5.0) -> object:
    return fetch_agent_info(Destination(HOST, port, ENGINE, 0), "decode-engine", COMPAT, secret=secret,
                            timeout_s=timeout_s, retries=1)


# -- a. replay and staleness ---------------------------------------------------
# Attack: someone who saw a signed request (a peer, a log, a capture of a deployment without CURVE)
# sends the same bytes again: a second release of a hold that a new request reuses, or a metadata
# request answered again. Before protocol 5 the server had no memory of nonces and served both.


def test_replayed_metadata_request_is_refused() -> None:
    request = metadata_request()
    frames = encode(request, SECRET)
    with serving() as (srv, _):
        first = decode(exchange(srv.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(first, MetadataReply) and first.nonce == request.nonce
        again = decode(exchange(srv.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(again, ErrorReply)
        assert (again.code, again.field, again.nonce) == ("replayed", "nonce", request.nonce)
        assert srv.stats == {"served": 1, "refused": 1, "refused_replayed": 1}


def test_replayed_release_is_refused_and_frees_nothing_again() -> None:
    request = release_request()
    frames = encode(request, SECRET)
    with serving() as (srv, released):
        first = decode(exchange(srv.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(first, HoldsReply) and first.accepted == 1
        again = decode(exchange(srv.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(again, ErrorReply) and (again.code, again.nonce) == ("replayed", request.nonce)
        assert released.calls == [(["r1"], [[1, 2]])]  # the callback ran once


@pytest.mark.parametrize("skew_s", [-60.0, 60.0], ids=["60s_old", "60s_ahead"])
@pytest.mark.parametrize("make", [metadata_request, release_request], ids=["metadata", "release"])
def test_stale_request_is_refused(make: Callable[..., object], skew_s: float) -> None:
    """A request sent (or claiming to be sent) outside the 30 s window: too old to be remembered as seen,
    or dated ahead so that it would outlive the window."""
    request = make(sent_at=time.time() + skew_s)
    with serving() as (srv, released):
        reply = decode(exchange(srv.port, encode(request, SECRET)), SECRET)  # type: ignore[arg-type]
        assert isinstance(reply, ErrorReply) and (reply.code, reply.field) == ("stale", "sent_at")
        assert srv.stats["served"] == 0 and released.calls == []


def test_replay_guard_refuses_a_nonce_seen_within_the_window() -> None:
    clock = FakeClock()
    guard = ReplayGuard(window_s=30.0, capacity=8, clock=clock)
    guard.check(b"a" * 16, 1000.0)
    with pytest.raises(ReplayedRequestError) as info:
        guard.check(b"a" * 16, 1000.0)
    assert info.value.field == "nonce"
    with pytest.raises(ReplayedRequestError):  # a replay with another sent_at (unsigned time) is no better
        guard.check(b"a" * 16, 1004.0)
    for sent_at in (969.9, 1030.1, float("nan"), float("inf")):
        with pytest.raises(StaleRequestError):
            guard.check(b"b" * 16, sent_at)
    with pytest.raises(ValueError):
        ReplayGuard(window_s=0)
    with pytest.raises(ValueError):
        ReplayGuard(capacity=0)


def test_replay_guard_memory_is_bounded_and_eviction_raises_the_floor() -> None:
    clock = FakeClock()
    guard = ReplayGuard(window_s=30.0, capacity=4, clock=clock)
    clock.now = 1010.0  # every request below is dated in the past
    nonces = [bytes([i]) * 16 for i in range(10)]
    for i, nonce in enumerate(nonces):
        guard.check(nonce, 1000.0 + i)
        assert len(guard) <= 4
    assert len(guard) == 4
    # The six oldest were forgotten; their replays are refused as stale (their time is at or below the floor),
    # never let through.
    for i in range(6):
        with pytest.raises(StaleRequestError):
            guard.check(nonces[i], 1000.0 + i)
    with pytest.raises(StaleRequestError):  # so is any request as old as a forgotten nonce
        guard.check(b"new-nonce-000000", 1005.0)
    for i in range(6, 10):  # the remembered ones are refused as replays
        with pytest.raises(ReplayedRequestError):
            guard.check(nonces[i], 1000.0 + i)
    guard.check(b"new-nonce-000000", 1005.5)  # newer than the floor: accepted
    assert len(guard) == 4


def test_replay_guard_forgets_nonces_after_the_window() -> None:
    clock = FakeClock()
    guard = ReplayGuard(window_s=30.0, capacity=100, clock=clock)
    for i in range(50):
        guard.check(bytes([i]) * 16, 1000.0)
    assert len(guard) == 50
    clock.now = 1031.0
    guard.check(b"later-nonce-0000", 1031.0)  # each check forgets what left the window
    assert len(guard) == 1
    with pytest.raises(StaleRequestError):  # a forgotten nonce replayed now is stale
        guard.check(bytes([0]) * 16, 1000.0)


# -- b. redirection --------------------------------------------------------------
# Attack: every engine shares the secret, so a request signed for prefill engine A (or rank 0) is
# equally valid at engine B (or rank 1): a captured release sent to B frees B's hold of the same request
# id, a metadata request is answered by whoever gets it. Before protocol 5 requests did not name their
# engine, and hold requests did not name a rank: any server holding the id acted on them.


@pytest.mark.parametrize("make", [metadata_request, release_request], ids=["metadata", "release"])
@pytest.mark.parametrize(("overrides", "code", "field"), [
    ({"to_engine_id": "another-engine"}, "wrong_destination", "to_engine_id"),
    ({"to_rank": 1}, "unknown_rank", "to_rank"),
], ids=["other_engine", "other_rank"])
def test_request_for_another_destination_is_refused(make: Callable[..., object], overrides: dict, code: str,
                                                    field: str) -> None:
    request = make(**overrides)
    with serving() as (srv, released):
        reply = decode(exchange(srv.port, encode(request, SECRET)), SECRET)  # type: ignore[arg-type,union-attr]
        assert isinstance(reply, ErrorReply) and (reply.code, reply.field) == (code, field)
        assert srv.stats["served"] == 0 and released.calls == []


def test_request_captured_for_one_engine_is_refused_by_another() -> None:
    request = release_request(to_engine_id="engine-a")
    frames = encode(request, SECRET)
    with serving("engine-a") as (a, released_a), serving("engine-b") as (b, released_b):
        reply = decode(exchange(b.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(reply, ErrorReply) and reply.code == "wrong_destination"
        assert released_b.calls == [] and b.stats["served"] == 0
        reply = decode(exchange(a.port, frames), SECRET)  # type: ignore[arg-type]
        assert isinstance(reply, HoldsReply) and released_a.calls == [(["r1"], [[1, 2]])]


# -- c. refusals bound to their request --------------------------------------------
# Attack: a signed refusal seen once (e.g. "incompatible", "unknown_rank") sent later in answer to
# another request makes the decode engine give up on a healthy prefill engine (its requests fall back to
# local prefill, or fail). Before protocol 5 an ErrorReply carried no nonce and the client believed it.


def refusal(nonce: bytes | None) -> Callable[[list[bytes]], list[bytes]]:
    """Answers with a signed refusal carrying ``nonce`` (None: the request's own)."""

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = msgspec.msgpack.decode(body[0])["nonce"] if nonce is None else nonce
        return encode(ErrorReply(protocol_version=PROTOCOL_VERSION, code="incompatible", field="compat_hash",
                                 message="go away", nonce=echoed), SECRET)

    return respond


CALLS = {
    "metadata": lambda port: fetch(port),
    "release": lambda port: release_holds(Destination(HOST, port, ENGINE, 0), ["r1"], [[1, 2]], "decode-engine",
                                          secret=SECRET, timeout_s=5.0),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_signed_refusal_of_another_request_is_not_believed(call: str) -> None:
    with fake_server(refusal(b"nonce-of-an-old-request"), SECRET) as (port, received), \
            pytest.raises(MalformedMessageError) as info:
        CALLS[call](port)
    assert info.value.field == "nonce" and not isinstance(info.value, RemoteRefusedError)
    assert len(received) == 1
    # Control: the same refusal echoing the request's nonce is the server's answer.
    with fake_server(refusal(None), SECRET) as (port, _), pytest.raises(RemoteRefusedError) as refused:
        CALLS[call](port)
    assert (refused.value.code, refused.value.field) == ("incompatible", "compat_hash")


# -- d. encryption ----------------------------------------------------------------------
# Attack: a passive observer of the network reads the NIXL agent metadata (addresses and registration
# keys of every KV region), the engine ids and request ids. Before protocol 5 the secret only signed
# messages (HMAC): every byte crossed the network in the clear.


class Tap:
    """A TCP forwarder on 127.0.0.1 (to ``upstream_port``) that records every byte, both ways."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = upstream_port
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._recorded = bytearray()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((HOST, self._upstream))
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self._recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    @property
    def recorded(self) -> bytes:
        with self._lock:
            return bytes(self._recorded)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(2)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no_secret_control"])
def test_traffic_is_encrypted_with_a_secret(secret: bytes | None) -> None:
    marker = b"NIXL-AGENT-METADATA-MARKER-" + os.urandom(8).hex().encode()
    with serving(secret=secret, metadata=marker) as (srv, _):
        tap = Tap(srv.port)
        try:
            info = fetch(tap.port, secret=secret)
        finally:
            tap.close()
    assert info.agent_metadata == marker  # type: ignore[attr-defined]
    seen = tap.recorded
    assert len(seen) > len(marker)  # the traffic did cross the tap
    if secret:
        for plain in (marker, ENGINE.encode(), b"decode-engine", COMPAT.encode()):
            assert plain not in seen, plain
        assert b"CURVE" in seen  # the ZMTP greeting names the mechanism in the clear; nothing else is
    else:  # negative control: without a secret the metadata crosses in the clear
        assert marker in seen and ENGINE.encode() in seen


# -- e. mutual authentication --------------------------------------------------------------
# Attack: a host on the network without the secret asks a prefill engine for its agent metadata, or
# sends it requests at all (each one costs the server a decode); or it impersonates a prefill engine to
# learn what decode engines ask. Before protocol 5 any TCP peer reached the server's request decoder
# (and got an unsigned "auth" refusal), and a client sent its request to whoever listened on the port.


def test_server_answers_no_one_without_the_secret() -> None:
    keys = CurveKeys.derive(SECRET)
    with serving() as (srv, released):
        with pytest.raises(HandshakeTimeoutError):  # a client with another secret
            fetch(srv.port, secret=b"another-secret", timeout_s=0.5)
        # A plain ZMQ peer, even with a validly signed request (it cannot have one: shows CURVE is the gate).
        assert exchange(srv.port, encode(release_request(), SECRET), secret=None, timeout_s=0.5) is None
        # A CURVE client that knows the server's public key but has its own key pair: refused by ZAP.
        public, secret_key = zmq.curve_keypair()
        assert exchange(srv.port, encode(metadata_request(), SECRET), secret=None, timeout_s=0.5,
                        keys=(keys.server_public, public, secret_key)) is None
        assert srv.stats == {"served": 0, "refused": 0} and released.calls == []
        assert fetch(srv.port).agent_metadata == make_agent_info(0).agent_metadata  # type: ignore[attr-defined]
        assert srv.stats == {"served": 1, "refused": 0}


@pytest.mark.parametrize("impostor_secret", [b"the-impostor's-secret", None], ids=["other_secret", "no_curve"])
def test_client_sends_nothing_to_an_impostor(impostor_secret: bytes | None) -> None:
    with fake_server(None, impostor_secret) as (port, received):
        with pytest.raises(HandshakeTimeoutError) as info:
            fetch(port, timeout_s=0.5)
        assert "same secret" in str(info.value)
        with pytest.raises(HandshakeTimeoutError):
            release_holds(Destination(HOST, port, ENGINE, 0), ["r1"], [[1, 2]], "decode-engine", secret=SECRET,
                          timeout_s=0.5)
        time.sleep(0.1)
        assert received == []


# -- f. memory bound -------------------------------------------------------------------------
# Attack: a peer without the secret sends one huge multipart message (24 frames of 16 MiB; each was under
# the transport limit of 32 MiB before protocol 7, which has frames of at most 256 KiB) to make the server
# buffer it. Before protocol 5 libzmq read and buffered all of it (~384 MiB) before the application refused
# it as too large. What hostile connections cost before their handshake: tests/test_side_channel_limits.py.


def rss_bytes(pid: int) -> int:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise
    return psutil.Process(pid).memory_info().rss


def zmtp_null_handshake() -> bytes:
    """What a plain ZMQ DEALER sends first: a ZMTP 3.0 greeting offering the NULL mechanism (no security),
    then its READY command."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return greeting + bytes([0x04, len(ready)]) + ready


def stream_huge_message(port: int, frames: int = 24, frame_bytes: int = 16 * MiB) -> int:
    """Stream a plain ZMTP handshake and one message of ``frames`` frames over raw TCP; the bytes of the
    message sent before the server closed the connection."""
    chunk = b"\x00" * MiB
    sent = 0
    with socket.create_connection((HOST, port)) as sock:
        try:
            sock.sendall(zmtp_null_handshake())
            for i in range(frames):
                flags = 0x02 | (0x01 if i < frames - 1 else 0)  # LONG, MORE
                sock.sendall(bytes([flags]) + struct.pack(">Q", frame_bytes))
                for _ in range(frame_bytes // MiB):
                    sock.sendall(chunk)
                    sent += MiB
        except OSError:  # reset by the server
            pass
    return sent


def test_unauthenticated_huge_message_does_not_grow_server_memory() -> None:
    with ServerProcess(COMPAT, [make_agent_info(0)], secret=SECRET) as proc:
        assert proc.pid is not None
        assert fetch(proc.port) == make_agent_info(0)  # warm up: lazily allocated state exists
        before = rss_bytes(proc.pid)
        peak, stop = [before], threading.Event()

        def sample() -> None:
            while not stop.wait(0.005):
                peak[0] = max(peak[0], rss_bytes(proc.pid))  # type: ignore[arg-type]

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        sent = stream_huge_message(proc.port)
        assert sent < 64 * MiB  # cut off at the greeting, not read to the end (~384 MiB)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(f"tcp://{HOST}:{proc.port}")
        frame = zmq.Frame(b"\x00" * (16 * MiB))
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:  # a blocking send waits forever once the server has ended the handshake before it (no pipe left);
                dealer.send_multipart([frame] * 24, copy=False, flags=zmq.DONTWAIT)  # a polite client's extra:
                break  # the raw stream above is the attack, whatever libzmq does with this one
            except zmq.Again:
                time.sleep(0.005)
        time.sleep(1.0)  # libzmq keeps reconnecting; the server refuses every handshake
        dealer.close(0)
        ctx.term()
        time.sleep(0.2)
        stop.set()
        sampler.join(2)
        growth, peak_growth = rss_bytes(proc.pid) - before, peak[0] - before
        assert growth < 10 * MiB, f"server RSS grew by {growth / MiB:.1f} MiB"
        assert peak_growth < 10 * MiB, f"server RSS peaked {peak_growth / MiB:.1f} MiB above its start"
        assert fetch(proc.port) == make_agent_info(0)
        assert proc.is_alive()
