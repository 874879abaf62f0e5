"""``kv_transfer_params`` encode/decode, wire-compatible with vLLM's NixlConnector.

The proxy sends ``{"do_remote_decode": true}`` to a prefill engine; the
prefill engine answers with the params a decode engine needs to pull the
request's KV (:func:`make_prefill_response_params`); the proxy passes those on
to the decode engine, which parses them with :func:`parse_remote_prefill`.
The key names and meanings are those of vLLM's NixlConnector, so existing
proxies and routers work unchanged.

The params are a capability: with the side-channel secret, the prefill
engine adds one field, ``p2pkv_capability`` — an expiry and an HMAC-SHA256
over everything a pull uses (engine id, side-channel host and port, rank
count, request id, block ids, token count, expiry) — and the decode engine
checks it (:func:`parse_remote_prefill`) before it contacts anyone. Whoever
reaches the decode engine's HTTP API can send any params, but without the
secret cannot make params that point the decode engine at another host,
name another request's blocks, or outlive their expiry. Routers that pass
the params through unchanged keep working.

Forged params are refused cheaply, in a fixed order: the capability's form
and expiry (past and future: at most ``max_lifetime_s`` ahead), every count,
the MAC over the lists as they came, then each id (:func:`parse_remote_prefill`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from p2pkv.lifetime import CLOCK_SKEW_S, DEFAULT_MAX_LIFETIME_S, lifetime_refusal
from p2pkv.prompt_digest import DIGEST_FORM, DIGEST_KEY


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` are malformed; the message names the key."""


SENDER = "P2pKvConnector"
"""``kv_transfer_params.kv_connector`` of a p2pkv prefill engine's answer: who holds the blocks (the proxy frees
a p2pkv hold over p2pkv's side channel, and leaves NixlConnector's to its lease)."""
MAX_TP_SIZE = 512
"""Largest ``tp_size`` accepted from a request (a sane bound: no engine has more ranks)."""
MAX_PP_SIZE = 64
"""Largest ``pp_size`` (pipeline stages) accepted from a request (vLLM splits a model's layers over at most that
many stages in any deployment seen; every stage is one more rank the decode side contacts)."""
MAX_ID_CHARS = 256
"""Longest ``remote_engine_id`` / ``remote_request_id`` accepted (characters)."""
ID_PATTERN = re.compile(rf"[A-Za-z0-9._:@+=/-]{{1,{MAX_ID_CHARS}}}")
"""What an engine id or request id may be (the whole id): ASCII letters, digits and ``._:@+=/-``."""
HOST_PATTERN = re.compile(r"[A-Za-z0-9._:\[\]-]{1,253}")
"""What ``remote_host`` may be: a DNS name or an IPv4/IPv6 literal (IPv6 optionally in brackets)."""
MAX_BLOCK_ID = (1 << 31) - 1
"""Largest block id accepted (an engine's blocks fit in 31 bits; the peer's own ``num_blocks`` bounds them
further once it is known)."""
CAPABILITY_KEY = "p2pkv_capability"
"""The ``kv_transfer_params`` key holding the capability: ``v1.<expiry, Unix seconds>.<HMAC-SHA256 hex>``."""
MAX_BLOCK_IDS = 1 << 20
"""Most ``remote_block_ids`` accepted, all KV cache groups together (a million blocks: far beyond any prompt)."""
MAX_APPENDED_TOKENS = 1024
"""Most ``appended_tokens`` accepted (the proxy appends one: the prefill engine's sampled first token)."""
MAX_KV_CACHE_GROUPS = 64
"""Most KV cache groups accepted in ``remote_block_ids`` (vLLM makes a handful)."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode engine pulls one request's prompt KV from.

    Attributes:
        engine_id: the prefill engine's engine_id.
        request_id: the request id on the prefill engine (sent back in the
            completion notification so it frees the right blocks).
        host: the prefill engine's side-channel host.
        port: the prefill engine's side-channel base port.
        block_ids: the prefill engine's block ids holding the prompt, in
            token order; with several KV cache groups (vLLM's hybrid KV cache
            manager, HMA) the groups' lists one after another, group 0 first
            (a sliding-window group's blocks behind the window are vLLM's
            null block, id 0).
        tp_size: the prefill engine's tensor-parallel size.
        pp_size: the prefill engine's pipeline-parallel size (``pp_size``): its workers are ranks
            ``0 .. tp_size * pp_size - 1``, stage ``s`` holding its layers on ranks ``s * tp_size ..``.
        num_tokens: prompt tokens whose KV the prefill engine computed
            (0 when the sender did not say).
        group_sizes: block ids per KV cache group, in group order; empty for
            one group (then all of ``block_ids`` is group 0).
        appended_tokens: tokens the proxy appended to the prompt after the
            prefill engine answered (its sampled first token, already sent to
            the client): the decode request's prompt is the prefill prompt
            plus these, and the decode engine computes them itself (tokens;
            0 when nothing was appended).
        prompt_digest: :func:`p2pkv.prompt_digest.prompt_digest` of the ``num_tokens`` prompt token ids
            the prefill engine computed (``remote_prompt_digest``; "" when the
            sender gave none): the decode engine loads only into a prompt that
            starts with exactly those tokens.
        transfer_mode: ``kv_transfer_params.p2pkv_transfer_mode`` — ``"pull"``
            or ``"push"`` for this request (A/B comparisons, tests), or ``""``:
            the decode engine's ``transfer_mode`` decides. Not covered by the
            capability: both directions move only the named hold's blocks.
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int
    num_tokens: int = 0
    group_sizes: tuple[int, ...] = ()
    appended_tokens: int = 0
    transfer_mode: str = ""
    prompt_digest: str = ""
    pp_size: int = 1

    @property
    def num_ranks(self) -> int:
        """The prefill engine's workers (``tp_size * pp_size``), each with its side channel at ``port + rank``."""
        return self.tp_size * self.pp_size

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """``block_ids`` split into one tuple per KV cache group."""
        return split_groups(self.block_ids, self.group_sizes)


