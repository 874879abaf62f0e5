"""The proxy's layer-streamed dispatch (``--transfer-mode stream``): both legs at once, under one grant.

A prefill engine's address (engine id, side-channel host and port, TP and
PP sizes) is learned from its first answer's ``kv_transfer_params`` whose capability
checks under the proxy's secret (an answer nobody signed teaches nothing);
until then requests go to that engine as pushes. Once it is known,
:meth:`StreamLegs.legs` makes a grant (:func:`p2pkv.grant.make_stream_grant`,
for :data:`p2pkv.grant.ANY_DECODE`: the proxy does not know the decode
engines' ids), the prefill leg's body and the decode leg's
``kv_transfer_params``: the prefill leg holds for a remote decode and
carries the grant; the decode leg carries the grant and the prefill
engine's address, no blocks (the prefill engine has not answered). Both are
sent at once, for each prompt of a batch too; the client's answer is the
decode leg's, whose engine computes the first token itself; a greedy or seeded
streaming request may get the prefill engine's first token first
(:mod:`p2pkv.tools.proxy.stream_hand_over`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from p2pkv.grant import ANY_DECODE, GRANT_KEY, GRANT_LIFETIME_S, make_stream_grant
from p2pkv.params import SENDER, TRANSFER_MODE_KEY, KVTransferParamsError, parse_remote_prefill
from p2pkv.tools.proxy.upstream import prefill_body


@dataclass(frozen=True)
class PrefillAddress:
    """Where a prefill engine's side channel is (from its signed answer)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int = 1


class StreamLegs:
    """What the proxy knows to stream, and the legs it makes.

    Args:
        secret: the side channel's secret (signs grants).
        grant_s: how long a grant lasts (seconds: the proxy's request timeout), at most
            :data:`p2pkv.grant.GRANT_LIFETIME_S` (the receivers refuse grants far in their future).
    """

    def __init__(self, secret: bytes, grant_s: float) -> None:
        self._secret = secret
        self.grant_s = grant_s
        self.addresses: dict[str, PrefillAddress] = {}
        self._prefill_legs: dict[str, asyncio.Task] = {}
        self._claimed: set[str] = set()  # grants whose hold another decode leg took over, until their free
        """A streamed prompt's prefill leg (its answer: the prefill engine's params) by the grant, until its
        decode leg has been answered."""

    def learn(self, url: str, params: Any) -> None:
        """A p2pkv prefill engine at ``url`` answered with ``params``: remember its address when their capability
        checks under the secret (params without a hold, or signed with another secret, teach nothing)."""
        if not isinstance(params, dict) or params.get("kv_connector") != SENDER:
            return
        try:
            remote = parse_remote_prefill(params, secret=self._secret)
        except KVTransferParamsError:
            return
        self.addresses[url] = PrefillAddress(remote.engine_id, remote.host, remote.port, remote.tp_size,
                                             remote.pp_size)

    def legs(self, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``(prefill leg's body, decode leg's kv_transfer_params)`` streaming the prompt of ``body`` from the
        prefill engine at ``url``; None while its address is not known."""
        address = self.addresses.get(url)
        if address is None:
            return None
        lifetime = min(self.grant_s, GRANT_LIFETIME_S)
        grant = make_stream_grant(address.engine_id, ANY_DECODE, self._secret, time.time() + lifetime,
                                  pp_size=address.pp_size)  # the grant names the engine's stages
        prefill = prefill_body(body)
        prefill["kv_transfer_params"][GRANT_KEY] = grant
        decode = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": address.engine_id,
                  "remote_host": address.host, "remote_port": address.port, "tp_size": address.tp_size,
                  "pp_size": address.pp_size,
                  GRANT_KEY: grant, TRANSFER_MODE_KEY: "stream"}
        return prefill, decode

    def started(self, params: dict[str, Any], prefill_leg: asyncio.Task) -> None:
        """The prefill leg of the stream whose decode leg carries ``params`` (from :meth:`legs`) was sent."""
        self._prefill_legs[params[GRANT_KEY]] = prefill_leg

    def prefill_leg(self, params: dict[str, Any]) -> asyncio.Task | None:
        """The prefill leg of the stream whose decode leg carries ``params`` (None once that decode leg ended)."""
        grant = params.get(GRANT_KEY)
        return self._prefill_legs.get(grant) if isinstance(grant, str) else None

    def claim(self, params: dict[str, Any]) -> None:
        """The prefill hold of the stream whose decode leg carries ``params`` is taken over by another decode leg
        (:mod:`p2pkv.tools.proxy.stream_faults`): the first decode leg's end must not free it."""
        grant = params.get(GRANT_KEY)
        if isinstance(grant, str) and self._prefill_legs.pop(grant, None) is None:
            self._claimed.add(grant)  # its decode leg has ended: its free waits for the prefill answer

    def claimed(self, params: dict[str, Any]) -> bool:
        """Whether the hold of the stream whose decode leg carries ``params`` was claimed (then forgotten)."""
        grant = params.get(GRANT_KEY)
        if not isinstance(grant, str) or grant not in self._claimed:
            return False
        self._claimed.discard(grant)
        return True

    def ended(self, body: dict[str, Any]) -> asyncio.Task | None:
        """The decode leg ``body`` was answered or failed: its stream's prefill leg, forgotten here (None when
        ``body`` is not a streamed decode leg). The proxy then frees the hold that prefill leg's answer names:
        nobody loads from it any more (a decode leg that answered has loaded or computed the prompt; a failed
        one never will). A stream that never got its destination would hold its blocks until the lease, and so
        would a prompt the prefill engine held without streaming it (a grant it refused, a prompt given as
        embeddings: the decode engine then declines the stream and prefills the prompt itself); a
        stream that did get its destination keeps the blocks pinned until its WRITEs end, so freeing never
        takes blocks from under a WRITE."""
        params = body.get("kv_transfer_params")
        grant = params.get(GRANT_KEY) if isinstance(params, dict) else None
        return self._prefill_legs.pop(grant, None) if isinstance(grant, str) else None
