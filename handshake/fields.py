"""The bounded field types and size limits every message of the side-channel wire contract uses.

:mod:`handshake.messages` builds its Structs from these (and re-exports them): each string, bytes, list and
integer field is bounded here, so a peer can make no field larger than the contract says
(:mod:`handshake.bounds` derives each message's largest encoding from them).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_ID_CHARS = 256
"""Longest engine id or request id on the wire (characters)."""

MAX_NAME_CHARS = 512
"""Longest NIXL agent name (characters; p2pkv's embed the engine id)."""

MAX_WORD_CHARS = 64
"""Longest layout name, attention layout, dtype or memory type (characters)."""

MAX_COMPAT_CHARS = 16384
"""Longest compatibility fingerprint (characters; p2pkv's are under 2048)."""

MAX_TEXT_CHARS = 2048
"""Longest refusal message or push reply message (characters)."""

MAX_READERS = 1024
"""Most decode ranks that may read one prefill rank's stream (``readers`` of a
:class:`~handshake.messages.StreamRequest`)."""

MAX_KV_GROUPS = 16
"""Most KV cache groups a :class:`~handshake.messages.StreamRequest` names (vLLM's hybrid models have two or three)."""

MAX_GROUP_BLOCK_IDS = 1 << 16
"""Most block ids one :class:`~handshake.messages.GroupBlocks` carries (a 1M-token prompt in blocks of 16
tokens), so that a :class:`~handshake.messages.StreamRequest` with every group stays within
:data:`~handshake.bounds.MAX_MESSAGE_BYTES`."""

MAX_AGENT_METADATA_BYTES = 4 * 1024 * 1024
"""Largest NIXL agent metadata (bytes). Measured with UCX: about 45 bytes per registered region over TCP
(1024 regions: 45 KiB), more with RDMA and GPU keys; a worker registers one region per KV cache tensor and
one for staging."""

MAX_REGIONS = 4096
"""Most memory regions one :class:`~handshake.messages.KVLayoutDesc` (and one ``staging`` list) describes."""

MAX_HOLD_BLOCK_IDS = 1 << 20
"""Most block ids one :class:`~handshake.messages.HoldQuery` or :class:`~handshake.messages.ReleaseHolds`
carries, all its lists together: one request's hold at its largest (p2pkv's ``MAX_BLOCK_IDS``, every KV cache
group), which a release must name whole. Senders split longer batches (:func:`handshake.client.query_holds`)."""

Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
"""Random bytes (16..64) a request carries and its reply echoes: a reply answers that request only, and a
server refuses a nonce it has seen within its freshness window."""

EchoedNonce = Annotated[bytes, msgspec.Meta(max_length=64)]
"""A request's nonce echoed in a reply (empty only in a refusal of a request that did not decode)."""

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
"""An engine id or request id."""

Word = Annotated[str, msgspec.Meta(max_length=MAX_WORD_CHARS)]
"""A layout name, dtype or memory type."""

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
"""A human-readable message."""

CompatHash = Annotated[str, msgspec.Meta(max_length=MAX_COMPAT_CHARS)]
"""A compatibility fingerprint (:mod:`handshake.fingerprints`)."""

Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
"""A tensor-parallel rank."""

BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
"""A KV block id (blocks of one engine fit in 31 bits)."""

RefusalCode = Literal["malformed", "version", "incompatible", "unknown_rank", "too_large", "auth",
                      "wrong_destination", "stale", "replayed", "internal"]
"""Why a server refused a request (:class:`~handshake.messages.ErrorReply`); a closed set."""