def split_groups(block_ids: Sequence[int], group_sizes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Flat block ids → one tuple per KV cache group (``group_sizes`` empty: one group)."""
    if not group_sizes:
        return (tuple(block_ids),)
    out, start = [], 0
    for n in group_sizes:
        out.append(tuple(block_ids[start:start + n]))
        start += n
    return tuple(out)


def _require(params: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in params or params[key] is None:
        raise KVTransferParamsError(
            f"kv_transfer_params.{key} is missing; a decode request needs the params "
            "the prefill engine returned (pass them through unchanged)"
        )
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise KVTransferParamsError(
            f"kv_transfer_params.{key} has type {type(value).__name__}, expected "
            f"{getattr(kind, '__name__', kind)}"
        )
    return value


def _text(params: dict[str, Any], key: str, pattern: re.Pattern[str] = ID_PATTERN) -> str:
    value = _require(params, key, str)
    if not pattern.fullmatch(value):
        head = value[:SHOWN_CHARS].encode("ascii", "backslashreplace").decode()
        raise KVTransferParamsError(f"kv_transfer_params.{key}={head!r}{'...' if len(value) > SHOWN_CHARS else ''} "
                                    f"({len(value)} characters) must match {pattern.pattern}")
    return value


def _digest(params: dict[str, Any]) -> str:
    value = params.get(DIGEST_KEY)
    if value is None:
        return ""
    if not isinstance(value, str) or not DIGEST_FORM.fullmatch(value):
        raise KVTransferParamsError(f"kv_transfer_params.{DIGEST_KEY}={shown(value)} must be 32 lowercase hex "
                                    "digits (the prefill engine's digest of the prompt it computed)")
    return value


MAC_FORM = re.compile(r"[0-9]{1,12}\.[0-9a-f]{64}")
"""``<expiry>.<MAC>`` of a capability: decimal seconds since the epoch, HMAC-SHA256 in lowercase hex."""

SHOWN_CHARS = 64
"""Characters of a refused value an error message (and so a log line) shows at most."""


def shown(value: Any) -> str:
    """``repr(value)`` cut to :data:`SHOWN_CHARS` characters, for error messages and logs: whoever sends the params
    chooses every byte, so a refused value is never written whole (an int of millions of digits is described by
    its size: its ``repr`` alone would cost seconds, or raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, list | tuple | dict | str | bytes) and len(value) > SHOWN_CHARS:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _optional_int(params: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KVTransferParamsError(f"kv_transfer_params.{key}={shown(value)} must be an int in {lo}..{hi}")
    return value


def check_kv_groups(groups: int, kv_groups: int) -> None:
    """Raises KVTransferParamsError (naming ``remote_block_ids`` and the fix) when ``groups`` != ``kv_groups``."""
    if groups != kv_groups:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_block_ids has {groups} KV cache group(s), this "
            f"engine has {kv_groups}: run prefill and decode with the same model and the same "
            "hybrid KV cache manager setting (--disable-hybrid-kv-cache-manager on both or neither)")


def _block_groups(raw: Any, max_blocks: int, kv_groups: int | None) -> tuple[Sequence[Any], bool]:
    """``(groups, nested)``: ``remote_block_ids`` as one list per KV cache group (a flat list is one group, as in
    :meth:`RemotePrefill.groups`), counted in O(groups), no id looked at: at most :data:`MAX_KV_CACHE_GROUPS`
    groups (exactly ``kv_groups`` when given), each a list of at most ``max_blocks``, :data:`MAX_BLOCK_IDS` in
    all. ``nested``: sent as NixlConnector's ``[[ids...], ...]``. Raises KVTransferParamsError naming the key."""
    if not isinstance(raw, list | tuple):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a list")
    nested = bool(raw) and isinstance(raw[0], list | tuple)
    if nested and len(raw) > MAX_KV_CACHE_GROUPS:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has {len(raw)} KV cache groups, more "
                                    f"than {MAX_KV_CACHE_GROUPS}")
    groups = raw if nested else (raw,)
    if kv_groups is not None:
        check_kv_groups(len(groups), kv_groups)
    for i, group in enumerate(groups):
        if not isinstance(group, list | tuple) or len(group) > max_blocks:
            count = f" (got {len(group)})" if isinstance(group, list | tuple) else ""
            raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids{f'[{i}]' if nested else ''} must be "
                                        f"a list of at most {max_blocks} block ids{count}: no longer prompt fits "
                                        "this engine")
    if sum(map(len, groups)) > MAX_BLOCK_IDS:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has more than {MAX_BLOCK_IDS} entries")
    return groups, nested


