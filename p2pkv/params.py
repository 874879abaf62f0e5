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
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` are malformed; the message names the key."""


SENDER = "P2pKvConnector"
"""``kv_transfer_params.kv_connector`` of a p2pkv prefill engine's answer: who holds the blocks (the proxy frees
a p2pkv hold over p2pkv's side channel, and leaves NixlConnector's to its lease)."""
MAX_TP_SIZE = 512
"""Largest ``tp_size`` accepted from a request (a sane bound: no engine has more ranks)."""
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
CLOCK_SKEW_S = 5.0
"""How long (seconds) after its expiry a capability is still accepted: the clocks of the two engines may differ."""
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
        num_tokens: prompt tokens whose KV the prefill engine computed
            (0 when the sender did not say).
        group_sizes: block ids per KV cache group, in group order; empty for
            one group (then all of ``block_ids`` is group 0).
        appended_tokens: tokens the proxy appended to the prompt after the
            prefill engine answered (its sampled first token, already sent to
            the client): the decode request's prompt is the prefill prompt
            plus these, and the decode engine computes them itself (tokens;
            0 when nothing was appended).
        prompt_digest: :func:`prompt_digest` of the ``num_tokens`` prompt token ids
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


DIGEST_KEY = "remote_prompt_digest"
"""``kv_transfer_params`` key of the prefill prompt's :func:`prompt_digest`."""
DIGEST_FORM = re.compile(r"[0-9a-f]{32}")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (first 128 bits, hex) of prompt token ids as little-endian int64s: which tokens a hold's KV is of.

    Raises:
        OverflowError: a token id beyond int64 (no tokenizer makes one).
    """
    try:
        packed = struct.pack(f"<{len(token_ids)}q", *token_ids)  # the fastest packing of a list of ints here
    except struct.error as exc:
        raise OverflowError(f"a prompt token id does not fit an int64: {exc}") from exc
    return hashlib.sha256(packed).hexdigest()[:32]


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


def _block_id_list(raw: Any, key: str, max_blocks: int) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or len(raw) > max_blocks:
        count = f" (got {len(raw)})" if isinstance(raw, list | tuple) else ""
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be a list of at most {max_blocks} block ids"
                                    f"{count}: no longer prompt fits this engine")
    ints = set(map(type, raw)) <= {int}
    if ints and (not raw or (min(raw) >= 0 and max(raw) <= MAX_BLOCK_ID)):  # the common case, ~3x faster than
        return tuple(raw)  # the loop
    for b in raw:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
            raise KVTransferParamsError(f"kv_transfer_params.{key} holds {shown(b)}; block ids are ints in "
                                        f"0..{MAX_BLOCK_ID}")
    return tuple(raw)


def _block_ids(raw: Any, max_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(block_ids, group_sizes)`` from ``[ids...]`` or NixlConnector's per-group ``[[ids...], ...]``; at most
    ``max_blocks`` per KV cache group, counted before any id is looked at."""
    if not isinstance(raw, list | tuple):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a list")
    if not raw or not isinstance(raw[0], list | tuple):
        return _block_id_list(raw, "remote_block_ids", max_blocks), ()
    if len(raw) > MAX_KV_CACHE_GROUPS:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has {len(raw)} KV cache groups, more "
                                    f"than {MAX_KV_CACHE_GROUPS}")
    groups = [_block_id_list(g, f"remote_block_ids[{i}]", max_blocks) for i, g in enumerate(raw)]
    flat = tuple(b for g in groups for b in g)
    if len(flat) > MAX_BLOCK_IDS:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has more than {MAX_BLOCK_IDS} entries")
    return flat, (tuple(len(g) for g in groups) if len(groups) > 1 else ())


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """True when a decode engine should pull this request's KV from a prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True when a prefill engine should hold this request's KV for a decode engine."""
    return bool(params) and bool(params.get("do_remote_decode"))


def parse_remote_prefill(params: dict[str, Any], *, secret: bytes | None, now: float | None = None,
                         max_blocks: int = MAX_BLOCK_IDS) -> RemotePrefill:
    """Parse and validate the params a decode engine received, and with ``secret`` check their capability.

    The cheap refusals come first: with ``secret``, a capability that is missing, malformed or expired is
    refused before any other key is read, and the block id lists are counted against ``max_blocks`` before
    any id is looked at; the MAC, which covers every block id, is computed last.

    Args:
        params: the request's ``kv_transfer_params``.
        secret: the side-channel secret: the params must carry a valid,
            unexpired ``p2pkv_capability`` made with it; None (an insecure
            deployment) accepts params without one.
        now: the time (seconds since the Unix epoch; default: now).
        max_blocks: most block ids per KV cache group a request may name: the
            decode engine's ``max_model_len`` in its blocks (and never more than
            :data:`MAX_BLOCK_IDS`).

    Raises:
        KVTransferParamsError: a key is missing, has a wrong type or is out of
            range (the message names it and the accepted range), or (with
            ``secret``) the capability is missing, altered or expired (named
            ``kv_transfer_params.p2pkv_capability``).
    """
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    now = time.time() if now is None else now
    expiry = _capability_expiry(params.get(CAPABILITY_KEY), now) if secret else 0
    port, tp_size = _port_and_ranks(params)
    block_ids, group_sizes = _block_ids(_require(params, "remote_block_ids", (list, tuple)),
                                        min(max_blocks, MAX_BLOCK_IDS))
    remote = RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        host=_text(params, "remote_host", HOST_PATTERN),
        port=port,
        block_ids=block_ids,
        tp_size=tp_size,
        num_tokens=_optional_int(params, "remote_num_tokens", 0, 0, MAX_BLOCK_IDS * 1024),
        group_sizes=group_sizes,
        appended_tokens=_optional_int(params, "appended_tokens", 0, 0, MAX_APPENDED_TOKENS),
        transfer_mode=_transfer_mode(params),
        prompt_digest=_digest(params),
    )
    if secret:
        _check_mac(remote, params[CAPABILITY_KEY], expiry, secret)
    return remote


def _port_and_ranks(params: dict[str, Any]) -> tuple[int, int]:
    """``(remote_port, tp_size)``, checked. Raises KVTransferParamsError."""
    port = _require(params, "remote_port", int)
    tp_size = _optional_int(params, "tp_size", 1, 1, MAX_TP_SIZE)
    if not 0 < port < 65536 or port + tp_size > 65536:
        raise KVTransferParamsError(f"kv_transfer_params.remote_port={port} is not a TCP port (with tp_size "
                                    f"{tp_size}: base port + rank must be below 65536)")
    return port, tp_size


def parse_prefill_address(params: dict[str, Any]) -> tuple[str, str, int, int]:
    """``(remote_engine_id, remote_host, remote_port, tp_size)`` of a decode leg's params, checked as
    :func:`parse_remote_prefill` checks them (a stream's decode leg names no request or blocks).

    Raises:
        KVTransferParamsError: a missing or bad key (the message names it).
    """
    port, tp_size = _port_and_ranks(params)
    return _text(params, "remote_engine_id"), _text(params, "remote_host", HOST_PATTERN), port, tp_size


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


def capability_mac(remote: RemotePrefill, expiry: int, secret: bytes) -> str:
    """HMAC-SHA256 (hex) of everything a pull of ``remote`` uses, and ``expiry`` (Unix seconds).

    The message is the msgpack encoding of a list (a label, engine id,
    request id, host, port, tp_size, block ids per KV cache group, token
    count, appended tokens, prompt digest, expiry): one byte string per
    value, with no room for ambiguity. Everything that decides what the KV
    means is in it; the flags proxies and routers rewrite
    (``do_remote_decode``, ``do_remote_prefill``), the transfer mode and the
    trace context are not.
    """
    fields = ["p2pkv kv_transfer_params v2", remote.engine_id, remote.request_id, remote.host, remote.port,
              remote.tp_size, [list(g) for g in remote.groups()], remote.num_tokens, remote.appended_tokens,
              remote.prompt_digest, expiry]
    return hmac.new(secret, msgspec.msgpack.encode(fields), hashlib.sha256).hexdigest()


def check_capability(remote: RemotePrefill, capability: Any, secret: bytes, now: float) -> None:
    """Check ``kv_transfer_params.p2pkv_capability`` of the params ``remote`` was parsed from.

    Raises:
        KVTransferParamsError: the capability is missing or malformed, it
            expired more than :data:`CLOCK_SKEW_S` ago, or its MAC does not
            cover these params (altered, or made with another secret).
    """
    _check_mac(remote, capability, _capability_expiry(capability, now), secret)


def _capability_expiry(capability: Any, now: float) -> int:
    """The expiry (seconds since the epoch) a capability names, checked for form and time only (O(1)).

    Raises:
        KVTransferParamsError: missing, malformed, or expired more than :data:`CLOCK_SKEW_S` ago.
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
    return expiry


def _check_mac(remote: RemotePrefill, capability: str, expiry: int, secret: bytes) -> None:
    """Raises KVTransferParamsError when the capability's MAC does not cover ``remote`` and ``expiry``."""
    if not hmac.compare_digest(capability.rpartition(".")[2], capability_mac(remote, expiry, secret)):
        raise KVTransferParamsError(
            f"kv_transfer_params.{CAPABILITY_KEY} does not match the params: they were altered after the prefill "
            "engine signed them, or signed with another secret (every engine and the proxy must share one secret)")


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
                         now: float | None = None) -> dict[str, Any]:
    """A copy of a prefill engine's ``params`` saying the proxy appended ``appended`` tokens to the prompt, and,
    with ``secret``, signed again (``appended_tokens`` is covered by the capability) with the same expiry.

    Only params whose capability checks are signed again (the proxy is no signing oracle); others get the
    count unsigned, which the decode engine refuses (it prefills the prompt itself).

    Raises:
        ValueError: ``appended`` outside ``0..MAX_APPENDED_TOKENS``.
    """
    if not 0 <= appended <= MAX_APPENDED_TOKENS:
        raise ValueError(f"appended must be in 0..{MAX_APPENDED_TOKENS} tokens, got {appended}")
    out = {**params, "appended_tokens": appended}
    if not secret:
        return out
    try:
        parse_remote_prefill(params, secret=secret, now=now)
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
    ``prompt_digest``: :func:`prompt_digest` of the ``num_tokens`` prompt token
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
        "pp_size": 1,
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
                               tuple(group_sizes) if len(group_sizes) > 1 else (), prompt_digest=prompt_digest)
        params[CAPABILITY_KEY] = _capability(remote, expiry_time, secret)
    return params
