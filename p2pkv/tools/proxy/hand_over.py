"""A streaming request's answer when its first token is handed over: that token at once, then the decode engine's
continuation after it (what :mod:`p2pkv.tools.proxy.first_token` decides and rewrites, sent over HTTP)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
from fastapi.responses import Response

from p2pkv.tools.proxy.batch import sse_events
from p2pkv.tools.proxy.closing import ClosingStream
from p2pkv.tools.proxy.first_token import FirstToken, FirstTokenStream, decode_body, recompute_body, sse_event
from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from p2pkv.tools.proxy.proxy_spans import ProxySpan, RequestTrace, exemplar, leg_of
from p2pkv.tools.proxy.upstream import UpstreamError


class DecodeLegs(Protocol):
    """What the hand-over needs of :class:`p2pkv.tools.proxy.app.Proxy`: the decode leg, releases, metrics."""

    metrics: ProxyMetrics
    secret: bytes | None

    async def run_decode(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], relay: bool = True, leg: ProxySpan | None = None,
                         url: str | None = None) -> Response | httpx.Response: ...

    async def release(self, params_list: list[dict[str, Any]]) -> None: ...


def hand_over_stream(legs: DecodeLegs, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     first: FirstToken, params: dict[str, Any], headers: dict[str, str], out_headers: dict[str, str],
                     trace: RequestTrace | None = None) -> Response:
    """The client's stream: ``first`` at once, then the decode engine's continuation after it.

    A decode leg that fails after the first token went out ends the stream
    with an error event; the prefill hold is freed unless the decode engine's
    stream began (its first event: the request reached its scheduler, whose
    pull or notify-only pull ends the hold): the client left before that (the
    first byte too, or while the leg was being sent: the decode engine may
    never see it, nor vLLM add it to its engine), the leg could not start, or
    ``first`` ended the answer. With ``trace``, span
    ``p2pkv.proxy.first_token`` lasts from the prefill answer to the first
    token's bytes handed to the client.
    """
    writer = FirstTokenStream(path, body, first)
    continuation = decode_body(path, body, first, params, legs.secret)
    hand_over = None if trace is None else trace.first_token(params, first.finish_reason)
    began = False

    def decode_began() -> None:
        nonlocal began
        began = True

    async def release_unless_began() -> None:
        if not began:
            await legs.release([params])

    async def stream() -> AsyncIterator[bytes]:
        span = None
        try:
            yield writer.opening()
            if hand_over is not None:
                hand_over.end()
            if first.finish_reason is not None:
                return
            sent = time.perf_counter()
            try:
                span = leg_of(trace, "decode")
                resp = await legs.run_decode(client, path, continuation, headers, out_headers, relay=False,
                                             leg=span)
            except UpstreamError as exc:
                if exc.backend_failed:
                    legs.metrics.errors.labels("decode").inc()
                yield sse_event(exc.payload()) + sse_event("[DONE]")
                return
            async for out in relay_decode(legs, resp, writer, span, sent, decode_began):
                yield out
        finally:
            for ended in (hand_over, span):
                if ended is not None:
                    ended.end()

    return ClosingStream(stream(), release_unless_began, headers=out_headers)


def broken_decode_stream(legs: DecodeLegs, exc: httpx.HTTPError, resp: httpx.Response,
                         span: ProxySpan | None) -> UpstreamError:
    """The error for a client whose decode stream ``resp`` broke mid-way with ``exc``: counted as a decode
    failure and recorded on ``span``."""
    legs.metrics.errors.labels("decode").inc()
    err = UpstreamError(502, f"decode engine failed mid-stream ({type(exc).__name__}: {exc}); check its log",
                        "decode", str(resp.url))
    if span is not None:
        span.failed(err)
    return err


async def relay_decode(legs: DecodeLegs, resp: httpx.Response, writer: FirstTokenStream, span: ProxySpan | None,
                       sent: float, on_first: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The decode engine's continuation ``resp`` (opened) as the client gets it after the first token:
    ``writer``'s rewrite of each event, then its closing (usage, ``[DONE]``); a stream that breaks ends with an
    error event. ``resp`` is closed at the end; ``sent``: when it was asked for (``time.perf_counter()``);
    ``on_first``: called when the decode engine's first event arrives."""
    start = sent
    try:
        async for data in sse_events(resp.aiter_raw()):
            if start:
                legs.metrics.decode_first_byte_seconds.observe(time.perf_counter() - start, exemplar(span))
                start = 0.0
                if on_first is not None:
                    on_first()
            if (out := writer.rewrite(data)) is not None:
                yield out
        yield writer.closing(writer.usage_chunk)
    except httpx.HTTPError as exc:
        yield sse_event(broken_decode_stream(legs, exc, resp, span).payload())
    finally:
        await resp.aclose()
        legs.metrics.decode_seconds.observe(time.perf_counter() - sent, exemplar(span))


async def continue_after(legs: DecodeLegs, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                         first: FirstToken, headers: dict[str, str], out_headers: dict[str, str],
                         trace: RequestTrace | None = None, url: str | None = None) -> AsyncIterator[bytes]:
    """The client's stream after ``first``, which it already has, from a decode engine asked to continue after it
    with no KV to load (:func:`p2pkv.tools.proxy.first_token.recompute_body`): a layer-streamed request whose
    decode engine sampled another first token. ``url``: that decode engine (its prefix cache holds the blocks
    the stream loaded), None: the next in turn. A leg that fails or is refused ends the stream with an error
    event."""
    span = leg_of(trace, "decode")
    sent = time.perf_counter()
    try:
        try:
            resp = await legs.run_decode(client, path, recompute_body(path, body, first), headers, out_headers,
                                         relay=False, leg=span, url=url)
        except UpstreamError as exc:
            if exc.backend_failed:
                legs.metrics.errors.labels("decode").inc()
            yield sse_event(exc.payload()) + sse_event("[DONE]")
            return
        if isinstance(resp, Response):  # a 4xx answer, passed through by run_decode
            err = UpstreamError(502, f"the decode engine refused to continue after the client's first token "
                                f"(HTTP {resp.status_code}: {bytes(resp.body)[:200]!r})", "decode", "")
            yield sse_event(err.payload()) + sse_event("[DONE]")
            return
        async for out in relay_decode(legs, resp, FirstTokenStream(path, body, first), span, sent):
            yield out
    finally:
        if span is not None:
            span.end()