def _check_ids(group: Sequence[Any], key: str) -> tuple[int, ...]:
    """One group's entries as block ids: each an int (no bool) in ``0..MAX_BLOCK_ID``. Raises KVTransferParamsError."""
    if set(map(type, group)) <= {int} and (not group or (min(group) >= 0 and max(group) <= MAX_BLOCK_ID)):
        return tuple(group)  # the common case, ~3x faster than the loop
    for b in group:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
            raise KVTransferParamsError(f"kv_transfer_params.{key} holds {shown(b)}; block ids are ints in "
                                        f"0..{MAX_BLOCK_ID}")
    return tuple(group)


def _block_ids(groups: Sequence[Any], nested: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(block_ids, group_sizes)`` of counted groups (:func:`_block_groups`), every id checked."""
    if not nested:
        return _check_ids(groups[0], "remote_block_ids"), ()
    checked = [_check_ids(g, f"remote_block_ids[{i}]") for i, g in enumerate(groups)]
    flat = tuple(itertools.chain.from_iterable(checked))
    return flat, (tuple(len(g) for g in checked) if len(checked) > 1 else ())


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """True when a decode engine should pull this request's KV from a prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True when a prefill engine should hold this request's KV for a decode engine."""
    return bool(params) and bool(params.get("do_remote_decode"))


def parse_remote_prefill(params: dict[str, Any], *, secret: bytes | None, now: float | None = None,
                         max_blocks: int = MAX_BLOCK_IDS, kv_groups: int | None = None,
                         max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S) -> RemotePrefill:
    """Parse and validate the params a decode engine received, and with ``secret`` check their capability.

    Checks, in this order (forged params cost O(1) or one MAC, never a look at every id):
    1. (with ``secret``) the capability's form and expiry: missing, malformed, expired more than
    :data:`CLOCK_SKEW_S` ago, or expiring more than ``max_lifetime_s`` + :data:`CLOCK_SKEW_S` after ``now``;
    2. the counts of ``remote_block_ids``, no id looked at: KV cache groups (at most :data:`MAX_KV_CACHE_GROUPS`,
    exactly ``kv_groups`` when given), ids per group (at most ``max_blocks``), ids in all (:data:`MAX_BLOCK_IDS`);
    3. the other keys (ids, host, port, ``tp_size``, ``pp_size``, token counts, transfer mode, prompt digest; each
    O(1));
    4. (with ``secret``) the MAC over the lists as they came: one msgpack encoding, byte for byte what
    :func:`capability_mac` signs for valid params (an encoding longer than valid ids' is refused before the HMAC);
    5. each block id's type and range (an int in ``0..MAX_BLOCK_ID``); only now is a tuple of ids built.

    Args:
        params: the request's ``kv_transfer_params``.
        secret: the side-channel secret: the params must carry a valid, unexpired ``p2pkv_capability`` made with
            it; None (an insecure deployment) accepts params without one (steps 1 and 4 skipped).
        now: the time (seconds since the Unix epoch; default: now).
        max_blocks: most block ids per KV cache group a request may name: the decode engine's ``max_model_len``
            in its blocks (and never more than :data:`MAX_BLOCK_IDS`).
        kv_groups: the decode engine's KV cache groups (None: not checked; :meth:`p2pkv.scheduling.load.DecodeLoad.of`
            checks them).
        max_lifetime_s: how far past ``now`` the capability's expiry may lie (seconds; engines pass
            :attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`).

    Raises:
        KVTransferParamsError: a key is missing, has a wrong type or is out of range (the message names it and
            the accepted range), another number of KV cache groups than ``kv_groups``, or (with ``secret``) the
            capability is missing, altered, expired or too far ahead (named ``kv_transfer_params.p2pkv_capability``).
    """
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    now = time.time() if now is None else now
    expiry = _capability_expiry(params.get(CAPABILITY_KEY), now, max_lifetime_s) if secret else 0
    groups, nested = _block_groups(_require(params, "remote_block_ids", (list, tuple)),
                                   min(max_blocks, MAX_BLOCK_IDS), kv_groups)
    port, tp_size, pp_size = _port_and_ranks(params)
    engine_id, request_id = _text(params, "remote_engine_id"), _text(params, "remote_request_id")
    host = _text(params, "remote_host", HOST_PATTERN)
    num_tokens = _optional_int(params, "remote_num_tokens", 0, 0, MAX_BLOCK_IDS * 1024)
    appended_tokens = _optional_int(params, "appended_tokens", 0, 0, MAX_APPENDED_TOKENS)
    transfer_mode, digest = _transfer_mode(params), _digest(params)
    if secret:
        fields = [engine_id, request_id, host, port, tp_size, pp_size, groups, num_tokens, appended_tokens, digest,
                  expiry]
        if not hmac.compare_digest(params[CAPABILITY_KEY].rpartition(".")[2], _fields_mac(fields, secret)):
            raise _mac_mismatch()
    block_ids, group_sizes = _block_ids(groups, nested)
    return RemotePrefill(engine_id=engine_id, request_id=request_id, host=host, port=port, block_ids=block_ids,
                         tp_size=tp_size, num_tokens=num_tokens, group_sizes=group_sizes,
                         appended_tokens=appended_tokens, transfer_mode=transfer_mode, prompt_digest=digest,
                         pp_size=pp_size)


def _port_and_ranks(params: dict[str, Any]) -> tuple[int, int, int]:
    """``(remote_port, tp_size, pp_size)``, checked (every rank's port, ``port + rank`` for ranks
    ``0 .. tp_size * pp_size - 1``, a TCP port). Raises KVTransferParamsError."""
    port = _require(params, "remote_port", int)
    tp_size = _optional_int(params, "tp_size", 1, 1, MAX_TP_SIZE)
    pp_size = _optional_int(params, "pp_size", 1, 1, MAX_PP_SIZE)
    if not 0 < port < 65536 or port + tp_size * pp_size > 65536:
        raise KVTransferParamsError(f"kv_transfer_params.remote_port={port} is not a TCP port (with tp_size "
                                    f"{tp_size} and pp_size {pp_size}: base port + rank must be below 65536)")
    return port, tp_size, pp_size


def parse_prefill_address(params: dict[str, Any]) -> tuple[str, str, int, int, int]:
    """``(remote_engine_id, remote_host, remote_port, tp_size, pp_size)`` of a decode leg's params, checked as
    :func:`parse_remote_prefill` checks them (a stream's decode leg names no request or blocks).

    Raises:
        KVTransferParamsError: a missing or bad key (the message names it).
    """
    port, tp_size, pp_size = _port_and_ranks(params)
    return _text(params, "remote_engine_id"), _text(params, "remote_host", HOST_PATTERN), port, tp_size, pp_size


TRANSFER_MODE_KEY = "p2pkv_transfer_mode"
"""The ``kv_transfer_params`` key naming one request's direction (``pull`` / ``push`` / ``auto``)."""


def _transfer_mode(params: dict[str, Any]) -> str:
    """``p2pkv_transfer_mode`` if present (``"auto"`` reads as absent: ``""``)."""
    value = params.get(TRANSFER_MODE_KEY)
    if value is None or value == "auto":
        return ""
    if value not in ("pull", "push", "stream"):
        raise KVTransferParamsError(f"kv_transfer_params.{TRANSFER_MODE_KEY}={shown(value)}: expected "
                                    "\"pull\", \"push\", \"stream\" or \"auto\" (or leave it out: the decode "
                                    "engine's transfer_mode decides)")
    return "push" if value == "stream" else value  # params a prefill engine answered: its KV is whole, push it


MAC_LABEL = "p2pkv kv_transfer_params v3"
"""The first item of the list a capability's MAC covers (:func:`capability_mac`)."""

_MAX_ID_BYTES = 5
"""The most bytes msgpack encodes a valid block id (an int in ``0..MAX_BLOCK_ID``) or an array header in."""


def capability_mac(remote: RemotePrefill, expiry: int, secret: bytes) -> str:
    """HMAC-SHA256 (hex) of everything a pull of ``remote`` uses, and ``expiry`` (Unix seconds).

    The message is the msgpack encoding of a list (a label, engine id,
    request id, host, port, tp_size, pp_size, block ids per KV cache group, token
    count, appended tokens, prompt digest, expiry): one byte string per
    value, with no room for ambiguity. Everything that decides what the KV
    means is in it; the flags proxies and routers rewrite
    (``do_remote_decode``, ``do_remote_prefill``), the transfer mode and the
    trace context are not. :func:`parse_remote_prefill` computes the same
    bytes from the params' lists as they came.
    """
    fields = [MAC_LABEL, remote.engine_id, remote.request_id, remote.host, remote.port,
              remote.tp_size, remote.pp_size, [list(g) for g in remote.groups()], remote.num_tokens,
              remote.appended_tokens,
              remote.prompt_digest, expiry]
    return hmac.new(secret, msgspec.msgpack.encode(fields), hashlib.sha256).hexdigest()


def _fields_mac(fields: list[Any], secret: bytes) -> str:
    """HMAC-SHA256 (hex) of ``[MAC_LABEL, *fields]`` as :func:`capability_mac` encodes it, ``fields[6]`` the block
    id lists as they came (counted, not looked into): one msgpack encoding and one HMAC, no Python loop over ids.

    Raises:
        KVTransferParamsError: the lists hold what msgpack cannot encode (an int beyond 64 bits, an object), or
            encode longer than valid block ids could (floats, strings: nobody signed those), before the HMAC.
    """
    groups = fields[6]
    message_fields = [MAC_LABEL, *fields]
    try:
        message = msgspec.msgpack.encode(message_fields)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids holds a value that is no block id "
                                    f"({type(exc).__name__}); block ids are ints in 0..{MAX_BLOCK_ID}") from None
    message_fields[7] = []
    longest = (len(msgspec.msgpack.encode(message_fields)) + _MAX_ID_BYTES
               + sum(_MAX_ID_BYTES * (1 + len(g)) for g in groups))
    if len(message) > longest:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids holds values that are no block ids "
                                    f"(they encode in more than {_MAX_ID_BYTES} bytes each); block ids are ints in "
                                    f"0..{MAX_BLOCK_ID}")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def check_capability(remote: RemotePrefill, capability: Any, secret: bytes, now: float, *,
                     max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S) -> None:
    """Check ``capability`` (``kv_transfer_params.p2pkv_capability``) of the params ``remote`` was parsed from, with
    ``secret`` at ``now`` (seconds since the Unix epoch): its form, then its expiry (past and future: at most
    ``max_lifetime_s`` seconds ahead), then its MAC (:func:`capability_mac` over ``remote``).

    Raises:
        KVTransferParamsError: missing or malformed, expired more than :data:`CLOCK_SKEW_S` ago, expiring more
            than ``max_lifetime_s`` + :data:`CLOCK_SKEW_S` after ``now``, or a MAC that does not cover these
            params (altered, or made with another secret).
    """
    _check_mac(remote, capability, _capability_expiry(capability, now, max_lifetime_s), secret)


def _capability_expiry(capability: Any, now: float, max_lifetime_s: float) -> int:
    """The expiry (seconds since the epoch) a capability names, checked for form and time only (O(1)).

    Raises:
        KVTransferParamsError: missing, malformed, expired more than :data:`CLOCK_SKEW_S` ago, or expiring more
            than ``max_lifetime_s`` + :data:`CLOCK_SKEW_S` after ``now``.
    """
    key = f"kv_transfer_params.{CAPABILITY_KEY}"
    if not isinstance(capability, str) or not capability:
        raise KVTransferParamsError(
            f"{key} is missing: this engine accepts only params signed by a p2pkv prefill engine with the same "
            "secret (pass the prefill engine's kv_transfer_params through unchanged)")
    version, _, rest = capability.partition(".")
    expiry_text, _, mac = rest.partition(".")
    if version != "v1" or not MAC_FORM.fullmatch(f"{expiry_text}.{mac}"):
        raise KVTransferParamsError(f"{key} is malformed: expected v1.<expiry>.<64 hex digits>")
    expiry = int(expiry_text)
    if now > expiry + CLOCK_SKEW_S:
        raise KVTransferParamsError(
            f"{key} expired {now - expiry:.0f} s ago: the prefill engine's hold has ended (its lease_s); "
            "send the request through the proxy again")
    why = lifetime_refusal(key, expiry, now, max_lifetime_s, "the prefill engine's clock runs ahead of this "
                           "engine's (synchronise them, e.g. with NTP), or it signs for longer than this engine's "
                           "lease_s allows (give both engines the same lease_s)")
    if why:
        raise KVTransferParamsError(why)
    return expiry


def _mac_mismatch() -> KVTransferParamsError:
    return KVTransferParamsError(
        f"kv_transfer_params.{CAPABILITY_KEY} does not match the params: they were altered after the prefill "
        "engine signed them, or signed with another secret (every engine and the proxy must share one secret)")


def _check_mac(remote: RemotePrefill, capability: str, expiry: int, secret: bytes) -> None:
    """Raises KVTransferParamsError when the capability's MAC does not cover ``remote`` and ``expiry``."""
    if not hmac.compare_digest(capability.rpartition(".")[2], capability_mac(remote, expiry, secret)):
        raise _mac_mismatch()


def sign_params(params: dict[str, Any], secret: bytes, expiry: float) -> dict[str, Any]:
    """Add ``p2pkv_capability`` to a prefill engine's answer ``params`` (in place; returned).

    Args:
        params: what :func:`make_prefill_response_params` returned.
        secret: the side-channel secret.
        expiry: when the capability ends (seconds since the Unix epoch;
            rounded up to a whole second).
    """
    params[CAPABILITY_KEY] = _capability(parse_remote_prefill(params, secret=None), expiry, secret)
    return params


def _capability(remote: RemotePrefill, expiry: float, secret: bytes) -> str:
    """``v1.<expiry>.<MAC>`` for ``remote``, the expiry rounded up to a whole second."""
    deadline = math.ceil(expiry)
    return f"v1.{deadline}.{capability_mac(remote, deadline, secret)}"


def with_appended_tokens(params: dict[str, Any], appended: int, secret: bytes | None,
                         now: float | None = None, *,
                         max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S) -> dict[str, Any]:
    """A copy of a prefill engine's ``params`` saying the proxy appended ``appended`` tokens to the prompt, and,
    with ``secret``, signed again (``appended_tokens`` is covered by the capability) with the same expiry.

    Only params whose capability checks (:func:`parse_remote_prefill`, in its order: expiry past and future,
    counts, MAC, ids) are signed again (the proxy is no signing oracle); others get the count unsigned, which
    the decode engine refuses (it prefills the prompt itself).

    Args:
        params: a prefill engine's answer.
        appended: tokens appended to the prompt (tokens).
        secret: the side-channel secret (None: nothing to sign).
        now: the time (seconds since the Unix epoch; default: now).
        max_lifetime_s: how far past ``now`` the capability's expiry may lie (seconds).

    Raises:
        ValueError: ``appended`` outside ``0..MAX_APPENDED_TOKENS``.
    """
    if not 0 <= appended <= MAX_APPENDED_TOKENS:
        raise ValueError(f"appended must be in 0..{MAX_APPENDED_TOKENS} tokens, got {appended}")
    out = {**params, "appended_tokens": appended}
    if not secret:
        return out
    try:
        parse_remote_prefill(params, secret=secret, now=now, max_lifetime_s=max_lifetime_s)
    except KVTransferParamsError:
        return out
    expiry = int(str(params[CAPABILITY_KEY]).split(".")[1])
    out[CAPABILITY_KEY] = f"v1.{expiry}.{capability_mac(parse_remote_prefill(out, secret=None), expiry, secret)}"
    return out


def make_prefill_response_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[int],
    tp_size: int,
    num_tokens: int,
    expiry_time: float | None,
    pp_size: int = 1,
    group_sizes: Sequence[int] = (),
    first_token: bool = True,
    prompt_digest: str = "",
    secret: bytes | None = None,
) -> dict[str, Any]:
    """The params a prefill engine returns with a finished request (NixlConnector keys, plus p2pkv's).

    ``block_ids`` and ``group_sizes`` as in :class:`RemotePrefill`;
    ``remote_block_ids`` is a list per KV cache group, as NixlConnector sends it.
    ``first_token`` (sent as ``first_token``): the token the prefill engine
    sampled is the request's first output token, so a proxy may send it to
    the client at once and append it to the decode request's prompt (see
    ``appended_tokens``); False when the engine computed only part of the
    prompt (an attention-window model, see ``recompute_tokens``).
    ``prompt_digest``: :func:`p2pkv.prompt_digest.prompt_digest` of the ``num_tokens`` prompt token
    ids computed (sent as ``remote_prompt_digest`` when given).
    ``secret``: sign them (``p2pkv_capability``, expiring at ``expiry_time``),
    as :func:`sign_params` would, from these arguments rather than by parsing
    the params back (the prefill scheduler's hot path).

    Raises:
        ValueError: ``secret`` without ``expiry_time``.
    """
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(g) for g in split_groups(block_ids, group_sizes)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": pp_size,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry_time,
        "transfer_mode": "pull",
        "kv_connector": SENDER,
        "first_token": first_token,
        **({DIGEST_KEY: prompt_digest} if prompt_digest else {}),
    }
    if secret:
        if expiry_time is None:
            raise ValueError("a signed answer needs expiry_time")
        remote = RemotePrefill(engine_id, request_id, host, port, tuple(block_ids), tp_size, num_tokens,
                               tuple(group_sizes) if len(group_sizes) > 1 else (), prompt_digest=prompt_digest,
                               pp_size=pp_size)
        params[CAPABILITY_KEY] = _capability(remote, expiry_time, secret)
    return params
