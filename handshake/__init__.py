"""The p2pkv side channel: serves per-rank NIXL agent metadata between peers.

Before a decode worker can pull KV blocks from a prefill worker over NIXL it
needs that worker's NIXL agent metadata and KV memory layout
(:class:`AgentInfo`). Every prefill worker publishes its own AgentInfo on a
:class:`HandshakeServer`; a decode worker fetches it with
:func:`fetch_agent_info`. This package imports neither vllm nor torch.

Transport
    ZMQ over TCP. The server binds a ROUTER socket and answers every request
    with exactly one reply; the client uses a fresh DEALER socket per attempt
    (no empty delimiter frame), waits with a timeout and retries timeouts only.

Frames
    Frame 0 is one msgpack-encoded :data:`Message` (msgspec, strict: unknown
    fields, missing fields and wrong types are refused and the error names
    the field). Nothing is pickled. A message is at most
    :data:`MAX_MESSAGE_BYTES` bytes; slightly larger ones are refused with
    code ``"too_large"``, grossly larger frames (over twice the limit) are
    dropped by libzmq (``ZMQ_MAXMSGSIZE``) and the sender sees a timeout.

HMAC
    With a shared secret configured, frame 1 is ``HMAC-SHA256(secret,
    frame 0)``, checked in constant time before frame 0 is decoded. Replies
    are signed the same way, except an ``"auth"`` refusal, which goes
    unsigned because the requester evidently lacks the key; the client
    trusts such an unsigned reply only to explain why it failed.

Versioning
    Every message carries ``protocol_version``; a peer speaking another
    :data:`PROTOCOL_VERSION` is refused with code ``"version"`` (reported
    even when the other version's schema does not decode). Any incompatible
    change to :mod:`handshake.messages` bumps the version. ``ErrorReply``
    keeps its fields across versions so refusals stay readable. Separately,
    ``compat_hash`` (vLLM version, model, dtype, KV geometry) must match, or
    the request is refused with code ``"incompatible"``.

Integrity
    ``AgentInfo.metadata_digest`` is the SHA-256 of ``agent_metadata``; the
    server checks it on :meth:`HandshakeServer.set_info` and the client checks
    it (and the rank and compat hash) before returning.

Besides metadata requests, a prefill worker's server takes
:class:`LeaseHeartbeat` messages: a decode engine names the prefill request
ids it still has queued, and the worker extends their leases.

Refusal codes (:class:`ErrorReply` ``code`` / :class:`HandshakeError` ``code``):
``malformed``, ``version``, ``incompatible``, ``unknown_rank``,
``too_large``, ``auth``, ``internal``.
"""

from __future__ import annotations

from handshake.client import HandshakeClient, fetch_agent_info, send_heartbeat
from handshake.codec import compute_digest, decode, encode, verify_agent_info
from handshake.errors import (
    AuthenticationError,
    HandshakeBindError,
    HandshakeCancelledError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    MalformedMessageError,
    MessageTooLargeError,
    MetadataDigestError,
    ProtocolVersionError,
    RemoteRefusedError,
    UnknownRankError,
)
from handshake.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AgentInfo,
    ErrorReply,
    HeartbeatReply,
    KVLayoutDesc,
    KVRegion,
    LeaseHeartbeat,
    Message,
    MetadataReply,
    MetadataRequest,
)
from handshake.server import HandshakeServer

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "AgentInfo",
    "AuthenticationError",
    "ErrorReply",
    "HandshakeBindError",
    "HandshakeCancelledError",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeServer",
    "HandshakeTimeoutError",
    "HeartbeatReply",
    "IncompatiblePeerError",
    "KVLayoutDesc",
    "KVRegion",
    "LeaseHeartbeat",
    "MalformedMessageError",
    "Message",
    "MessageTooLargeError",
    "MetadataDigestError",
    "MetadataReply",
    "MetadataRequest",
    "ProtocolVersionError",
    "RemoteRefusedError",
    "UnknownRankError",
    "compute_digest",
    "decode",
    "encode",
    "fetch_agent_info",
    "send_heartbeat",
    "verify_agent_info",
]
