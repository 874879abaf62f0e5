"""Unit tests of the side-channel codec and errors (no sockets)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
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
    MalformedMessageError,
    MessageTooLargeError,
    MetadataDigestError,
    MetadataReply,
    MetadataRequest,
    ProtocolVersionError,
    compute_digest,
    decode,
    encode,
    verify_agent_info,
)
from handshake.codec import MAC_BYTES, error_from_exception, sign
from handshake.testing import make_agent_info

SECRET = b"k" * 16
INFO = make_agent_info(0)
REQUEST = MetadataRequest(
    protocol_version=PROTOCOL_VERSION, tp_rank=0, requester_engine_id="d", compat_hash="c"
)
MESSAGES = [
    REQUEST,
    MetadataReply(protocol_version=PROTOCOL_VERSION, info=INFO),
    ErrorReply(protocol_version=PROTOCOL_VERSION, code="malformed", field="tp_rank", message="fix it"),
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
        encode(msgspec.structs.replace(REQUEST, tp_rank=2**70))


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
    assert {"malformed", "version", "incompatible", "too_large", "auth", "timeout", "unknown_rank"} <= codes
    bind = HandshakeBindError("port taken", errno=98)
    assert isinstance(bind, OSError) and isinstance(bind, HandshakeError) and bind.errno == 98
    assert isinstance(HandshakeTimeoutError("t"), TimeoutError)
    assert str(MalformedMessageError("m", field="f")) == "m"


def test_no_vllm_torch_or_pickle() -> None:
    code = (
        "import sys, handshake, handshake.testing\n"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(handshake.__file__).parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parent, timeout=60)
    for path in root.glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", path.read_text(), re.M), (
            path
        )
