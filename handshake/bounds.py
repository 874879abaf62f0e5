"""Upper bounds (bytes) of each side-channel message's msgpack encoding, derived from the field bounds of
:mod:`handshake.fields` and :mod:`handshake.messages`, and the largest message a server or client accepts
(:data:`MAX_MESSAGE_BYTES`).

msgspec writes a Struct as a map of its field names (and its tag); a str bounded in characters takes at most 4
bytes per character (UTF-8).
"""

from __future__ import annotations

from handshake.fields import (
    MAX_AGENT_METADATA_BYTES,
    MAX_COMPAT_CHARS,
    MAX_HOLD_BLOCK_IDS,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_REGIONS,
    MAX_WORD_CHARS,
)
from handshake.messages import (
    KV_DIGEST_BYTES,
    MAX_HEARTBEAT_IDS,
    MAX_PUSH_ROWS,
    ROW_BYTES,
)


def _text(chars: int) -> int:
    """Bytes of a str of at most ``chars`` characters: 4 per character and a 5-byte header."""
    return 4 * chars + 5


def _blob(n: int) -> int:
    """Bytes of a bytes value (or a list of 1-byte items) of at most ``n`` bytes, with a 5-byte header."""
    return n + 5


_FIXED = 1024
"""One Struct's map header, tag, field names and numbers (ints and floats take at most 9 bytes), besides its
strings, bytes and lists: the largest, :class:`~handshake.messages.KVLayoutDesc` (14 fields), takes under 400."""

_REGION = 128
"""One :class:`~handshake.messages.KVRegion` (6 field names, 6 ints): at most 114."""

_REQUEST = _FIXED + 2 * _text(MAX_ID_CHARS) + _blob(64)
"""The fields every :class:`~handshake.messages.Request` carries (two engine ids, the nonce): 3,151."""

AGENT_INFO_BYTES = (_FIXED + _text(MAX_ID_CHARS) + _text(MAX_NAME_CHARS) + _blob(MAX_AGENT_METADATA_BYTES)
                    + _blob(64) + _text(MAX_COMPAT_CHARS)
                    + _FIXED + 4 * _text(MAX_WORD_CHARS) + 2 * _blob(MAX_REGIONS * _REGION))
"""The largest :class:`AgentInfo`: 4 MiB of metadata, 64 KiB of fingerprint, 2 x 4096 regions of 128 bytes
(layout and staging), names: 5,314,679 (5.07 MiB)."""

HOLD_REQUEST_BYTES = (_REQUEST + _blob(MAX_HEARTBEAT_IDS * _text(MAX_ID_CHARS))
                      + _blob(5 * MAX_HEARTBEAT_IDS + 5 * MAX_HOLD_BLOCK_IDS)
                      + _blob(5 * MAX_HEARTBEAT_IDS + ROW_BYTES * MAX_PUSH_ROWS))
"""The largest :class:`LeaseHeartbeat`, :class:`HoldQuery` or :class:`ReleaseHolds`: 4096 ids of 1,029 bytes,
2**20 block ids of 5 bytes (msgpack uint32) in 4096 lists, 2**18 digest rows of 24 bytes in 4096 lists:
15,793,246 (15.06 MiB)."""

HOLDS_REPLY_BYTES = (_FIXED + 4 * _blob(MAX_HEARTBEAT_IDS * _text(MAX_ID_CHARS)) + _blob(64)
                     + _blob(MAX_HEARTBEAT_IDS * (KV_DIGEST_BYTES + 5)))
"""The largest :class:`HoldsReply`: four lists of 4096 ids, 4096 digests of 264 bytes: 17,962,078 (17.13 MiB)."""

PUSH_REQUEST_BYTES = (_REQUEST + _text(MAX_ID_CHARS) + _blob(5 * MAX_HOLD_BLOCK_IDS) + _blob(32) + AGENT_INFO_BYTES
                      + 2 * _blob(MAX_PUSH_ROWS * 24))
"""The largest :class:`PushRequest`: 2**20 block ids (5 MiB), an :class:`AgentInfo`, 2 x 6 MiB of rows:
23,144,703 (22.07 MiB), the largest message."""

_MiB = 1024 * 1024
MAX_MESSAGE_BYTES = -(-(max(PUSH_REQUEST_BYTES, HOLDS_REPLY_BYTES, HOLD_REQUEST_BYTES,
                            _FIXED + AGENT_INFO_BYTES + _blob(64)) + 32) // _MiB) * _MiB
"""Largest message (bytes, all frames together: its payload and 32 bytes of HMAC) a server or client accepts;
larger input is refused. The largest message any sender within the bounds above makes, and its HMAC, rounded up
to a MiB: 23 MiB, for :data:`PUSH_REQUEST_BYTES` (the others: :data:`HOLDS_REPLY_BYTES`,
:data:`HOLD_REQUEST_BYTES`, a :class:`MetadataReply` of :data:`AGENT_INFO_BYTES` and 1 KiB). It is a total, never
a buffer a peer can make a server fill before the CURVE handshake: a frame is at most 256 KiB
(:data:`handshake.codec.FRAME_BYTES`)."""
