"""Freeing a prefill engine's hold when its decode leg will never pull it.

After a successful prefill the prefill engine holds the prompt's KV blocks
for the decode engine. When the decode leg fails before it pulls (the decode
engine refuses the request, is unreachable, or the client goes away), the
proxy tells every prefill rank named in ``kv_transfer_params`` to free the
request's blocks now (:func:`p2pkv.decode.release.free_hold`) instead of when the
lease ends. Only a p2pkv prefill engine's hold (``kv_connector`` is
``P2pKvConnector`` in its params) is released: vLLM's NixlConnector listens
on its side-channel port for its own handshake only, and its listener thread
stops on any other message, so a NixlConnector hold is left to its lease.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from p2pkv.decode.release import free_hold
from p2pkv.params import SENDER, KVTransferParamsError, parse_remote_prefill

logger = logging.getLogger("p2pkv.proxy")

RELEASE_TIMEOUT_S = 2.0
"""Wait for each prefill rank's answer (seconds)."""


def _release(params: dict[str, Any], secret: bytes | None) -> int:
    """Blocking: ask each prefill rank to free ``remote_request_id``; how many ranks held it.

    Nothing is sent for another connector's params, nor for params that do
    not parse or (with ``secret``) whose ``p2pkv_capability`` does not check
    out: the prefill engine made them, so they are only wrong when someone
    else did.
    """
    if params.get("kv_connector") != SENDER:
        return 0
    try:
        remote = parse_remote_prefill(params, secret=secret)
    except KVTransferParamsError as exc:
        logger.warning("p2pkv proxy: not releasing a prefill hold: %s", exc)
        return 0
    return sum(free_hold(remote, rank, "p2pkv-proxy", secret, RELEASE_TIMEOUT_S) for rank in range(remote.num_ranks))


async def release_all(params_list: list[dict[str, Any]], secret: bytes | None) -> int:
    """Free the prefill holds of every ``kv_transfer_params`` in ``params_list``; how many ranks held one."""
    counts = await asyncio.gather(*(asyncio.to_thread(_release, p, secret) for p in params_list))
    return sum(counts)
