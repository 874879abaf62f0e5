"""The proxy's layer-streamed dispatch (``--transfer-mode stream``): both legs at once, under one grant.

A prefill engine's address (engine id, side-channel host and port, TP size)
is learned from its first answer's ``kv_transfer_params`` (signed by that
engine); until then, and for batched prompts, requests go as pushes. Once it
is known, :meth:`StreamLegs.legs` makes a grant (:func:`p2pkv.grant.make_stream_grant`,
for :data:`p2pkv.grant.ANY_DECODE`: the proxy does not know the decode
engines' ids) and the two legs' bodies: the prefill leg holds for a remote
decode and carries the grant; the decode leg carries the grant and the
prefill engine's address, no blocks (the prefill engine has not answered).
Both are sent at once; the client's answer is the decode leg's, whose
engine computes the first token itself (no prefill token is handed over).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from p2pkv.grant import ANY_DECODE, GRANT_KEY, make_stream_grant
from p2pkv.params import SENDER, TRANSFER_MODE_KEY, KVTransferParamsError, parse_prefill_address
from p2pkv.tools.proxy.upstream import prefill_body


@dataclass(frozen=True)
class PrefillAddress:
    """Where a prefill engine's side channel is (from its signed answer)."""

    engine_id: str
    host: str
    port: int
    tp_size: int


class StreamLegs:
    """What the proxy knows to stream, and the legs it makes.

    Args:
        secret: the side channel's secret (signs grants).
        grant_s: how long a grant lasts (seconds: the proxy's request timeout).
    """

    def __init__(self, secret: bytes, grant_s: float) -> None:
        self._secret = secret
        self.grant_s = grant_s
        self.addresses: dict[str, PrefillAddress] = {}

    def learn(self, url: str, params: Any) -> None:
        """A p2pkv prefill engine at ``url`` answered with ``params``: remember its address."""
        if not isinstance(params, dict) or params.get("kv_connector") != SENDER:
            return
        try:
            self.addresses[url] = PrefillAddress(*parse_prefill_address(params))
        except KVTransferParamsError:
            return

    def legs(self, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(prefill leg, decode leg)`` bodies streaming ``body`` from the prefill engine at ``url``; None
        while its address is not known."""
        address = self.addresses.get(url)
        if address is None:
            return None
        grant = make_stream_grant(address.engine_id, ANY_DECODE, self._secret, time.time() + self.grant_s)
        prefill = prefill_body(body)
        prefill["kv_transfer_params"][GRANT_KEY] = grant
        decode = {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": address.engine_id,
            "remote_host": address.host, "remote_port": address.port, "tp_size": address.tp_size,
            GRANT_KEY: grant, TRANSFER_MODE_KEY: "stream"}}
        return prefill, decode
