"""The NIXL notifications between ranks: "done" (decode → prefill) and "pushed" (prefill → decode).

"done": a decode rank sends it a prefill rank once it has a request's KV.
One encoder, one parser. The message travels as a NIXL notification
(``send_notif``) and reads
``p2pkv:done:<request_id>|<engine_id>:<tp_rank>:<notifiers>|<blocks digest>``:
the prefill request id, the decode rank that finished, how many decode
ranks will notify this prefill rank for the request (several when decode TP
is larger; see :func:`p2pkv.dataplane.topology.notifiers_of`), and the
digest of the hold's block ids the decode rank was given
(:func:`blocks_digest`; the prefill worker frees a hold only when it is the
digest of its own block ids). With the side-channel secret,
``#<HMAC-SHA256 hex>`` of everything before it follows, and a notification
without a valid one is dropped (the lease frees the blocks).

"pushed": the notification of a prefill rank's WRITE in push mode
(:class:`handshake.PushRequest`), ``p2pkv:pushed:<push_id hex>`` (NIXL
delivers it after the WRITE's bytes), or, when the WRITE did not happen or
failed, ``p2pkv:push_failed:<push_id hex>|<reason>`` (sent on its own); both
signed like "done".
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = b"p2pkv:done:"
PUSH_PREFIX = b"p2pkv:push"
"""What both "pushed" and "push_failed" notifications start with."""
_PUSHED, _PUSH_FAILED = b"p2pkv:pushed:", b"p2pkv:push_failed:"
_COUNT = re.compile(r"[0-9]{1,9}")
"""A "done" notification's count of notifiers, as :func:`encode_done` writes it."""


@dataclass(frozen=True)
class DoneNotification:
    """One decode rank's "done" for one prefill request.

    Attributes:
        request_id: the request id on the prefill engine.
        reader: ``<engine_id>:<tp_rank>`` of the decode rank (``""`` when absent).
        notifiers: decode ranks the prefill rank waits for (>= 1).
        blocks: :func:`blocks_digest` of the hold's block ids (``""``: not given).
    """

    request_id: str
    reader: str = ""
    notifiers: int = 1
    blocks: str = ""


def blocks_digest(block_ids: Sequence[int]) -> str:
    """A short digest (32 hex digits of SHA-256) of a hold's block ids, in order (every KV cache group's,
    flattened as in ``kv_transfer_params``)."""
    return hashlib.sha256(",".join(map(str, block_ids)).encode()).hexdigest()[:32]


def _mac(data: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).hexdigest().encode()


def encode_done(note: DoneNotification, secret: bytes | None = None) -> bytes:
    """The wire bytes of ``note`` (signed with ``secret`` when given)."""
    data = PREFIX + f"{note.request_id}|{note.reader}:{note.notifiers}|{note.blocks}".encode()
    return data + b"#" + _mac(data, secret) if secret else data


def parse_done(msg: bytes, secret: bytes | None = None) -> DoneNotification | None:
    """Parse a "done" notification: exactly what :func:`encode_done` makes.

    Returns:
        The notification; None when ``msg`` is not a p2pkv "done" message,
        (with ``secret``) its MAC is missing or wrong, or its body is not
        ``<request_id>|<reader>:<notifiers>|<digest>`` with ``notifiers`` a
        decimal count of at least 1 (the request id may hold ``|``; the
        reader and digest hold none).
    """
    if not msg.startswith(PREFIX):
        return None
    if secret:
        data, sep, mac = msg.rpartition(b"#")
        if not sep or not hmac.compare_digest(mac, _mac(data, secret)):
            return None
        msg = data
    body = msg[len(PREFIX):].decode(errors="replace")
    rest, sep, blocks = body.rpartition("|")  # from the right: a request id may hold "|"
    request_id, sep2, tail = rest.rpartition("|")
    reader, sep3, count = tail.rpartition(":")
    if not (sep and sep2 and sep3 and _COUNT.fullmatch(count)) or int(count) < 1:
        return None
    return DoneNotification(request_id, reader, int(count), blocks)


@dataclass(frozen=True)
class PushedNotification:
    """A prefill rank's word on one WRITE of push mode.

    Attributes:
        push_id: the push request's ``push_id``.
        ok: the WRITE's bytes have landed (False: it did not happen, or failed).
        reason: why not, when ``ok`` is False.
    """

    push_id: bytes
    ok: bool
    reason: str = ""


def encode_pushed(note: PushedNotification, secret: bytes | None = None) -> bytes:
    """The wire bytes of ``note`` (signed with ``secret`` when given); the reason is cut to 200 characters."""
    if note.ok:
        data = _PUSHED + note.push_id.hex().encode()
    else:
        data = _PUSH_FAILED + note.push_id.hex().encode() + b"|" + note.reason[:200].encode(errors="replace")
    return data + b"#" + _mac(data, secret) if secret else data


def parse_pushed(msg: bytes, secret: bytes | None = None) -> PushedNotification | None:
    """Parse a "pushed"/"push_failed" notification; None when it is neither, malformed, or (with ``secret``)
    its MAC is missing or wrong."""
    if secret:
        data, sep, mac = msg.rpartition(b"#")
        if not sep or not hmac.compare_digest(mac, _mac(data, secret)):
            return None
        msg = data
    ok = msg.startswith(_PUSHED)
    if not ok and not msg.startswith(_PUSH_FAILED):
        return None
    body = msg[len(_PUSHED if ok else _PUSH_FAILED):]
    hex_id, _, reason = body.partition(b"|")
    try:
        push_id = bytes.fromhex(hex_id.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return PushedNotification(push_id, ok, "" if ok else reason.decode(errors="replace"))
