"""Fuzz the side channel: random and mutated requests never kill the server.

Every request, however broken, must get exactly one valid reply (an
``ErrorReply`` or a ``MetadataReply``), and the server must still serve a
valid request at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from handshake import (
    PROTOCOL_VERSION,
    Destination,
    ErrorReply,
    HandshakeError,
    MetadataReply,
    MetadataRequest,
    decode,
    encode,
    fetch_agent_info,
)
from handshake._net import configure_socket
from handshake.codec import sign
from tests.handshake_support import ServerProcess, make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"fuzz-secret"
LIMIT = 2048  # bytes; small so random input also hits the size check
INFOS = [make_agent_info(0, tp_size=2), make_agent_info(1, tp_size=2)]
ENGINE = "prefill-engine"
NONCE = b"fuzz-nonce-16byte"
REQUEST = MetadataRequest(
    protocol_version=PROTOCOL_VERSION, to_engine_id=ENGINE, to_rank=0, sent_at=time.time(), nonce=NONCE,
    requester_engine_id="fuzz", compat_hash=COMPAT
)
VALID = encode(REQUEST)[0]
VALID_SIGNED = encode(REQUEST, SECRET)
FIELDS = ["type", "protocol_version", "to_engine_id", "to_rank", "sent_at", "nonce", "requester_engine_id",
          "compat_hash", "request_ids", "block_ids", "extend_s", "info", "code", "x"]
TAGS = ["metadata_request", "metadata_reply", "error", "lease_heartbeat", "hold_query", "release_holds",
        "holds_reply"]

FUZZ = settings(max_examples=200, deadline=None, database=None)

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from([*TAGS, COMPAT, ENGINE, PROTOCOL_VERSION, NONCE, REQUEST.sent_at]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


class Peer:
    """A raw DEALER connection to a server process."""

    def __init__(self, proc: ServerProcess, secret: bytes | None) -> None:
        self.proc = proc
        self.secret = secret
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        configure_socket(self.sock, HOST, secret=secret)  # CURVE with a secret
        self.sock.connect(f"tcp://{HOST}:{proc.port}")

    def exchange(self, frames: list[bytes]) -> ErrorReply | MetadataReply:
        """Send frames; assert exactly one valid reply arrives within 5 s."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(5000), f"no reply to {frames!r}"
        reply = self.sock.recv_multipart()
        try:
            msg = decode(reply, self.secret)
        except HandshakeError:  # an "auth" refusal is sent unsigned (a bad HMAC inside the CURVE session)
            msg = decode(reply[:1])
            assert isinstance(msg, ErrorReply) and msg.code == "auth", msg
        assert isinstance(msg, (ErrorReply, MetadataReply)), msg
        if isinstance(msg, MetadataReply):
            assert msg.info == INFOS[msg.info.tp_rank]
        return msg

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module", params=[None, SECRET], ids=["plain", "hmac"])
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    secret = request.param
    with ServerProcess(COMPAT, INFOS, secret=secret, max_message_bytes=LIMIT) as proc:
        client = Peer(proc, secret)
        yield client
        client.close()
        # The server survived everything and still serves a valid request.
        assert proc.is_alive()
        info = fetch_agent_info(Destination(HOST, proc.port, ENGINE, 1), "fuzz", COMPAT, secret=secret, timeout_s=5.0,
                                retries=1)
        assert info == INFOS[1]


def sign_if(peer: Peer, payload: bytes) -> list[bytes]:
    return [payload, sign(payload, peer.secret)] if peer.secret else [payload]


@FUZZ
@given(data=st.binary(max_size=2 * LIMIT))  # larger frames are dropped by libzmq
def test_random_bytes(peer: Peer, data: bytes) -> None:
    assert isinstance(peer.exchange([data]), ErrorReply)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_frames(peer: Peer, frames: list[bytes]) -> None:
    assert isinstance(peer.exchange(frames), ErrorReply)


@FUZZ
@given(
    position=st.integers(min_value=0, max_value=len(VALID) - 1), mask=st.integers(min_value=1, max_value=255)
)
def test_single_byte_flip(peer: Peer, position: int, mask: int) -> None:
    flipped = bytearray(VALID)
    flipped[position] ^= mask
    msg = peer.exchange(sign_if(peer, bytes(flipped)))
    assert isinstance(msg, ErrorReply) or msg.info.tp_rank in (0, 1)


@FUZZ
@given(
    position=st.integers(min_value=0, max_value=len(VALID) + 31), mask=st.integers(min_value=1, max_value=255)
)
def test_single_byte_flip_of_signed_request_is_refused(position: int, mask: int, peer: Peer) -> None:
    if peer.secret is None:
        return
    frames = [bytearray(f) for f in VALID_SIGNED]
    frame = 0 if position < len(VALID) else 1
    frames[frame][position - frame * len(VALID)] ^= mask
    msg = peer.exchange([bytes(f) for f in frames])
    assert isinstance(msg, ErrorReply) and msg.code == "auth"


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
def test_structured_requests(peer: Peer, fields: dict) -> None:
    msg = peer.exchange(sign_if(peer, msgspec.msgpack.encode(fields)))
    if isinstance(msg, ErrorReply):
        assert msg.code in {"malformed", "version", "incompatible", "unknown_rank", "too_large", "wrong_destination",
                            "stale", "replayed"}


@settings(max_examples=300, deadline=None, database=None)
@given(frames=st.lists(st.binary(max_size=256), max_size=3), secret=st.sampled_from([None, SECRET]))
def test_decode_raises_only_typed_errors(frames: list[bytes], secret: bytes | None) -> None:
    try:
        decode(frames, secret, max_message_bytes=LIMIT)
    except HandshakeError as exc:
        assert exc.code and isinstance(exc.field, str)
