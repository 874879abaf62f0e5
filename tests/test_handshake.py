"""End-to-end tests of the side channel: a real server process, real sockets."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from handshake import (
    PROTOCOL_VERSION,
    AgentInfo,
    Destination,
    ErrorReply,
    HandshakeBindError,
    HandshakeServer,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    MetadataDigestError,
    MetadataReply,
    MetadataRequest,
    RemoteRefusedError,
    decode,
    encode,
    fetch_agent_info,
)
from handshake import messages as m
from handshake._net import FRAME_LIMIT
from handshake.codec import FRAME_BYTES
from tests.handshake_support import ServerProcess, make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"shared-secret"
ENGINE = "prefill-engine"  # make_agent_info's engine id
LIMIT = 4096  # small server limit (bytes) so oversized requests are cheap
INFOS = [make_agent_info(0, tp_size=2), make_agent_info(1, tp_size=2)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(COMPAT, INFOS, max_message_bytes=LIMIT) as proc:
        yield proc
        assert proc.is_alive()


@pytest.fixture(scope="module")
def secret_server() -> Iterator[ServerProcess]:
    with ServerProcess(COMPAT, INFOS, secret=SECRET) as proc:
        yield proc
        assert proc.is_alive()


def fetch(port: int, tp_rank: int = 0, **kwargs: object) -> AgentInfo:
    args: dict = {"compat_hash": COMPAT, "timeout_s": 5.0, "retries": 1}
    args.update(kwargs)
    return fetch_agent_info(Destination(HOST, port, ENGINE, tp_rank), "decode-engine", **args)


def raw_exchange(port: int, frames: list[bytes], timeout_s: float = 5.0) -> list[bytes] | None:
    """Send raw frames on a DEALER socket; the reply frames or None on timeout."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def request(**overrides: object) -> MetadataRequest:
    """A valid request for rank 0 of the test engine, sent now, with a fresh nonce."""
    fields: dict = {
        "protocol_version": PROTOCOL_VERSION,
        "to_engine_id": ENGINE,
        "to_rank": 0,
        "sent_at": time.time(),
        "nonce": os.urandom(16),
        "requester_engine_id": "d",
        "compat_hash": COMPAT,
    }
    fields.update(overrides)
    return MetadataRequest(**fields)


def request_dict(**overrides: object) -> bytes:
    fields: dict = {"type": "metadata_request", **msgspec.structs.asdict(request())}
    fields.update(overrides)
    return msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not None})


def free_port() -> int:
    from tests.conftest import free_ports

    return free_ports(1, run=1)[0]


# -- round trips ---------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_round_trip(server: ServerProcess, rank: int) -> None:
    assert fetch(server.port, rank) == INFOS[rank]


def test_round_trip_with_secret(secret_server: ServerProcess) -> None:
    assert fetch(secret_server.port, secret=SECRET) == INFOS[0]


@pytest.mark.parametrize("secret", [b"wrong-secret", None], ids=["wrong", "missing"])
def test_wrong_secret_gets_no_reply_then_still_serving(secret: bytes | None) -> None:
    """A client without the secret cannot complete the CURVE handshake: its request never reaches the
    server (nothing served, nothing refused) and it times out, its message naming the secret when it has one.
    (Before protocol 5 it got an unsigned "auth" refusal: the server read its request.)"""
    with HandshakeServer(HOST, 0, COMPAT, secret=SECRET) as srv:
        srv.set_info(INFOS[0])
        with pytest.raises(HandshakeTimeoutError) as info:
            fetch(srv.port, secret=secret, timeout_s=0.5)
        assert ("same secret" in str(info.value)) == (secret is not None)
        assert srv.stats == {"served": 0, "refused": 0}
        assert fetch(srv.port, secret=SECRET) == INFOS[0]
        assert srv.stats == {"served": 1, "refused": 0}


def test_secret_against_open_server_gets_no_reply() -> None:
    """A client with a secret speaks CURVE and does not talk to a server without one (it could not tell it
    from an impostor): it times out, and the open server never sees its request."""
    with HandshakeServer(HOST, 0, COMPAT) as srv:
        srv.set_info(INFOS[0])
        with pytest.raises(HandshakeTimeoutError):
            fetch(srv.port, secret=SECRET, timeout_s=0.5)
        assert srv.stats == {"served": 0, "refused": 0}


