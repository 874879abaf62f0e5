"""Typed errors of the side channel.

Every error carries a machine-readable ``code`` (the same strings an
:class:`~handshake.messages.ErrorReply` carries on the wire) and the
offending ``field`` (``""`` when the error is not about one field). The
message names the field and says how to fix the problem.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "HandshakeBindError",
    "HandshakeCancelledError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "IncompatiblePeerError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "MetadataDigestError",
    "ProtocolVersionError",
    "RemoteRefusedError",
    "ReplayedRequestError",
    "StaleRequestError",
    "UnknownRankError",
    "WrongDestinationError",
]


class HandshakeError(Exception):
    """Base class of every side-channel error.

    Attributes:
        code: machine-readable reason, e.g. ``"malformed"`` or ``"auth"``.
        field: the offending message field (dotted path such as
            ``"info.tp_rank"``), or ``""`` when not about one field.
        message: the human-readable explanation (also ``str(exc)``).
    """

    code: str = "error"

    def __init__(self, message: str, *, field: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class MalformedMessageError(HandshakeError):
    """The bytes are not a valid message: bad msgpack, wrong frame count,
    unknown or missing field, wrong field type."""

    code = "malformed"


class ProtocolVersionError(HandshakeError):
    """The peer speaks another :data:`~handshake.messages.PROTOCOL_VERSION`."""

    code = "version"


class IncompatiblePeerError(HandshakeError):
    """The peer is reachable but must not exchange KV with us (e.g. its
    ``compat_hash`` differs: other model, dtype or vLLM version)."""

    code = "incompatible"


class MessageTooLargeError(HandshakeError):
    """A message exceeds the configured size limit (bytes)."""

    code = "too_large"


class AuthenticationError(HandshakeError):
    """The HMAC frame is missing or does not match the shared secret."""

    code = "auth"


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """No reply arrived within the timeout after every attempt."""

    code = "timeout"


class HandshakeCancelledError(HandshakeError):
    """The caller cancelled the handshake (e.g. the worker is shutting down)."""

    code = "cancelled"


class UnknownRankError(HandshakeError):
    """The server holds no :class:`~handshake.messages.AgentInfo` for the
    requested ``tp_rank``."""

    code = "unknown_rank"


class WrongDestinationError(HandshakeError):
    """A request names another engine id or rank than the server's (``to_engine_id`` / ``to_rank``):
    sent to the wrong address, or replayed to another engine."""

    code = "wrong_destination"


class StaleRequestError(HandshakeError):
    """A request's ``sent_at`` lies outside the server's freshness window (clock skew, or a replay)."""

    code = "stale"


class ReplayedRequestError(HandshakeError):
    """A request's nonce was seen within the freshness window: a replayed request."""

    code = "replayed"


class MetadataDigestError(HandshakeError):
    """``AgentInfo.metadata_digest`` is not the SHA-256 of
    ``AgentInfo.agent_metadata`` (corrupted or tampered metadata)."""

    code = "digest"


class HandshakeBindError(HandshakeError, OSError):
    """The server could not bind its listening address (e.g. port in use).

    Also an :class:`OSError`; ``errno`` is set when the cause has one.
    """

    code = "bind"

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        HandshakeError.__init__(self, message, field="port")
        self.errno = errno
        self.strerror = message


class RemoteRefusedError(HandshakeError):
    """The server answered with an :class:`~handshake.messages.ErrorReply`.

    ``code``, ``field`` and ``remote_message`` are the reply's; ``message``
    adds which server refused. Not retried: asking again gets the same answer.
    """

    def __init__(self, code: str, field: str, remote_message: str, *, endpoint: str = "") -> None:
        where = f"handshake server {endpoint}" if endpoint else "handshake server"
        super().__init__(f"{where} refused the request ({code}): {remote_message}", field=field, code=code)
        self.remote_message = remote_message
        self.endpoint = endpoint
