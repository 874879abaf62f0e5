"""The proxy's FastAPI app: prefill (1 token) → decode (streamed), round-robin."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2pkv.proxy.metrics import ProxyMetrics

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""``kv_transfer_params`` sent to a prefill engine (NixlConnector's protocol)."""


class RoundRobin:
    """Cycles over backend base URLs."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one backend URL is needed")
        self.urls = list(urls)
        self._it = itertools.cycle(self.urls)

    def next(self) -> str:
        """The next backend URL."""
        return next(self._it)


class UpstreamError(Exception):
    """A backend failed; carries the HTTP status and JSON body for the client."""

    def __init__(self, status: int, message: str, stage: str) -> None:
        super().__init__(message)
        self.status, self.message, self.stage = status, message, stage

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": "upstream_error",
                                       "stage": self.stage}}, status_code=self.status)


def _headers(request: Request, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    if auth := request.headers.get("authorization"):
        headers["Authorization"] = auth
    return headers


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def create_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0) -> FastAPI:
    """Build the proxy app.

    Args:
        prefill_urls: base URLs of prefill engines (``http://host:port``).
        decode_urls: base URLs of decode engines.
        timeout_s: per-upstream-request timeout (seconds).

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

    async def run_prefill(client: httpx.AsyncClient, path: str, body: dict, headers: dict) -> dict:
        url = prefill.next()
        start = time.perf_counter()
        try:
            resp = await client.post(f"{url}{path}", json=_prefill_body(body), headers=headers)
        except httpx.TimeoutException as exc:
            raise UpstreamError(504, f"prefill engine {url} timed out after {timeout_s} s", "prefill") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"prefill engine {url} unreachable ({exc!r}); is it running?",
                                "prefill") from exc
        finally:
            metrics.prefill_seconds.observe(time.perf_counter() - start)
        if resp.status_code >= 400:
            status = resp.status_code if resp.status_code < 500 else 502
            raise UpstreamError(status, f"prefill engine {url} answered {resp.status_code}: {resp.text[:2000]}",
                                "prefill")
        params = resp.json().get("kv_transfer_params")
        if not params:
            raise UpstreamError(502, f"prefill engine {url} returned no kv_transfer_params: start it with a "
                                "P/D connector (--kv-transfer-config with P2pKvConnector or NixlConnector)",
                                "prefill")
        return params

    async def handle(request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        try:
            body = await request.json()
        except ValueError:
            metrics.requests.labels(path, "400").inc()
            return JSONResponse({"error": {"message": "request body is not JSON"}}, status_code=400)
        if not isinstance(body, dict):
            metrics.requests.labels(path, "400").inc()
            return JSONResponse({"error": {"message": "request body must be a JSON object"}}, status_code=400)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = _headers(request, request_id)
        client: httpx.AsyncClient = request.app.state.client
        t_pre = time.perf_counter()
        try:
            params = await run_prefill(client, path, body, headers)
        except UpstreamError as exc:
            metrics.errors.labels(exc.stage).inc()
            metrics.requests.labels(path, str(exc.status)).inc()
            return exc.response()
        t_dec = time.perf_counter()
        url = decode.next()
        decode_body = {**body, "kv_transfer_params": params}
        upstream = client.build_request("POST", f"{url}{path}", json=decode_body, headers=headers)
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            metrics.errors.labels("decode").inc()
            metrics.requests.labels(path, "502").inc()
            return UpstreamError(502, f"decode engine {url} unreachable ({exc!r}); is it running?",
                                 "decode").response()
        overhead = (t_pre - t0) + (time.perf_counter() - t_dec)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                metrics.decode_seconds.observe(time.perf_counter() - t_dec)

        metrics.overhead_seconds.observe(overhead)
        metrics.requests.labels(path, str(resp.status_code)).inc()
        if resp.status_code >= 400:
            metrics.errors.labels("decode").inc()
        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), status_code=resp.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = decode_urls[0]
        try:
            resp = await request.app.state.client.get(f"{url}/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            return UpstreamError(502, f"decode engine {url} unreachable ({exc!r})", "decode").response()
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        backends: dict[str, str] = {}
        for url in [*prefill_urls, *decode_urls]:
            try:
                ok = (await client.get(f"{url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            backends[url] = "ok" if ok else "down"
        healthy = all(v == "ok" for v in backends.values())
        return JSONResponse({"status": "ok" if healthy else "degraded", "backends": backends},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
