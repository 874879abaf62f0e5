"""Wire encoding of side-channel messages: msgpack frames with optional HMAC.

A message is a list of ZMQ frames:

* the payload: the msgpack encoding (msgspec, strict) of one
  :data:`~handshake.messages.Message`, cut into frames of
  :data:`FRAME_BYTES` (the last one shorter; most messages are one frame);
* last, only when a shared secret is configured: ``HMAC-SHA256(secret,
  payload)`` (32 bytes).

Frames are cut so that ZMQ's per-frame limit (``ZMQ_MAXMSGSIZE``,
:data:`handshake._net.FRAME_LIMIT`) can be small: it is also all that a
peer can make a server buffer before the CURVE handshake completes.

:func:`decode` checks, in this order, the size, the frames, the HMAC
(constant-time compare) and only then parses the payload, so unauthenticated
or oversized input never reaches the msgpack decoder. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

import msgspec

from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.errors import (
    AuthenticationError,
    HandshakeError,
    MalformedMessageError,
    MessageTooLargeError,
    MetadataDigestError,
    ProtocolVersionError,
)
from handshake.fields import MAX_TEXT_CHARS
from handshake.messages import (
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    AgentInfo,
    ErrorReply,
    Message,
    RefusalCode,
)

__all__ = [
    "FRAME_BYTES",
    "MAC_BYTES",
    "check_bounds",
    "compute_digest",
    "decode",
    "encode",
    "error_from_exception",
    "sign",
    "verify_agent_info",
]

MAC_BYTES = 32
"""Length (bytes) of the HMAC-SHA256 frame."""

FRAME_BYTES = 256 * 1024
"""Largest payload frame (bytes): a longer payload is cut into frames of exactly this size and a last, shorter
one. ZMQ's per-frame limit is this plus the CURVE framing (:data:`handshake._net.FRAME_LIMIT`)."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message, strict=True)
_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_NAMED_FIELD_RE = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]*)`")


Frame = bytes | bytearray | memoryview


def sign(payload: bytes, secret: bytes) -> bytes:
    """Return ``HMAC-SHA256(secret, payload)`` (32 bytes)."""
    return hmac.new(secret, payload, hashlib.sha256).digest()


def encode(msg: Message, secret: bytes | None = None) -> list[bytes]:
    """Encode ``msg`` into ZMQ frames.

    Args:
        msg: the message to send.
        secret: shared HMAC key (bytes); when set (non-empty), a second frame
            carries the payload's HMAC-SHA256.

    Returns:
        The payload's frames (one unless it is longer than :data:`FRAME_BYTES`),
        then the HMAC frame with a secret.

    Raises:
        MalformedMessageError: ``msg`` cannot be encoded (e.g. an int
            outside the 64-bit range).
    """
    try:
        payload = _ENCODER.encode(msg)
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise MalformedMessageError(
            f"cannot encode {type(msg).__name__}: {exc}; fix the field values before sending"
        ) from exc
    frames = [payload] if len(payload) <= FRAME_BYTES else [
        payload[i:i + FRAME_BYTES] for i in range(0, len(payload), FRAME_BYTES)]
    if secret:
        frames.append(sign(payload, secret))
    return frames


def decode(
    frames: Sequence[Frame],
    secret: bytes | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> Message:
    """Decode ZMQ frames into a message, strictly.

    Args:
        frames: the frames as received (without any ROUTER identity frame).
        secret: shared HMAC key (bytes); when set the HMAC frame is required.
        max_message_bytes: largest accepted total size of all frames (bytes).

    Returns:
        The decoded :data:`~handshake.messages.Message`.

    Raises:
        MalformedMessageError: wrong frame count or payload frames not cut
            at :data:`FRAME_BYTES`, empty payload, invalid msgpack,
            unknown/missing field, wrong type or a bound exceeded (``field``
            is the dotted path of the offending field when msgspec names one).
        MessageTooLargeError: the frames exceed ``max_message_bytes``.
        AuthenticationError: the HMAC frame is missing or wrong.
        ProtocolVersionError: the message carries another protocol version.
    """
    expected = 2 if secret else 1
    total = sum(len(f) for f in frames)
    if total > max_message_bytes:
        raise MessageTooLargeError(
            f"message is {total} bytes (all frames), over the {max_message_bytes}-byte limit; "
            "send less agent metadata or raise max_message_bytes on both peers",
            field="frames",
        )
    if len(frames) == 0:
        raise MalformedMessageError(
            "message has no frames; send [payload] or [payload, hmac]", field="frames"
        )
    if secret and len(frames) == 1:
        raise AuthenticationError(
            "message has no HMAC frame but this side requires one; "
            "configure the same shared secret on both peers",
            field="hmac",
        )
    if not secret and len(frames) == 2 and len(frames[1]) == MAC_BYTES and len(frames[0]) != FRAME_BYTES:
        raise AuthenticationError(
            "message carries an HMAC frame but this side has no shared secret; "
            "configure the same shared secret on both peers",
            field="hmac",
        )
    parts = frames[:-1] if secret else frames
    if (any(len(f) != FRAME_BYTES for f in parts[:-1]) or len(parts[-1]) > FRAME_BYTES
            or (len(parts) > 1 and not parts[-1])):
        raise MalformedMessageError(
            f"message has {len(frames)} frames that are not a payload cut into frames of {FRAME_BYTES} bytes "
            f"(the last one 1..{FRAME_BYTES}){' and its HMAC' if secret else ''}; send {expected} frame(s) for "
            f"a payload of up to {FRAME_BYTES} bytes, one more per {FRAME_BYTES} bytes beyond", field="frames"
        )
    payload = b"".join(parts) if len(parts) > 1 else bytes(parts[0])
    if secret:
        mac = bytes(frames[-1])
        if not hmac.compare_digest(mac, sign(payload, secret)):
            raise AuthenticationError(
                "HMAC frame does not match the payload; configure the same shared secret on both peers",
                field="hmac",
            )
    if not payload:
        raise MalformedMessageError("payload frame is empty; send a msgpack-encoded message", field="payload")
    return _decode_payload(payload)


def _decode_payload(payload: bytes) -> Message:
    try:
        msg = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        _raise_if_other_version(payload, exc)
        field = _field_from_error(str(exc))
        raise MalformedMessageError(
            f"invalid message: {exc}; fix field {field or '<message>'!r} to match "
            f"protocol version {PROTOCOL_VERSION}",
            field=field,
        ) from exc
    except Exception as exc:  # msgspec.DecodeError and anything odd: never crash the caller
        raise MalformedMessageError(
            f"payload is not valid msgpack: {exc}; send one msgpack-encoded message per payload frame",
            field="payload",
        ) from exc
    # ErrorReply keeps its shape across versions so refusals stay readable.
    if not isinstance(msg, ErrorReply) and msg.protocol_version != PROTOCOL_VERSION:
        raise _version_error(msg.protocol_version)
    return msg


def _version_error(theirs: object) -> ProtocolVersionError:
    return ProtocolVersionError(
        f"peer sent protocol_version {theirs!r}, this side speaks side-channel protocol "
        f"version {PROTOCOL_VERSION}; run the same p2pkv version on prefill and decode",
        field="protocol_version",
    )


def _raise_if_other_version(payload: bytes, cause: Exception) -> None:
    """Report a version mismatch rather than the schema error it caused."""
    try:
        loose = msgspec.msgpack.decode(payload)
    except Exception:
        return
    if isinstance(loose, dict):
        version = loose.get("protocol_version")
        if isinstance(version, int) and not isinstance(version, bool) and version != PROTOCOL_VERSION:
            raise _version_error(version) from cause


def _field_from_error(text: str) -> str:
    """Dotted field path from a msgspec error text (``""`` if none)."""
    path = ""
    match = _PATH_RE.search(text)
    if match:
        path = match.group("path").lstrip(".")
    named = _NAMED_FIELD_RE.search(text)
    if named:
        path = f"{path}.{named.group('name')}" if path else named.group("name")
    return path


def check_bounds(msg: Message | AgentInfo) -> None:
    """Check ``msg`` against every bound the wire contract sets (what the peer's decoder checks), before it is sent.

    Raises:
        MalformedMessageError: a bound is exceeded (or a value cannot be encoded); ``field`` names it.
    """
    try:
        msgspec.msgpack.decode(_ENCODER.encode(msg), type=type(msg), strict=True)
    except msgspec.ValidationError as exc:
        field = _field_from_error(str(exc))
        raise MalformedMessageError(f"{type(msg).__name__} exceeds the wire contract: {exc}", field=field) from exc
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise MalformedMessageError(f"cannot encode {type(msg).__name__}: {exc}") from exc


def compute_digest(agent_metadata: bytes) -> bytes:
    """SHA-256 (32 bytes) of NIXL agent metadata bytes."""
    return hashlib.sha256(agent_metadata).digest()


def verify_agent_info(info: AgentInfo) -> None:
    """Check that ``info.metadata_digest`` is the SHA-256 of ``info.agent_metadata``.

    Raises:
        MetadataDigestError: the digest does not match.
    """
    if not hmac.compare_digest(info.metadata_digest, compute_digest(info.agent_metadata)):
        raise MetadataDigestError(
            f"info.metadata_digest of {info.engine_id[:64]!r} rank {info.tp_rank} is not the "
            "SHA-256 of its agent_metadata (corrupted or tampered); re-publish the AgentInfo "
            "with metadata_digest=compute_digest(agent_metadata)",
            field="info.metadata_digest",
        )


_REFUSAL_CODES: frozenset[str] = frozenset(RefusalCode.__args__)


def error_from_exception(exc: HandshakeError, nonce: bytes = b"") -> ErrorReply:
    """The :class:`ErrorReply` a server sends for ``exc``, bound to the request with ``nonce``.

    ``field`` and ``message`` are truncated (to 256 and 2048 characters, the bounds of
    :class:`ErrorReply`) so a
    refusal never echoes a large request back; a code outside
    :data:`~handshake.messages.RefusalCode` is sent as ``"internal"``.
    """
    return ErrorReply(
        protocol_version=PROTOCOL_VERSION,
        code=exc.code if exc.code in _REFUSAL_CODES else "internal",  # type: ignore[arg-type]
        field=exc.field[:MAX_ID_CHARS],
        message=exc.message[:MAX_TEXT_CHARS],
        nonce=nonce,
    )
