"""One layer-streamed prompt through the proxy (``--transfer-mode stream``): both legs at once, the client's
answer, and what the prefill leg's end does to it.

The grant and the prefill leg come from :meth:`p2pkv.tools.proxy.app.Proxy.start_stream`
(:mod:`p2pkv.tools.proxy.stream`); the client's answer is the decode leg's, after the prefill engine's first token
when that may go first (:mod:`p2pkv.tools.proxy.stream_hand_over`); a prefill leg that fails, or answers for
another engine id or without a hold, is acted on at once (:mod:`p2pkv.tools.proxy.stream_faults`). While the
prefill engine's address is not known, the prompt is pushed (its answer teaches it).
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from fastapi.responses import Response

from p2pkv.tools.proxy.first_token import FirstTokenSource
from p2pkv.tools.proxy.hand_over import DecodeLegs
from p2pkv.tools.proxy.proxy_spans import RequestTrace, leg_of
from p2pkv.tools.proxy.stream import StreamLegs
from p2pkv.tools.proxy.stream_faults import Recovery, relay_again, whole_decode
from p2pkv.tools.proxy.stream_hand_over import hand_over_legs, stream_fallback, stream_hand_over
from p2pkv.tools.proxy.turns import TurnMemory


class Proxy(DecodeLegs, Protocol):
    """What a streamed prompt needs of :class:`p2pkv.tools.proxy.app.Proxy`."""

    streams: StreamLegs | None
    seed_streams: bool
    turns: TurnMemory
    first_token_from: FirstTokenSource
    timeout_s: float

    def start_stream(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                     trace: RequestTrace | None = None, index: int = 0) -> dict[str, Any] | None: ...

    def decode_ended(self, body: dict[str, Any]) -> None: ...

    def remember_turn(self, path: str, body: dict[str, Any], resp: Response) -> None: ...

    async def one_prompt(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], trace: RequestTrace | None,
                         params: list[dict[str, Any]]) -> Response: ...

    async def decode_one(self, client: httpx.AsyncClient, path: str, leg: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], trace: RequestTrace | None = None) -> Response: ...


async def stream_prompt(proxy: Proxy, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                        headers: dict[str, str], out_headers: dict[str, str], trace: RequestTrace | None = None,
                        params: list[dict[str, Any]] | None = None) -> Response:
    """The client's answer to one prompt of ``body``, both legs sent at once under one grant.

    A push while the prefill engine's address is not known (:meth:`Proxy.one_prompt`, which appends its
    ``kv_transfer_params`` to ``params``: the caller frees them if the client leaves).

    Raises:
        UpstreamError: a leg failed (the prefill leg's error when it failed first), or a 4xx passed through.
    """
    handed = hand_over_legs(path, body, proxy.seed_streams) if proxy.first_token_from == "prefill" else None
    sent = handed or body
    # a conversation's next turn whose last turn a decode engine kept: its prefill engine loads that turn and
    # computes only the rest, so there is little to stream; the turn is loaded, then the prompt pushed
    granted = None if proxy.turns.has(path, body) else proxy.start_stream(client, path, sent, headers, trace)
    if granted is None:  # its prefill engine's address is not known yet: a push teaches it
        return await proxy.one_prompt(client, path, body, headers, out_headers, trace,
                                      [] if params is None else params)
    streams = proxy.streams
    prefill_leg = streams.prefill_leg(granted) if streams is not None else None
    decode_body = {**sent, "kv_transfer_params": granted}
    leg = leg_of(trace, "decode")
    if prefill_leg is None or streams is None:
        return await proxy.run_decode(client, path, decode_body, headers, out_headers, leg=leg)  # type: ignore
    recovery = Recovery(granted, lambda p: relay_again(proxy, client, path, body, p, headers, out_headers),
                        lambda: streams.claim(granted), proxy.release, proxy.timeout_s)
    if body.get("stream") is not True:
        async def again(p: dict[str, Any]) -> Response:
            return await proxy.decode_one(client, path, {**body, "kv_transfer_params": p}, headers, out_headers,
                                          trace)

        resp = await whole_decode(proxy.run_decode(client, path, decode_body, headers, out_headers, leg=leg),
                                  prefill_leg, recovery, again)
        proxy.remember_turn(path, body, resp)
        return resp
    if handed is None:
        proxy.metrics.count_first_token(stream_fallback(path, body, proxy.seed_streams, proxy.first_token_from))
    resp = await proxy.run_decode(client, path, decode_body, headers, out_headers, relay=False, leg=leg)
    if isinstance(resp, Response):
        return resp  # an answer passed through (a 4xx), not a stream
    return stream_hand_over(proxy, client, resp, prefill_leg, path, body, headers, out_headers, leg, trace,
                            on_end=lambda: proxy.decode_ended(decode_body), recovery=recovery,
                            prefill_first=handed is not None)


__all__ = ["stream_prompt"]
