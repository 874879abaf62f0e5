"""The p2pkv side channel: typed msgspec messages over ZMQ (HMAC, digests) that carry each rank's
NIXL agent metadata and KV layout, and lease heartbeats. Imports neither vLLM nor torch.

The protocol (transport, frames, HMAC, versioning, integrity, refusal codes) is described in
``docs/protocol.md``.
"""

from __future__ import annotations

from handshake.bounds import MAX_MESSAGE_BYTES
from handshake.client import (
    fetch_agent_info,
    query_holds,
    release_holds,
    request_push,
    request_stream,
    send_heartbeat,
)
from handshake.codec import compute_digest, decode, encode, verify_agent_info
from handshake.destination import Destination
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
    ReplayedRequestError,
    StaleRequestError,
    UnknownRankError,
    WrongDestinationError,
)
from handshake.hold_answers import HoldStatus
from handshake.link import HoldLink
from handshake.messages import (
    PROTOCOL_VERSION,
    AgentInfo,
    ErrorReply,
    GroupBlocks,
    HeadSlice,
    HoldQuery,
    HoldsReply,
    KVLayoutDesc,
    KVRegion,
    LeaseHeartbeat,
    Message,
    MetadataReply,
    MetadataRequest,
    PushReply,
    PushRequest,
    ReleaseHolds,
    Request,
    StreamRequest,
)
from handshake.replay import ReplayGuard
from handshake.server import HandshakeServer

__all__ = [
    "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "AgentInfo", "AuthenticationError", "Destination", "ErrorReply",
    "GroupBlocks", "HandshakeBindError", "HandshakeCancelledError", "HandshakeError", "HandshakeServer",
    "HandshakeTimeoutError", "HeadSlice",
    "HoldLink", "HoldQuery", "HoldStatus", "HoldsReply", "IncompatiblePeerError", "KVLayoutDesc", "KVRegion",
    "LeaseHeartbeat", "MalformedMessageError", "Message", "MessageTooLargeError", "MetadataDigestError",
    "MetadataReply", "MetadataRequest", "ProtocolVersionError", "PushReply", "PushRequest", "ReleaseHolds",
    "RemoteRefusedError", "ReplayGuard", "ReplayedRequestError", "Request", "StaleRequestError", "StreamRequest",
    "UnknownRankError",
    "WrongDestinationError", "compute_digest", "decode", "encode", "fetch_agent_info", "query_holds", "release_holds",
    "request_push", "request_stream", "send_heartbeat", "verify_agent_info",
]
