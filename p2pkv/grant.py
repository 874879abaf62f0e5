"""The stream grant: the proxy's signed word that a prefill engine may stream one request's KV into a decode engine.

Layer-streamed transfer (docs/streaming.md) starts before the prefill
engine has answered, so no prefill-signed ``p2pkv_capability`` exists yet.
The proxy, which holds the side channel's secret, signs a grant instead and
puts the same grant in both legs' ``kv_transfer_params`` under
:data:`GRANT_KEY`. It names a ``stream_id`` the proxy draws (vLLM appends
each engine's own random suffix to request ids, so the legs cannot name the
request by its id), the prefill engine, the decode engine and an expiry;
each engine checks it against its own engine id and the peer's before
anything moves.

Wire form: ``v1.<stream_id: 32 hex>.<expiry: Unix seconds>.<HMAC-SHA256: 64 hex>``,
the MAC over the msgpack list (label, stream id, prefill engine id, decode
engine id, expiry). Checks, in this order: form, expiry (with
:data:`p2pkv.params.CLOCK_SKEW_S`), MAC (constant time).

A proxy that does not know the decode engine's id signs for
:data:`ANY_DECODE`: the prefill rank then streams into whichever decode
engine presents the grant first, and into no other (one destination per
``stream_id``); the side channel's secret still keeps everyone else out.

The decode leg's ``kv_transfer_params`` for a stream
(:func:`parse_stream_leg`): ``do_remote_prefill``, ``remote_engine_id``,
``remote_host``, ``remote_port``, ``tp_size`` and the grant; no
``remote_block_ids`` or ``remote_request_id`` (the prefill engine has not
answered yet).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec

from p2pkv.params import CLOCK_SKEW_S, KVTransferParamsError, RemotePrefill, parse_prefill_address, shown

GRANT_KEY = "p2pkv_stream_grant"
"""The ``kv_transfer_params`` key of a stream grant."""

ANY_DECODE = "*"
"""The decode engine id of a grant for whichever decode engine presents it first."""

GRANT_FORM = re.compile(r"v1\.([0-9a-f]{32})\.([0-9]{1,12})\.([0-9a-f]{64})")
STREAM_ID_FORM = re.compile(r"[0-9a-f]{32}")
"""A grant's wire form: version, stream id, expiry, MAC."""

_LABEL = "p2pkv stream grant v1"


class StreamGrantError(KVTransferParamsError):
    """A stream grant that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class StreamGrant:
    """A checked grant.

    Attributes:
        stream_id: 32 hex digits the proxy drew; both engines key the stream by it.
        expiry: when the grant ends (seconds since the Unix epoch).
    """

    stream_id: str
    expiry: int


def grant_mac(stream_id: str, prefill_engine_id: str, decode_engine_id: str, expiry: int, secret: bytes) -> str:
    """HMAC-SHA256 (hex) over a grant's fields, as the msgpack encoding of one list (no ambiguity between fields)."""
    message = msgspec.msgpack.encode([_LABEL, stream_id, prefill_engine_id, decode_engine_id, expiry])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def make_stream_grant(prefill_engine_id: str, decode_engine_id: str, secret: bytes, expiry: float,
                      stream_id: str | None = None) -> str:
    """A grant's wire form for streaming from ``prefill_engine_id`` into ``decode_engine_id`` until ``expiry``.

    Args:
        prefill_engine_id: the prefill engine's ``engine_id``.
        decode_engine_id: the decode engine's ``engine_id``.
        secret: the side channel's secret (every engine and the proxy share it).
        expiry: when the grant ends (seconds since the Unix epoch; rounded up to a whole second).
        stream_id: 32 hex digits (None: 128 random bits).

    Raises:
        ValueError: an empty secret or engine id, or a ``stream_id`` not of 32 hex digits.
    """
    stream_id = secrets.token_hex(16) if stream_id is None else stream_id
    if not secret or not prefill_engine_id or not decode_engine_id:
        raise ValueError("a stream grant needs the secret and both engine ids")
    if not is_stream_id(stream_id):
        raise ValueError(f"stream_id must be 32 hex digits, got {stream_id!r}")
    deadline = math.ceil(expiry)
    return f"v1.{stream_id}.{deadline}.{grant_mac(stream_id, prefill_engine_id, decode_engine_id, deadline, secret)}"


