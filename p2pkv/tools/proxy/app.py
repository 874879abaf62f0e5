"""The proxy's FastAPI app: prefill (1 token) → decode (relayed), round-robin over engines."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2pkv.tools.proxy.metrics import ProxyMetrics
from p2pkv.tools.proxy.upstream import (
    RelayedStream,
    UpstreamError,
    kv_params_from,
    prefill_body,
    status_error,
    transport_error,
)

HEALTH_TIMEOUT_S = 2.0
"""How long ``/health`` waits for each backend's ``/health`` (seconds)."""


class RoundRobin:
    """Cycles over backend base URLs.

    Raises:
        ValueError: an empty list.
    """

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one backend URL is needed")
        self.urls = list(urls)
        self._it = itertools.cycle(self.urls)

    def next(self) -> str:
        """The next backend URL."""
        return next(self._it)


def _headers(request: Request, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    return headers


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 400}},
                        status_code=400)


def create_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0) -> FastAPI:
    """Build the proxy app (one shared ``httpx.AsyncClient``, opened and closed by the app's lifespan).

    Args:
        prefill_urls: base URLs of prefill engines (``http://host:port``), used round-robin.
        decode_urls: base URLs of decode engines, used round-robin.
        timeout_s: timeout of each request to an engine (seconds); a decode
            stream may take longer as long as bytes keep coming.

    Raises:
        ValueError: an empty backend list.
    """
    prefill, decode = RoundRobin(prefill_urls), RoundRobin(decode_urls)
    metrics = ProxyMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)
        try:
            yield
        finally:
            await app.state.client.aclose()

    app = FastAPI(title="p2pkv proxy", lifespan=lifespan)
    app.state.metrics = metrics

    async def run_prefill(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> dict[str, Any]:
        """Ask a prefill engine for one token; its ``kv_transfer_params``. Raises UpstreamError."""
        url = prefill.next()
        start = time.perf_counter()
        try:
            resp = await client.post(f"{url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            raise transport_error("prefill", url, exc, timeout_s) from exc
        finally:
            metrics.prefill_seconds.observe(time.perf_counter() - start)
        if resp.status_code >= 500:
            raise status_error("prefill", url, resp.status_code, resp.text)
        if resp.status_code >= 400:
            raise UpstreamError(resp.status_code, f"prefill engine {url} answered {resp.status_code}", "prefill",
                                url, body=resp.content, media_type=resp.headers.get("content-type"))
        return kv_params_from(url, resp)

    async def run_decode(client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str]) -> Response:
        """Send the original request to a decode engine; relay its answer. Raises UpstreamError."""
        url = decode.next()
        start = time.perf_counter()
        upstream = client.build_request("POST", f"{url}{path}", json=body, headers=headers)
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            metrics.decode_seconds.observe(time.perf_counter() - start)
            raise transport_error("decode", url, exc, timeout_s) from exc
        if body.get("stream") is True and resp.status_code < 400:
            return RelayedStream(resp, url, metrics.decode_seconds.observe,
                                 metrics.errors.labels("decode").inc, start, headers=out_headers)
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            raise transport_error("decode", url, exc, timeout_s) from exc
        finally:
            await resp.aclose()
            metrics.decode_seconds.observe(time.perf_counter() - start)
        if resp.status_code >= 500:
            raise status_error("decode", url, resp.status_code, content.decode(errors="replace"))
        media = resp.headers.get("content-type", "application/json")
        return Response(content, status_code=resp.status_code, media_type=media, headers=out_headers)

    async def handle(request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        try:
            body = await request.json()
        except ValueError:
            metrics.requests.labels(path, "400").inc()
            return _bad_request("request body is not JSON")
        if not isinstance(body, dict):
            metrics.requests.labels(path, "400").inc()
            return _bad_request("request body must be a JSON object")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = _headers(request, request_id)
        out_headers = {"X-Request-Id": request_id}
        client: httpx.AsyncClient = request.app.state.client
        stage, waited = "prefill", 0.0
        try:
            t = time.perf_counter()
            params = await run_prefill(client, path, body, headers)
            waited += time.perf_counter() - t
            stage, t = "decode", time.perf_counter()
            resp = await run_decode(client, path, {**body, "kv_transfer_params": params}, headers, out_headers)
            waited += time.perf_counter() - t
        except UpstreamError as exc:
            if exc.backend_failed:
                metrics.errors.labels(exc.stage).inc()
            metrics.requests.labels(path, str(exc.status)).inc()
            resp = exc.response()
            resp.headers["X-Request-Id"] = request_id
            return resp
        except Exception:
            metrics.errors.labels(stage).inc()
            metrics.requests.labels(path, "500").inc()
            raise
        metrics.overhead_seconds.observe(max(0.0, time.perf_counter() - t0 - waited))
        metrics.requests.labels(path, str(resp.status_code)).inc()
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI completions through prefill then decode."""
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions through prefill then decode."""
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The first decode engine's model list."""
        url = decode_urls[0]
        headers = _headers(request, request.headers.get("x-request-id") or uuid.uuid4().hex)
        try:
            resp = await request.app.state.client.get(f"{url}/v1/models", headers=headers,
                                                      timeout=min(timeout_s, 10.0))
        except httpx.HTTPError as exc:
            return transport_error("decode", url, exc, min(timeout_s, 10.0)).response()
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    async def probe(client: httpx.AsyncClient, role: str, url: str) -> dict[str, Any]:
        try:
            resp = await client.get(f"{url}/health", timeout=min(timeout_s, HEALTH_TIMEOUT_S))
            ok, detail = resp.status_code == 200, f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return {"url": url, "role": role, "status": "ok" if ok else "down", "detail": detail}

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when the proxy and every backend are healthy, else 503; lists each backend's state."""
        client: httpx.AsyncClient = request.app.state.client
        backends = await asyncio.gather(*[probe(client, "prefill", u) for u in prefill_urls],
                                        *[probe(client, "decode", u) for u in decode_urls])
        healthy = all(b["status"] == "ok" for b in backends)
        return JSONResponse({"status": "ok" if healthy else "degraded", "backends": backends},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The proxy's own metrics (Prometheus text format)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
