"""The NIXL notifications between ranks, as strict msgspec Structs: "done" (decode → prefill) and
"pushed" (prefill → decode).

"done" (:class:`DoneNotification`): a decode rank sends it a prefill rank once
it has a request's KV: the prefill request id, the decode rank that finished,
how many decode ranks will notify this prefill rank for the request (several
when decode TP is larger; see :func:`p2pkv.dataplane.topology.notifiers_of`),
and the digest of the hold's block ids the decode rank was given
(:func:`blocks_digest`; the prefill worker frees a hold only when it is the
digest of its own block ids).

"pushed" (:class:`PushedNotification`): a prefill rank's word on one WRITE of
push mode (:class:`handshake.PushRequest`): NIXL delivers it after the
WRITE's bytes, or, when the WRITE did not happen or failed, on its own with
``ok`` False and the reason; with verified KV, the digest of what the WRITE read.

Wire: ``<prefix><msgpack of the Struct>[<HMAC-SHA256, 32 bytes>]``, the
prefix :data:`PREFIX` or :data:`PUSH_PREFIX` (what the transfer agent sorts
NIXL's notifications by, :meth:`p2pkv.dataplane.agent.NixlTransferAgent.take_notifs`),
the MAC over prefix and body when the side channel has a secret. A parser
checks, in this order: the prefix, the size (at most
:data:`MAX_NOTIFICATION_BYTES`), the MAC, then the body, strictly (every
field typed and bounded, no unknown or missing field); a notification that
fails any check is dropped, never raised (it came from a peer). The format
is part of the side-channel protocol's version (:data:`handshake.PROTOCOL_VERSION`
9): peers that would read it otherwise never pass the handshake.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Annotated, TypeVar

import msgspec

from handshake.messages import MAX_ID_CHARS, MAX_NAME_CHARS, KVDigest, PushId

PREFIX = b"p2pkv:done:"
"""What a "done" notification starts with."""
PUSH_PREFIX = b"p2pkv:push:"
"""What a "pushed" notification (a WRITE landed, or did not) starts with."""
MAC_BYTES = 32
"""Bytes of the HMAC-SHA256 that ends a signed notification."""
MAX_REASON_CHARS = 200
"""Longest reason a "pushed" notification gives for a WRITE that did not land (characters)."""
MAX_NOTIFIERS = 1 << 16
"""Most decode ranks one "done" may say will notify (far above any tensor-parallel size)."""
MAX_NOTIFICATION_BYTES = 4096
"""Largest notification parsed (bytes, prefix and MAC included); both kinds fit with room to spare."""

Digest = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{32})?$")]
"""A :func:`blocks_digest` (32 hex digits), or ``""``."""


class DoneNotification(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One decode rank's "done" for one prefill request.

    Attributes:
        request_id: the request id on the prefill engine (1–256 characters).
        reader: ``<engine_id>:<tp_rank>`` of the decode rank (``""`` when absent).
        notifiers: decode ranks the prefill rank waits for (1 to :data:`MAX_NOTIFIERS`).
        blocks: :func:`blocks_digest` of the hold's block ids (``""``: not given).
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    reader: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] = ""
    notifiers: Annotated[int, msgspec.Meta(ge=1, le=MAX_NOTIFIERS)] = 1
    blocks: Digest = ""


class PushedNotification(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank's word on one WRITE of push mode.

    Attributes:
        push_id: the push request's ``push_id`` (16–32 bytes).
        ok: the WRITE's bytes have landed (False: it did not happen, or failed).
        reason: why not, when ``ok`` is False (at most :data:`MAX_REASON_CHARS`; the encoder cuts it).
        digest: verified KV (a push or stream request that asked for it, ``kv_digest``): the digest of what the
            WRITEs read (:mod:`p2pkv.dataplane.digest`); ``b""``: none.
    """

    push_id: PushId
    ok: bool
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] = ""
    digest: KVDigest = b""


N = TypeVar("N", DoneNotification, PushedNotification)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {DoneNotification: msgspec.msgpack.Decoder(DoneNotification),
             PushedNotification: msgspec.msgpack.Decoder(PushedNotification)}


def blocks_digest(block_ids: Sequence[int]) -> str:
    """A short digest (32 hex digits of SHA-256) of a hold's block ids, in order (every KV cache group's,
    flattened as in ``kv_transfer_params``)."""
    return hashlib.sha256(",".join(map(str, block_ids)).encode()).hexdigest()[:32]


def _mac(data: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def _encode(prefix: bytes, note: msgspec.Struct, secret: bytes | None) -> bytes:
    data = prefix + _ENCODER.encode(note)
    return data + _mac(data, secret) if secret else data


def _parse(prefix: bytes, kind: type[N], msg: bytes, secret: bytes | None) -> N | None:
    """``msg`` as a ``kind`` after the checks in their order (prefix, size, MAC, body); None when one fails."""
    if not msg.startswith(prefix) or len(msg) > MAX_NOTIFICATION_BYTES:
        return None
    if secret:
        data, mac = msg[:-MAC_BYTES], msg[-MAC_BYTES:]
        if len(msg) < len(prefix) + MAC_BYTES or not hmac.compare_digest(mac, _mac(data, secret)):
            return None
        msg = data
    try:
        return _DECODERS[kind].decode(msg[len(prefix):])
    except msgspec.DecodeError:  # ValidationError included
        return None


def encode_done(note: DoneNotification, secret: bytes | None = None) -> bytes:
    """The wire bytes of ``note`` (signed with ``secret`` when given)."""
    return _encode(PREFIX, note, secret)


def parse_done(msg: bytes, secret: bytes | None = None) -> DoneNotification | None:
    """Parse a "done" notification: exactly what :func:`encode_done` makes.

    Returns:
        The notification; None when ``msg`` is not a p2pkv "done" message, is
        over :data:`MAX_NOTIFICATION_BYTES`, (with ``secret``) its MAC is
        missing or wrong, or its body is not a valid :class:`DoneNotification`.
    """
    return _parse(PREFIX, DoneNotification, msg, secret)


def encode_pushed(note: PushedNotification, secret: bytes | None = None) -> bytes:
    """The wire bytes of ``note`` (signed with ``secret`` when given); the reason is cut to
    :data:`MAX_REASON_CHARS` characters, and dropped when ``ok``."""
    reason = "" if note.ok else note.reason[:MAX_REASON_CHARS]
    return _encode(PUSH_PREFIX, msgspec.structs.replace(note, reason=reason), secret)


def parse_pushed(msg: bytes, secret: bytes | None = None) -> PushedNotification | None:
    """Parse a "pushed" notification; None when it is not one, is over :data:`MAX_NOTIFICATION_BYTES`,
    (with ``secret``) its MAC is missing or wrong, or its body is not a valid :class:`PushedNotification`."""
    return _parse(PUSH_PREFIX, PushedNotification, msg, secret)
