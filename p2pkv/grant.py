"""The stream grant: the proxy's signed word that a prefill engine may stream one request's KV into a decode engine.

Layer-streamed transfer (docs/streaming.md) starts before the prefill
engine has answered, so no prefill-signed ``p2pkv_capability`` exists yet.
The proxy, which holds the side channel's secret, signs a grant instead and
puts the same grant in both legs' ``kv_transfer_params`` under
:data:`GRANT_KEY`. It names a ``stream_id`` the proxy draws (vLLM appends
each engine's own random suffix to request ids, so the legs cannot name the
request by its id), the prefill engine and its pipeline stages
(``pp_size``, which decides which of its workers WRITE which layers), the
decode engine and an expiry; each engine checks it against its own engine
id, its own stages (a prefill engine) or the leg's (a decode engine), and
the peer's before anything moves.

Wire form: ``v2.<stream_id: 32 hex>.<expiry: Unix seconds>.<HMAC-SHA256: 64 hex>``,
the MAC over the msgpack list (label, stream id, prefill engine id, decode
engine id, expiry, pp_size). Checks, in this order: form, expiry (with
:data:`p2pkv.params.CLOCK_SKEW_S`), MAC (constant time). A ``v1`` grant (an
older proxy's, whose MAC named no stages) is refused naming the fix.

A proxy that does not know the decode engine's id signs for
:data:`ANY_DECODE`: the prefill rank then streams into whichever decode
engine presents the grant first, and into no other (one destination per
``stream_id``); the side channel's secret still keeps everyone else out.

The decode leg's ``kv_transfer_params`` for a stream
(:func:`parse_stream_leg`): ``do_remote_prefill``, ``remote_engine_id``,
``remote_host``, ``remote_port``, ``tp_size``, ``pp_size`` and the grant; no
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

from p2pkv.lifetime import CLOCK_SKEW_S, DEFAULT_MAX_LIFETIME_S, lifetime_refusal
from p2pkv.params import KVTransferParamsError, RemotePrefill, parse_prefill_address, shown

GRANT_KEY = "p2pkv_stream_grant"
"""The ``kv_transfer_params`` key of a stream grant."""

STREAMED_KEY = "p2pkv_streamed"
"""The ``kv_transfer_params`` key of a prefill engine's answer for a request it streamed under its grant (True);
absent when it held the request for a pull or push instead (a grant it refused: a restart, an expiry), which the
proxy then sends its decode leg again for (:mod:`p2pkv.tools.proxy.stream_faults`)."""

ANY_DECODE = "*"
"""The decode engine id of a grant for whichever decode engine presents it first."""

GRANT_LIFETIME_S = 120.0
"""The longest a proxy signs a grant for (seconds): twice the decode engine's default stream window (60 s, the
``transfer_timeout_s`` a stream waits for its prefill), so a grant outlives any stream it starts, and well inside
the receivers' ``max_lifetime_s`` (4 × the default ``lease_s`` of 120 s: 480 s), so a proxy whose clock runs
minutes fast still has its grants accepted. What an engine remembers of a grant (a served or declined stream
id) lasts as long as the grant."""

GRANT_FORM = re.compile(r"v2\.([0-9a-f]{32})\.([0-9]{1,12})\.([0-9a-f]{64})")
STREAM_ID_FORM = re.compile(r"[0-9a-f]{32}")
"""A grant's wire form: version, stream id, expiry, MAC."""

_LABEL = "p2pkv stream grant v2"


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


def grant_mac(stream_id: str, prefill_engine_id: str, decode_engine_id: str, expiry: int, pp_size: int,
              secret: bytes) -> str:
    """HMAC-SHA256 (hex) over a grant's fields, as the msgpack encoding of one list (no ambiguity between fields)."""
    message = msgspec.msgpack.encode([_LABEL, stream_id, prefill_engine_id, decode_engine_id, expiry, pp_size])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def make_stream_grant(prefill_engine_id: str, decode_engine_id: str, secret: bytes, expiry: float,
                      stream_id: str | None = None, *, pp_size: int = 1) -> str:
    """A grant's wire form for streaming from ``prefill_engine_id`` into ``decode_engine_id`` until ``expiry``.

    Args:
        prefill_engine_id: the prefill engine's ``engine_id``.
        decode_engine_id: the decode engine's ``engine_id``.
        secret: the side channel's secret (every engine and the proxy share it).
        expiry: when the grant ends (seconds since the Unix epoch; rounded up to a whole second).
        stream_id: 32 hex digits (None: 128 random bits).
        pp_size: the prefill engine's pipeline stages (its signed ``kv_transfer_params.pp_size``).

    Raises:
        ValueError: an empty secret or engine id, a ``stream_id`` not of 32 hex digits, or ``pp_size`` < 1.
    """
    stream_id = secrets.token_hex(16) if stream_id is None else stream_id
    if not secret or not prefill_engine_id or not decode_engine_id:
        raise ValueError("a stream grant needs the secret and both engine ids")
    if not is_stream_id(stream_id):
        raise ValueError(f"stream_id must be 32 hex digits, got {stream_id!r}")
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    deadline = math.ceil(expiry)
    mac = grant_mac(stream_id, prefill_engine_id, decode_engine_id, deadline, pp_size, secret)
    return f"v2.{stream_id}.{deadline}.{mac}"


