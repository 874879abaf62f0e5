"""``kv_transfer_params`` encode/decode, wire-compatible with vLLM's NixlConnector.

The proxy sends ``{"do_remote_decode": true}`` to a prefill engine; the
prefill engine answers with the params a decode engine needs to pull the
request's KV (:func:`make_prefill_response_params`); the proxy passes those on
to the decode engine, which parses them with :func:`parse_remote_prefill`.
The key names and meanings are those of vLLM's NixlConnector, so existing
proxies and routers work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` are malformed; the message names the key."""


SENDER = "P2pKvConnector"
"""``kv_transfer_params.kv_connector`` of a p2pkv prefill engine's answer: who holds the blocks (the proxy frees
a p2pkv hold over p2pkv's side channel, and leaves NixlConnector's to its lease)."""
MAX_TP_SIZE = 512
"""Largest ``tp_size`` accepted from a request (a sane bound: no engine has more ranks)."""
MAX_ID_CHARS = 256
"""Longest ``remote_engine_id`` / ``remote_request_id`` / ``remote_host`` accepted (characters)."""
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


def _text(params: dict[str, Any], key: str) -> str:
    value = _require(params, key, str)
    if not value or len(value) > MAX_ID_CHARS:
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be 1..{MAX_ID_CHARS} characters, got "
                                    f"{len(value)}")
    return value


def _optional_int(params: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KVTransferParamsError(f"kv_transfer_params.{key}={value!r} must be an int in {lo}..{hi}")
    return value


def _block_id_list(raw: Any, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or len(raw) > MAX_BLOCK_IDS:
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be a list of at most {MAX_BLOCK_IDS} block ids")
    if set(map(type, raw)) <= {int} and (not raw or min(raw) >= 0):  # the common case, ~3x faster than the loop
        return tuple(raw)
    for b in raw:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise KVTransferParamsError(f"kv_transfer_params.{key} holds {b!r}; block ids are ints >= 0")
    return tuple(raw)


def _block_ids(raw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(block_ids, group_sizes)`` from ``[ids...]`` or NixlConnector's per-group ``[[ids...], ...]``."""
    if not isinstance(raw, list | tuple):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a list")
    if not raw or not isinstance(raw[0], list | tuple):
        return _block_id_list(raw, "remote_block_ids"), ()
    if len(raw) > MAX_KV_CACHE_GROUPS:
        raise KVTransferParamsError(f"kv_transfer_params.remote_block_ids has {len(raw)} KV cache groups, more "
                                    f"than {MAX_KV_CACHE_GROUPS}")
    groups = [_block_id_list(g, f"remote_block_ids[{i}]") for i, g in enumerate(raw)]
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


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    """Parse and validate the params a decode engine received.

    Raises:
        KVTransferParamsError: a key is missing, has a wrong type or is out of
            range (the message names it and the accepted range).
    """
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    port = _require(params, "remote_port", int)
    tp_size = _optional_int(params, "tp_size", 1, 1, MAX_TP_SIZE)
    if not 0 < port < 65536 or port + tp_size > 65536:
        raise KVTransferParamsError(f"kv_transfer_params.remote_port={port} is not a TCP port (with tp_size "
                                    f"{tp_size}: base port + rank must be below 65536)")
    block_ids, group_sizes = _block_ids(_require(params, "remote_block_ids", (list, tuple)))
    return RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        request_id=_text(params, "remote_request_id"),
        host=_text(params, "remote_host"),
        port=port,
        block_ids=block_ids,
        tp_size=tp_size,
        num_tokens=_optional_int(params, "remote_num_tokens", 0, 0, MAX_BLOCK_IDS * 1024),
        group_sizes=group_sizes,
        appended_tokens=_optional_int(params, "appended_tokens", 0, 0, MAX_APPENDED_TOKENS),
    )


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
) -> dict[str, Any]:
    """The params a prefill engine returns with a finished request (NixlConnector keys, plus p2pkv's).

    ``block_ids`` and ``group_sizes`` as in :class:`RemotePrefill`;
    ``remote_block_ids`` is a list per KV cache group, as NixlConnector sends it.
    ``first_token`` (sent as ``first_token``): the token the prefill engine
    sampled is the request's first output token, so a proxy may send it to
    the client at once and append it to the decode request's prompt (see
    ``appended_tokens``); False when the engine computed only part of the
    prompt (an attention-window model, see ``recompute_tokens``).
    """
    return {
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
    }
