"""Client-side checks against a fake server that sends chosen replies."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    HandshakeError,
    IncompatiblePeerError,
    MalformedMessageError,
    MetadataDigestError,
    MetadataReply,
    ProtocolVersionError,
    encode,
    fetch_agent_info,
)
from handshake.codec import sign
from handshake.testing import make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"shared-secret"
INFO = make_agent_info(0)

Responder = Callable[[list[bytes]], list[bytes]]


@contextlib.contextmanager
def fake_server(respond: Responder, port: int = 0) -> Iterator[int]:
    """A ROUTER socket in a thread answering each request with ``respond``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    if port:
        sock.bind(f"tcp://{HOST}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{HOST}")
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if sock.poll(50):
                identity, *body = sock.recv_multipart()
                sock.send_multipart([identity, *respond(body)])
        sock.close(0)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(2)
        ctx.term()


def reply_with(
    info: object = INFO, version: int = PROTOCOL_VERSION, secret: bytes | None = None, nonce: bytes | None = None
) -> Responder:
    """Answers every request with ``info``, echoing its nonce (or sending ``nonce``)."""

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = msgspec.msgpack.decode(body[0]).get("nonce", b"") if nonce is None else nonce
        return encode(MetadataReply(protocol_version=version, info=info, nonce=echoed), secret)  # type: ignore

    return respond


CASES: dict[str, tuple[Responder, type[HandshakeError], str]] = {
    "digest_mismatch": (
        reply_with(msgspec.structs.replace(INFO, agent_metadata=b"tampered")),
        MetadataDigestError,
        "info.metadata_digest",
    ),
    "wrong_rank": (reply_with(make_agent_info(1)), IncompatiblePeerError, "info.tp_rank"),
    "wrong_compat_hash": (
        reply_with(make_agent_info(0, compat_hash="other")),
        IncompatiblePeerError,
        "info.compat_hash",
    ),
    "wrong_version": (reply_with(version=PROTOCOL_VERSION + 1), ProtocolVersionError, "protocol_version"),
    "garbage": (lambda _body: [b"\xc1garbage"], MalformedMessageError, "payload"),
    "echoed_request": (lambda body: body, MalformedMessageError, "type"),
    "other_nonce": (reply_with(nonce=b"a reply to another request"), MalformedMessageError, "nonce"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_client_rejects_bad_reply(case: str) -> None:
    respond, error, field = CASES[case]
    with fake_server(respond) as port, pytest.raises(error) as info:
        fetch_agent_info(HOST, port, 0, "d", COMPAT, timeout_s=2.0, retries=1)
    assert info.value.field == field
    assert field in str(info.value)
    assert f"{HOST}:{port}" in str(info.value)


@pytest.mark.parametrize("reply_secret", [None, b"other-secret"], ids=["unsigned", "wrong_key"])
def test_client_rejects_unauthenticated_reply(reply_secret: bytes | None) -> None:
    with fake_server(reply_with(secret=reply_secret)) as port, pytest.raises(AuthenticationError) as info:
        fetch_agent_info(HOST, port, 0, "d", COMPAT, secret=SECRET, timeout_s=2.0, retries=1)
    assert info.value.code == "auth" and info.value.field == "hmac"


def test_client_accepts_signed_reply_and_signs_request() -> None:
    seen: list[list[bytes]] = []

    def respond(body: list[bytes]) -> list[bytes]:
        seen.append(body)
        nonce = msgspec.msgpack.decode(body[0])["nonce"]
        return encode(MetadataReply(protocol_version=PROTOCOL_VERSION, info=INFO, nonce=nonce), SECRET)

    with fake_server(respond) as port:
        assert fetch_agent_info(HOST, port, 0, "d", COMPAT, secret=SECRET, timeout_s=2.0, retries=1) == INFO
    ((payload, mac),) = seen
    assert mac == sign(payload, SECRET)


def test_client_retries_timeouts_then_succeeds() -> None:
    # The server comes up late: the first attempt times out, a later one is answered.
    from tests.conftest import free_ports

    port = free_ports(1, run=1)[0]
    result: list[object] = []
    fetcher = threading.Thread(
        target=lambda: result.append(
            fetch_agent_info(HOST, port, 0, "d", COMPAT, timeout_s=0.4, retries=5, backoff_s=0.05)
        )
    )
    fetcher.start()
    threading.Event().wait(0.5)
    try:
        with fake_server(reply_with(), port):
            fetcher.join(5)
    finally:
        fetcher.join(5)
    assert result == [INFO]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="retries"):
        fetch_agent_info(HOST, 1, 0, "d", COMPAT, retries=0)
    with pytest.raises(ValueError, match="timeout_s"):
        fetch_agent_info(HOST, 1, 0, "d", COMPAT, timeout_s=0)