def check_stream_grant(grant: Any, secret: bytes, *, prefill_engine_id: str, decode_engine_id: str,
                       now: float) -> StreamGrant:
    """Check a grant for a stream from ``prefill_engine_id`` into ``decode_engine_id`` (or, signed so, into
    :data:`ANY_DECODE`) at time ``now``.

    Raises:
        StreamGrantError: missing or malformed (checked before anything else is read), expired more than
            :data:`p2pkv.params.CLOCK_SKEW_S` ago, or its MAC does not cover these two engines (made for
            others, altered, or made with another secret).
    """
    key = f"kv_transfer_params.{GRANT_KEY}"
    stream_id, expiry, mac = _read(grant, now)
    if not any(hmac.compare_digest(mac, grant_mac(stream_id, prefill_engine_id, decode, expiry, secret))
               for decode in (decode_engine_id, ANY_DECODE)):
        raise StreamGrantError(f"{key} does not cover a stream from prefill engine {prefill_engine_id!r} into "
                               f"decode engine {decode_engine_id!r}: made for other engines, altered, or signed "
                               "with another secret (every engine and the proxy must share one secret)")
    return StreamGrant(stream_id, expiry)


def _read(grant: Any, now: float) -> tuple[str, int, str]:
    """``(stream_id, expiry, mac)`` of a grant's wire form. Raises StreamGrantError (form, expiry)."""
    key = f"kv_transfer_params.{GRANT_KEY}"
    match = GRANT_FORM.fullmatch(grant) if isinstance(grant, str) else None
    if match is None:
        raise StreamGrantError(f"{key}={shown(grant)} is malformed: expected v1.<stream id: 32 hex digits>."
                               "<expiry>.<64 hex digits>, as the proxy signs it")
    stream_id, expiry_text, mac = match.groups()
    expiry = int(expiry_text)
    if now > expiry + CLOCK_SKEW_S:
        raise StreamGrantError(f"{key} expired {now - expiry:.0f} s ago: send the request through the proxy again")
    return stream_id, expiry, mac


def is_stream_id(text: str) -> bool:
    """True when ``text`` has a stream id's form (32 lowercase hex digits, as :func:`make_stream_grant` draws)."""
    return STREAM_ID_FORM.fullmatch(text) is not None


def wants_stream(params: dict[str, Any] | None) -> bool:
    """True when a leg's ``kv_transfer_params`` carry a stream grant (a router that sends none gets push)."""
    return isinstance(params, dict) and params.get(GRANT_KEY) is not None


def parse_stream_leg(params: dict[str, Any], secret: bytes | None, *, decode_engine_id: str,
                     now: float) -> tuple[RemotePrefill, str]:
    """The decode leg's params of a stream: where the prefill engine is, and the grant (checked).

    The returned :class:`~p2pkv.params.RemotePrefill` names the stream by its
    ``stream_id`` as ``request_id``, has no block ids (the prefill rank
    WRITEs into this engine's blocks) and ``transfer_mode`` ``"stream"``.

    Raises:
        StreamGrantError: no secret (a grant cannot be checked without one), or the grant's own refusals
            (:func:`check_stream_grant`).
        KVTransferParamsError: a missing or bad ``remote_engine_id``, ``remote_host``, ``remote_port`` or
            ``tp_size`` (:func:`p2pkv.params.parse_prefill_address`; the message names it).
    """
    if not secret:
        raise StreamGrantError(f"kv_transfer_params.{GRANT_KEY}: this engine runs without a side-channel secret, so "
                               "it cannot check a stream grant; stream only between engines that share a secret")
    engine_id, host, port, tp_size = parse_prefill_address(params)
    grant = check_stream_grant(params.get(GRANT_KEY), secret, prefill_engine_id=engine_id,
                               decode_engine_id=decode_engine_id, now=now)
    remote = RemotePrefill(engine_id=engine_id, request_id=grant.stream_id, host=host, port=port, block_ids=(),
                           tp_size=tp_size, transfer_mode="stream")
    return remote, params[GRANT_KEY]
