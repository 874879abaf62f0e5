"""Client-side checks against a fake server that sends chosen replies."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    Destination,
    ErrorReply,
    HandshakeError,
    IncompatiblePeerError,
    MalformedMessageError,
    MetadataDigestError,
    MetadataReply,
    ProtocolVersionError,
    RemoteRefusedError,
    encode,
    fetch_agent_info,
)
from handshake.codec import sign
from tests.handshake_support import fake_router, make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"shared-secret"
ENGINE = "prefill-engine"
INFO = make_agent_info(0)

Responder = Callable[[list[bytes]], list[bytes]]


@contextlib.contextmanager
def fake_server(respond: Responder, port: int = 0, secret: bytes | None = None) -> Iterator[int]:
    """A fake side channel (:func:`tests.handshake_support.fake_router`; a CURVE server with ``secret``) answering
    each request with ``respond``; ``respond`` returning ``[]`` leaves the request unanswered."""
    with fake_router(respond, secret=secret, port=port) as (bound, _):
        yield bound


def reply_with(
    info: object = INFO, version: int = PROTOCOL_VERSION, secret: bytes | None = None, nonce: bytes | None = None
) -> Responder:
    """Answers every request with ``info``, echoing its nonce (or sending ``nonce``)."""

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = msgspec.msgpack.decode(body[0]).get("nonce", b"") if nonce is None else nonce
        return encode(MetadataReply(protocol_version=version, info=info, nonce=echoed), secret)  # type: ignore

    return respond


def refuse_with(code: str = "unknown_rank", nonce: bytes | None = None) -> Responder:
    """Answers every request with an ErrorReply echoing its nonce (or carrying ``nonce``)."""

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = msgspec.msgpack.decode(body[0]).get("nonce", b"") if nonce is None else nonce
        return encode(ErrorReply(protocol_version=PROTOCOL_VERSION, code=code, field="to_rank",  # type: ignore
                                 message="no such rank", nonce=echoed))

    return respond


def fetch(port: int, **kwargs: object) -> object:
    args: dict = {"timeout_s": 2.0, "retries": 1}
    args.update(kwargs)
    return fetch_agent_info(Destination(HOST, port, ENGINE, 0), "d", COMPAT, **args)


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
    "no_nonce": (reply_with(nonce=b""), MalformedMessageError, "nonce"),
    "refusal_of_another_request": (refuse_with(nonce=b"another request's nonce"), MalformedMessageError, "nonce"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_client_rejects_bad_reply(case: str) -> None:
    respond, error, field = CASES[case]
    with fake_server(respond) as port, pytest.raises(error) as info:
        fetch(port)
    assert info.value.field == field
    assert field in str(info.value)
    assert f"{HOST}:{port}" in str(info.value)


def test_client_rejects_info_of_another_engine() -> None:
    """A reply with another engine's info (a server that ignored to_engine_id) is refused."""
    with fake_server(reply_with(make_agent_info(0, engine_id="another-engine"))) as port, \
            pytest.raises(IncompatiblePeerError) as info:
        fetch(port)
    assert info.value.field == "info.engine_id"
    assert "'another-engine'" in str(info.value) and repr(ENGINE) in str(info.value)


@pytest.mark.parametrize("reply_secret", [None, b"other-secret"], ids=["unsigned", "wrong_key"])
def test_client_rejects_unauthenticated_reply(reply_secret: bytes | None) -> None:
    # Inside the CURVE session the HMAC of the reply is still checked.
    with fake_server(reply_with(secret=reply_secret), secret=SECRET) as port, \
            pytest.raises(AuthenticationError) as info:
        fetch(port, secret=SECRET)
    assert info.value.code == "auth" and info.value.field == "hmac"


def test_client_accepts_signed_reply_and_signs_request() -> None:
    seen: list[list[bytes]] = []

    def respond(body: list[bytes]) -> list[bytes]:
        seen.append(body)
        nonce = msgspec.msgpack.decode(body[0])["nonce"]
        return encode(MetadataReply(protocol_version=PROTOCOL_VERSION, info=INFO, nonce=nonce), SECRET)

    with fake_server(respond, secret=SECRET) as port:
        assert fetch(port, secret=SECRET) == INFO
    ((payload, mac),) = seen
    assert mac == sign(payload, SECRET)


@pytest.mark.parametrize("nonce", [None, b""], ids=["its_nonce", "no_nonce"])
def test_refusal_of_this_request_is_raised(nonce: bytes | None) -> None:
    """A refusal echoing the request's nonce, or with none (the request did not decode there, e.g. another
    protocol version), is the server's answer."""
    with fake_server(refuse_with(nonce=nonce)) as port, pytest.raises(RemoteRefusedError) as info:
        fetch(port)
    assert (info.value.code, info.value.field) == ("unknown_rank", "to_rank")
    assert "no such rank" in str(info.value)


def test_request_names_its_destination_and_each_retry_is_a_new_request() -> None:
    """The first request goes unanswered; the retry is a new request (own nonce, later time), not the same
    bytes again (which the server would refuse as replayed)."""
    seen: list[dict] = []

    def respond(body: list[bytes]) -> list[bytes]:
        seen.append(msgspec.msgpack.decode(body[0]))
        return [] if len(seen) == 1 else reply_with()(body)

    with fake_server(respond) as port:
        assert fetch(port, timeout_s=0.3, retries=2, backoff_s=0.01) == INFO
    first, second = seen
    assert first["to_engine_id"] == second["to_engine_id"] == ENGINE
    assert first["to_rank"] == second["to_rank"] == 0
    assert first["nonce"] != second["nonce"] and len(first["nonce"]) >= 16
    assert first["sent_at"] < second["sent_at"] <= time.time()


def test_client_retries_timeouts_then_succeeds() -> None:
    # The server comes up late: the first attempt times out, a later one is answered.
    from tests.conftest import free_ports

    port = free_ports(1, run=1)[0]
    result: list[object] = []
    fetcher = threading.Thread(
        target=lambda: result.append(
            fetch_agent_info(Destination(HOST, port, ENGINE, 0), "d", COMPAT, timeout_s=0.4, retries=5, backoff_s=0.05)
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
        fetch_agent_info(Destination(HOST, 1, ENGINE, 0), "d", COMPAT, retries=0)
    with pytest.raises(ValueError, match="timeout_s"):
        fetch_agent_info(Destination(HOST, 1, ENGINE, 0), "d", COMPAT, timeout_s=0)
