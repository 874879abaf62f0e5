"""Unit tests of the side-channel codec and errors (no sockets)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import handshake
from handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    ErrorReply,
    HandshakeBindError,
    HandshakeError,
    HandshakeTimeoutError,
    HoldQuery,
    HoldsReply,
    LeaseHeartbeat,
    MalformedMessageError,
    MessageTooLargeError,
    MetadataDigestError,
    MetadataReply,
    MetadataRequest,
    ProtocolVersionError,
    ReleaseHolds,
    compute_digest,
    decode,
    encode,
    verify_agent_info,
)
from handshake.codec import MAC_BYTES, error_from_exception, sign
from tests.handshake_support import make_agent_info

SECRET = b"k" * 16
INFO = make_agent_info(0)
NONCE = bytes(range(16))
HEAD = {"protocol_version": PROTOCOL_VERSION, "to_engine_id": "prefill-engine", "to_rank": 0,
        "sent_at": time.time(), "nonce": NONCE, "requester_engine_id": "d"}
REQUEST = MetadataRequest(**HEAD, compat_hash="c")
MESSAGES = [
    REQUEST,
    MetadataReply(protocol_version=PROTOCOL_VERSION, info=INFO),
    ErrorReply(protocol_version=PROTOCOL_VERSION, code="malformed", field="to_rank", message="fix it"),
    ErrorReply(protocol_version=PROTOCOL_VERSION, code="replayed", field="nonce", message="m", nonce=NONCE),
    LeaseHeartbeat(**HEAD, request_ids=["a", "b"], extend_s=5.0),
    HoldQuery(**HEAD, request_ids=["a"], block_ids=[[1, 2]], extend_s=5.0),
    ReleaseHolds(**HEAD, request_ids=["a"], block_ids=[[1, 2]]),
    HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=1, not_held=["b"], request_ids=["a", "b"], nonce=NONCE),
]


def reply_dict() -> dict:
    return {"type": "metadata_reply", **msgspec.to_builtins(MESSAGES[1], builtin_types=(bytes,))}


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object, secret: bytes | None) -> None:
    frames = encode(msg, secret)  # type: ignore[arg-type]
    assert len(frames) == (2 if secret else 1)
    if secret:
        assert len(frames[1]) == MAC_BYTES
    assert decode(frames, secret) == msg


def test_hmac_checked_before_decoding() -> None:
    with pytest.raises(AuthenticationError) as info:
        decode([b"\xc1not msgpack", b"\x00" * MAC_BYTES], SECRET)
    assert info.value.field == "hmac"
    with pytest.raises(MalformedMessageError):  # authentic but broken: reaches the decoder
        decode([b"\xc1not msgpack", sign(b"\xc1not msgpack", SECRET)], SECRET)


def test_hmac_missing_or_unexpected() -> None:
    payload = encode(REQUEST)[0]
    with pytest.raises(AuthenticationError, match="no HMAC frame"):
        decode([payload], SECRET)
    with pytest.raises(AuthenticationError, match="no shared secret"):
        decode(encode(REQUEST, SECRET), None)
    flipped = bytearray(payload)
    flipped[-1] ^= 1
    with pytest.raises(AuthenticationError):
        decode([bytes(flipped), sign(payload, SECRET)], SECRET)


def test_size_checked_first() -> None:
    with pytest.raises(MessageTooLargeError) as info:
        decode([b"\xc1" * 101, b"bad mac"], SECRET, max_message_bytes=100)
    assert "100-byte limit" in str(info.value) and info.value.code == "too_large"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (
            lambda d: d["info"]["layout"]["regions"][0].update(base_addr="x"),
            "info.layout.regions[0].base_addr",
        ),
        (lambda d: d["info"]["layout"]["regions"][0].update(zz=1), "info.layout.regions[0].zz"),
        (lambda d: d["info"].pop("compat_hash"), "info.compat_hash"),
        (lambda d: d.update(extra=True), "extra"),
        (lambda d: d["info"].update(tp_rank=True), "info.tp_rank"),
    ],
    ids=["wrong_type", "unknown_field", "missing_field", "unknown_top_field", "bool_for_int"],
)
def test_nested_field_path(mutate: object, field: str) -> None:
    data = reply_dict()
    mutate(data)  # type: ignore[operator]
    with pytest.raises(MalformedMessageError) as info:
        decode([msgspec.msgpack.encode(data)])
    assert info.value.field == field
    assert field in str(info.value)


def test_protocol_version_error_names_both_versions() -> None:
    other = PROTOCOL_VERSION + 41
    with pytest.raises(ProtocolVersionError) as info:
        decode(encode(msgspec.structs.replace(REQUEST, protocol_version=other)))
    text = str(info.value)
    assert str(other) in text and str(PROTOCOL_VERSION) in text and "protocol_version" in text
    # An ErrorReply from another version still decodes, so refusals stay readable.
    error = msgspec.structs.replace(MESSAGES[2], protocol_version=other)
    assert decode(encode(error)) == error


@pytest.mark.parametrize(
    "frames",
    [[], [b""], [b"\x91\x01"], [b"\xa3abc"], [b"\x81\xa4type\xc0"], [b"ok", b"too", b"many"]],
)
def test_malformed_frames(frames: list[bytes]) -> None:
    with pytest.raises(MalformedMessageError) as info:
        decode(frames)
    assert info.value.code == "malformed"


def test_encode_out_of_range_int() -> None:
    with pytest.raises(MalformedMessageError):
        encode(msgspec.structs.replace(REQUEST, to_rank=2**70))


def request_dict(**overrides: object) -> bytes:
    fields = {"type": "metadata_request", **msgspec.to_builtins(REQUEST, builtin_types=(bytes,)), **overrides}
    return msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"nonce": None}, "nonce"),  # required since protocol 5
        ({"nonce": b"short"}, "nonce"),  # under 16 bytes: not a random nonce
        ({"nonce": b"n" * 65}, "nonce"),
        ({"to_engine_id": None}, "to_engine_id"),
        ({"to_rank": -1}, "to_rank"),
        ({"sent_at": None}, "sent_at"),
        ({"to_engine_id": "e" * 257}, "to_engine_id"),
        ({"tp_rank": 0}, "tp_rank"),  # the protocol-4 name of to_rank
    ],
    ids=["no_nonce", "short_nonce", "long_nonce", "no_destination", "negative_rank", "no_time", "long_id",
         "old_field"],
)
def test_request_fields_are_checked(overrides: dict, field: str) -> None:
    with pytest.raises(MalformedMessageError) as info:
        decode([request_dict(**overrides)])
    assert info.value.field == field


def test_hold_requests_check_their_fields() -> None:
    base = msgspec.to_builtins(ReleaseHolds(**HEAD, request_ids=["a"], block_ids=[[1]]), builtin_types=(bytes,))
    for overrides, field in (({"block_ids": [[-1]]}, "block_ids[0][0]"), ({"block_ids": None}, "block_ids"),
                             ({"extend_s": 5.0}, "extend_s")):
        data = {"type": "release_holds", **base, **overrides}
        with pytest.raises(MalformedMessageError) as info:
            decode([msgspec.msgpack.encode({k: v for k, v in data.items() if v is not None})])
        assert info.value.field == field
    # A protocol-4 heartbeat carrying fence block ids is refused (protocol 5 asks them with a HoldQuery).
    beat = {"type": "lease_heartbeat", **msgspec.to_builtins(MESSAGES[4], builtin_types=(bytes,)), "block_ids": []}
    with pytest.raises(MalformedMessageError) as info:
        decode([msgspec.msgpack.encode(beat)])
    assert info.value.field == "block_ids"


def test_refusal_codes_are_a_closed_set() -> None:
    data = {"type": "error", **msgspec.to_builtins(MESSAGES[2]), "code": "please-retry-elsewhere"}
    with pytest.raises(MalformedMessageError) as info:
        decode([msgspec.msgpack.encode(data)])
    assert info.value.field == "code"
    # A server never sends a code outside the set: an unexpected one becomes "internal".
    assert error_from_exception(HandshakeError("x", code="digest")).code == "internal"
    reply = error_from_exception(MalformedMessageError("m", field="f"), NONCE)
    assert (reply.code, reply.field, reply.nonce) == ("malformed", "f", NONCE)


def test_digest() -> None:
    assert compute_digest(b"abc") == hashlib.sha256(b"abc").digest()
    verify_agent_info(INFO)
    with pytest.raises(MetadataDigestError) as info:
        verify_agent_info(msgspec.structs.replace(INFO, metadata_digest=b"\x00" * 32))
    assert info.value.field == "info.metadata_digest" and "compute_digest" in str(info.value)


def test_error_reply_is_truncated() -> None:
    reply = error_from_exception(MalformedMessageError("x" * 100_000, field="y" * 10_000))
    assert len(reply.message) <= 2048 and len(reply.field) <= 256


def test_error_types() -> None:
    codes = {
        cls.code for cls in vars(handshake.errors).values() if isinstance(cls, type) and cls.code != "error"
    }
    assert {"malformed", "version", "incompatible", "too_large", "auth", "timeout", "unknown_rank",
            "wrong_destination", "stale", "replayed"} <= codes
    bind = HandshakeBindError("port taken", errno=98)
    assert isinstance(bind, OSError) and isinstance(bind, HandshakeError) and bind.errno == 98
    assert isinstance(HandshakeTimeoutError("t"), TimeoutError)
    assert str(MalformedMessageError("m", field="f")) == "m"


def test_no_vllm_torch_or_pickle() -> None:
    code = (
        "import sys, handshake\n"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(handshake.__file__).parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parent, timeout=60)
    for path in root.glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", path.read_text(), re.M), (
            path
        )