def check_stream_grant(grant: Any, secret: bytes, *, prefill_engine_id: str, decode_engine_id: str,
                       now: float, max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S, pp_size: int = 1) -> StreamGrant:
    """Check a grant for a stream from ``prefill_engine_id``, an engine of ``pp_size`` pipeline stages, into
    ``decode_engine_id`` (or, signed so, into :data:`ANY_DECODE`) at time ``now``.

    Checks, in this order: form (before anything else is read), expiry (past, then future), MAC (constant time).

    Args:
        grant: the ``p2pkv_stream_grant`` value.
        secret: the side channel's secret.
        prefill_engine_id: the prefill engine's ``engine_id``.
        decode_engine_id: the decode engine's ``engine_id``.
        now: this engine's clock (seconds since the Unix epoch).
        max_lifetime_s: how far past ``now`` the expiry may lie (seconds; engines pass
            :attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`).
        pp_size: the prefill engine's pipeline stages: its own (a prefill engine), or what the decode leg says
            they are (a decode engine).

    Raises:
        StreamGrantError: missing or malformed (a ``v1`` grant: an older proxy), expired more than
            :data:`p2pkv.params.CLOCK_SKEW_S` ago, expiring more than ``max_lifetime_s`` + that skew after ``now``,
            or its MAC does not cover these two engines and these stages (made for others, altered, made for
            another ``pp_size`` of the prefill engine, or made with another secret).
    """
    key = f"kv_transfer_params.{GRANT_KEY}"
    stream_id, expiry, mac = _read(grant, now, max_lifetime_s)
    if not any(hmac.compare_digest(mac, grant_mac(stream_id, prefill_engine_id, decode, expiry, pp_size, secret))
               for decode in (decode_engine_id, ANY_DECODE)):
        raise StreamGrantError(f"{key} does not cover a stream from prefill engine {prefill_engine_id!r} "
                               f"(pp_size {pp_size}) into decode engine {decode_engine_id!r}: made for other "
                               "engines or another pp_size (the prefill engine restarted with other pipeline "
                               "stages), altered, or signed with another secret (every engine and the proxy must "
                               "share one secret)")
    return StreamGrant(stream_id, expiry)


def _read(grant: Any, now: float, max_lifetime_s: float) -> tuple[str, int, str]:
    """``(stream_id, expiry, mac)`` of a grant's wire form. Raises StreamGrantError (form, expiry past and future)."""
    key = f"kv_transfer_params.{GRANT_KEY}"
    match = GRANT_FORM.fullmatch(grant) if isinstance(grant, str) else None
    if match is None and isinstance(grant, str) and grant.startswith("v1."):
        raise StreamGrantError(f"{key} is a v1 grant, from a proxy older than this engine (its MAC names no "
                               "pipeline stages): upgrade the proxy to this p2pkv version")
    if match is None:
        raise StreamGrantError(f"{key}={shown(grant)} is malformed: expected v2.<stream id: 32 hex digits>."
                               "<expiry>.<64 hex digits>, as the proxy signs it")
    stream_id, expiry_text, mac = match.groups()
    expiry = int(expiry_text)
    if now > expiry + CLOCK_SKEW_S:
        raise StreamGrantError(f"{key} expired {now - expiry:.0f} s ago: send the request through the proxy again")
    why = lifetime_refusal(key, expiry, now, max_lifetime_s, "the proxy's clock runs ahead of this engine's "
                           "(synchronise them, e.g. with NTP), or it signs grants for longer than this engine's "
                           f"lease_s allows (p2pkv's proxy signs for at most {GRANT_LIFETIME_S:.0f} s; raise lease_s)")
    if why:
        raise StreamGrantError(why)
    return stream_id, expiry, mac


def is_stream_id(text: str) -> bool:
    """True when ``text`` has a stream id's form (32 lowercase hex digits, as :func:`make_stream_grant` draws)."""
    return STREAM_ID_FORM.fullmatch(text) is not None


def wants_stream(params: dict[str, Any] | None) -> bool:
    """True when a leg's ``kv_transfer_params`` carry a stream grant (a router that sends none gets push)."""
    return isinstance(params, dict) and params.get(GRANT_KEY) is not None


def parse_stream_leg(params: dict[str, Any], secret: bytes | None, *, decode_engine_id: str,
                     now: float, max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S) -> tuple[RemotePrefill, str]:
    """The decode leg's params of a stream: where the prefill engine is, and the grant (checked).

    The returned :class:`~p2pkv.params.RemotePrefill` names the stream by its
    ``stream_id`` as ``request_id``, has no block ids (the prefill rank
    WRITEs into this engine's blocks) and ``transfer_mode`` ``"stream"``.
    Checks, in this order: a secret, the prefill engine's address, the grant
    (:func:`check_stream_grant` for the leg's ``pp_size``, at ``now``, seconds
    since the Unix epoch, with ``max_lifetime_s``, seconds): a leg that names
    other stages than the proxy signed is refused.

    Raises:
        StreamGrantError: no secret (a grant cannot be checked without one), or the grant's own refusals
            (:func:`check_stream_grant`).
        KVTransferParamsError: a missing or bad ``remote_engine_id``, ``remote_host``, ``remote_port`` or
            ``tp_size`` (:func:`p2pkv.params.parse_prefill_address`; the message names it).
    """
    if not secret:
        raise StreamGrantError(f"kv_transfer_params.{GRANT_KEY}: this engine runs without a side-channel secret, so "
                               "it cannot check a stream grant; stream only between engines that share a secret")
    engine_id, host, port, tp_size, pp_size = parse_prefill_address(params)
    grant = check_stream_grant(params.get(GRANT_KEY), secret, prefill_engine_id=engine_id,
                               decode_engine_id=decode_engine_id, now=now, max_lifetime_s=max_lifetime_s,
                               pp_size=pp_size)
    remote = RemotePrefill(engine_id=engine_id, request_id=grant.stream_id, host=host, port=port, block_ids=(),
                           tp_size=tp_size, transfer_mode="stream", pp_size=pp_size)
    return remote, params[GRANT_KEY]