def test_client_raises_typed_refusals(server: ServerProcess) -> None:
    with pytest.raises(IncompatiblePeerError) as info:  # refused by the requester, which sees both values
        fetch(server.port, compat_hash="other-hash")
    assert (info.value.code, info.value.field) == ("incompatible", "info.compat_hash")
    assert "'other-hash'" in str(info.value) and repr(COMPAT) in str(info.value)
    with pytest.raises(RemoteRefusedError) as info:
        fetch(server.port, 7)
    assert (info.value.code, info.value.field) == ("unknown_rank", "to_rank")
    assert "[0, 1]" in str(info.value)


# -- bad requests: typed refusal naming the field, then still serving -----

# Built per test (each request is fresh: its own nonce and time). ``echo``: the refusal carries the
# request's nonce (it decoded) rather than none.
BAD_REQUESTS: dict[str, tuple[Callable[[], list[bytes]], str, str, bool]] = {
    "wrong_version": (
        lambda: [encode(request(protocol_version=PROTOCOL_VERSION + 1))[0]],
        "version",
        "protocol_version",
        False,
    ),
    "wrong_version_other_schema": (
        lambda: [msgspec.msgpack.encode({"type": "hello_v99", "protocol_version": PROTOCOL_VERSION + 1, "x": 1})],
        "version",
        "protocol_version",
        False,
    ),
    "unknown_rank": (lambda: [encode(request(to_rank=5))[0]], "unknown_rank", "to_rank", True),
    "wrong_destination": (lambda: encode(request(to_engine_id="other-engine")), "wrong_destination",
                          "to_engine_id", True),
    "stale": (lambda: encode(request(sent_at=time.time() - 60)), "stale", "sent_at", True),
    "from_the_future": (lambda: encode(request(sent_at=time.time() + 60)), "stale", "sent_at", True),
    "missing_nonce": (lambda: [request_dict(nonce=None)], "malformed", "nonce", False),
    "short_nonce": (lambda: [request_dict(nonce=b"0123")], "malformed", "nonce", False),
    "unknown_extra_field": (lambda: [request_dict(bogus=1)], "malformed", "bogus", False),
    "old_field_name": (lambda: [request_dict(tp_rank=0)], "malformed", "tp_rank", False),
    "wrong_field_type": (lambda: [request_dict(to_rank="zero")], "malformed", "to_rank", False),
    "missing_field": (lambda: [request_dict(compat_hash=None)], "malformed", "compat_hash", False),
    "unknown_type_tag": (lambda: [request_dict(type="shutdown")], "malformed", "type", False),
    "reply_as_request": (
        lambda: encode(MetadataReply(protocol_version=PROTOCOL_VERSION, info=INFOS[0])),
        "malformed",
        "type",
        False,
    ),
    "truncated_msgpack": (lambda: [encode(request())[0][:-5]], "malformed", "payload", False),
    "garbage_bytes": (lambda: [b"\xc1\xff\x00garbage\x93"], "malformed", "payload", False),
    "empty_frame": (lambda: [b""], "malformed", "payload", False),
    "extra_frames": (lambda: [encode(request())[0], b"x", b"y"], "malformed", "frames", False),
    "second_frame_not_hmac": (lambda: [encode(request())[0], b"x"], "malformed", "frames", False),
    "oversized": (lambda: [encode(request(compat_hash="x" * (LIMIT + 10)))[0]], "too_large", "frames", False),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_refused_then_still_serving(server: ServerProcess, case: str) -> None:
    make, code, field, echo = BAD_REQUESTS[case]
    frames = make()
    reply = raw_exchange(server.port, frames)
    assert reply is not None, "server did not answer"
    msg = decode(reply)
    assert isinstance(msg, ErrorReply)
    assert (msg.code, msg.field) == (code, field)
    assert msg.protocol_version == PROTOCOL_VERSION
    assert field in msg.message
    assert msg.nonce == (decode(frames[:1]).nonce if echo else b"")  # type: ignore[union-attr]
    if code == "version":
        assert str(PROTOCOL_VERSION) in msg.message
    assert fetch(server.port) == INFOS[0]


def test_frame_over_the_frame_limit_dropped_then_still_serving(server: ServerProcess) -> None:
    # Over ZMQ_MAXMSGSIZE (FRAME_LIMIT): libzmq drops the connection before buffering the frame.
    assert raw_exchange(server.port, [b"\x00" * (FRAME_LIMIT + 1)], timeout_s=0.5) is None
    assert server.is_alive()
    assert fetch(server.port) == INFOS[0]


def test_message_over_the_limit_in_frames_refused_too_large(server: ServerProcess) -> None:
    # Frames within the frame limit reach the server, which refuses their total (typed), then still serves.
    reply = raw_exchange(server.port, [b"\x00" * FRAME_BYTES, b"\x00" * 8])
    assert reply is not None
    msg = decode(reply)
    assert isinstance(msg, ErrorReply) and (msg.code, msg.field) == ("too_large", "frames")
    assert fetch(server.port) == INFOS[0]


# -- client side -----------------------------------------------------------


def test_timeout_when_nothing_listens() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(HandshakeTimeoutError) as info:
        fetch_agent_info(Destination(HOST, port, ENGINE, 0), "d", COMPAT, timeout_s=0.3, retries=3, backoff_s=0.05)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert f"{HOST}:{port}" in text and "3 attempt" in text and "0.3 s" in text
    assert "prefill engine is up" in text


# -- in-process server lifecycle -------------------------------------------


def test_close_idempotent_leaves_no_thread() -> None:
    baseline = threading.active_count()
    server = HandshakeServer(HOST, 0, COMPAT)
    server.set_info(INFOS[0])
    server.start()
    assert server.port != 0
    assert f"p2pkv-handshake:{server.port}" in {t.name for t in threading.enumerate()}
    assert fetch(server.port) == INFOS[0]
    start = time.monotonic()
    server.close()
    server.close()
    assert time.monotonic() - start < 2.5
    assert threading.active_count() == baseline
    with pytest.raises(RuntimeError):
        server.start()
    HandshakeServer(HOST, 0, COMPAT).close()  # never started: fine


def test_set_info_after_start_and_stats(caplog: pytest.LogCaptureFixture) -> None:
    with HandshakeServer(HOST, 0, COMPAT) as server:
        with (
            caplog.at_level(logging.WARNING, logger="p2pkv.handshake"),
            pytest.raises(RemoteRefusedError) as info,
        ):
            fetch(server.port, 1)
        assert info.value.code == "unknown_rank"
        assert any("unknown_rank" in r.getMessage() for r in caplog.records)
        server.set_info(INFOS[1])
        assert fetch(server.port, 1) == INFOS[1]
        assert server.stats == {"served": 1, "refused": 1, "refused_unknown_rank": 1}


def test_set_info_validates() -> None:
    server = HandshakeServer(HOST, 0, COMPAT)
    with pytest.raises(MetadataDigestError) as info:
        server.set_info(msgspec.structs.replace(INFOS[0], agent_metadata=b"tampered"))
    assert info.value.field == "info.metadata_digest"
    with pytest.raises(IncompatiblePeerError):
        server.set_info(make_agent_info(0, compat_hash="other"))
    server.close()


def test_every_request_type_has_one_handler_and_a_request_without_one_is_refused() -> None:
    """The dispatch table covers every request type of the wire contract; a type missing from it is refused
    naming the field ``type`` (and the server goes on)."""
    def leaves(cls: type) -> set[type]:
        subs = cls.__subclasses__()
        return set().union(*(leaves(s) for s in subs)) if subs else {cls}

    with HandshakeServer(HOST, 0, COMPAT) as server:
        server.set_info(INFOS[0])
        dispatch = server._dispatch
        assert set(dispatch.handlers) == leaves(m.Request) and len(dispatch.handlers) == 6
        del dispatch.handlers[m.MetadataRequest]
        with pytest.raises(RemoteRefusedError) as info:
            fetch(server.port)
        assert (info.value.code, info.value.field) == ("malformed", "type")
        assert "lease_heartbeat" in str(info.value) and "metadata_request" not in str(info.value)


def test_bind_failure_names_host_and_port() -> None:
    with HandshakeServer(HOST, 0, COMPAT) as first:
        second = HandshakeServer(HOST, first.port, COMPAT)
        with pytest.raises(HandshakeBindError) as info:
            second.start()
        assert isinstance(info.value, OSError)
        assert f"{HOST}:{first.port}" in str(info.value)
        second.close()
