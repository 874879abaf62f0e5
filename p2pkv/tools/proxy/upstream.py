"""Talking to the engines: the prefill request body, backend errors, and the relayed decode stream."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("p2pkv.tools.proxy")

PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""``kv_transfer_params`` sent to a prefill engine (vLLM NixlConnector's protocol)."""

NO_PARAMS_HINT = (
    "it is not running with a P/D KV connector. Start it with --kv-transfer-config "
    "'{\"kv_connector\": \"P2pKvConnector\", "
    "\"kv_role\": \"kv_both\"}' (or NixlConnector with kv_role kv_producer/kv_both)"
)
"""Why a prefill answer without ``kv_transfer_params`` happens, and the fix."""


class UpstreamError(Exception):
    """A request to a backend failed; carries what the proxy answers the client.

    Args:
        status: HTTP status for the client (a backend's 4xx, else 502 or 504).
        message: what failed and what to check; names the backend URL.
        stage: ``"prefill"`` or ``"decode"``.
        backend: the backend's base URL.
        body: a backend's own answer to pass through unchanged (its 4xx), or None.
        media_type: content type of ``body``.
    """

    def __init__(self, status: int, message: str, stage: str, backend: str, body: bytes | None = None,
                 media_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.stage, self.backend = status, message, stage, backend
        self.body, self.media_type = body, media_type

    @property
    def backend_failed(self) -> bool:
        """True for a backend failure (5xx, unreachable, timeout, protocol), False for a passed-through 4xx."""
        return self.body is None

    def payload(self) -> dict[str, Any]:
        """The OpenAI-style error object sent to the client."""
        return {"error": {"message": self.message, "type": "upstream_error", "code": self.status,
                          "stage": self.stage, "backend": self.backend}}

    def response(self) -> Response:
        """The response for the client: the backend's own body for a 4xx, else a JSON error."""
        if self.body is not None:
            return Response(self.body, status_code=self.status, media_type=self.media_type or "application/json")
        return JSONResponse(self.payload(), status_code=self.status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's copy of a client request: one token, not streamed, KV kept for a remote decode.

    ``min_tokens`` above 1 becomes 1 (vLLM refuses ``min_tokens`` above
    ``max_tokens``; the one token is still kept from ending the answer).
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 1:
        out["min_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def transport_error(stage: str, url: str, exc: httpx.HTTPError, timeout_s: float) -> UpstreamError:
    """A 504 (timeout) or 502 (anything else) naming the backend and what to check."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(504, f"{stage} engine {url} did not answer within {timeout_s:g} s "
                             f"({type(exc).__name__}); check that it is healthy and not overloaded, "
                             "or raise the proxy's --timeout", stage, url)
    return UpstreamError(502, f"{stage} engine {url} unreachable ({type(exc).__name__}: {exc}); check that it "
                         f"is running and that the proxy's --{stage} HOST:PORT points at its HTTP port",
                         stage, url)


def status_error(stage: str, url: str, status: int, text: str) -> UpstreamError:
    """A 502 for a backend's 5xx answer, quoting the start of its body."""
    return UpstreamError(502, f"{stage} engine {url} answered HTTP {status}: {text[:1000]}; check its log",
                         stage, url)


def prefill_answer(url: str, resp: httpx.Response) -> dict[str, Any]:
    """A prefill engine's JSON answer, checked to carry ``kv_transfer_params``.

    Raises:
        UpstreamError: 502 when the answer is not JSON or has no params.
    """
    try:
        data = resp.json()
    except ValueError as exc:
        raise UpstreamError(502, f"prefill engine {url} answered non-JSON: {resp.text[:300]!r}",
                            "prefill", url) from exc
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params:
        raise UpstreamError(502, f"prefill engine {url} returned no kv_transfer_params: {NO_PARAMS_HINT}",
                            "prefill", url)
    return data


class RelayedStream(StreamingResponse):
    """Streams an upstream ``httpx`` response to the client byte for byte.

    The upstream response is closed when the relay ends for any reason,
    including the client disconnecting. If the upstream breaks mid-stream, an
    SSE error event is sent and ``on_error`` is called with what failed.

    Args:
        upstream: the decode engine's response, opened with ``stream=True``.
        url: the decode engine's base URL (for error messages).
        on_done: called once with the seconds from ``started`` (a
            ``time.perf_counter()`` value) to the end of the relay.
        on_error: called once, with the error message, if the upstream fails mid-stream.
        started: when the upstream request was sent.
        headers: extra response headers.
        on_first: called once with the seconds from ``started`` to the first body bytes.
    """

    def __init__(self, upstream: httpx.Response, url: str, on_done: Callable[[float], None],
                 on_error: Callable[[str], None], started: float, headers: dict[str, str] | None = None,
                 on_first: Callable[[float], None] | None = None) -> None:
        self.upstream, self.url = upstream, url
        self.on_done, self.on_error, self.started, self.on_first = on_done, on_error, started, on_first
        media = upstream.headers.get("content-type", "text/event-stream")
        super().__init__(self._relay(), status_code=upstream.status_code, media_type=media, headers=headers)

    async def _relay(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.on_first is not None:
                    self.on_first(time.perf_counter() - self.started)
                    self.on_first = None
                yield chunk
        except httpx.HTTPError as exc:
            log.warning("decode engine %s failed mid-stream: %r", self.url, exc)
            err = UpstreamError(502, f"decode engine {self.url} failed mid-stream ({type(exc).__name__}: "
                                f"{exc}); check its log", "decode", self.url)
            self.on_error(err.message)
            yield b"\n\ndata: " + json.dumps(err.payload()).encode() + b"\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay, then close the upstream (shielded from the cancellation a client disconnect causes)."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_done(time.perf_counter() - self.started)


def engine_headers(request: Request, request_id: str) -> dict[str, str]:
    """Headers of a request to an engine: the proxy's request id and the client's ``Authorization``."""
    headers = {"X-Request-Id": request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    return headers
