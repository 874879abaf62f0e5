"""The proxy's service routes: the model list, backend health and the proxy's own metrics."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.exposition import choose_encoder

from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from p2pkv.tools.proxy.upstream import engine_headers, transport_error

HEALTH_TIMEOUT_S = 2.0
"""How long ``/health`` waits for each backend's ``/health`` (seconds)."""


class Backends(Protocol):
    """What the service routes read of :class:`p2pkv.tools.proxy.app.Proxy`."""

    prefill_urls: list[str]
    decode_urls: list[str]
    timeout_s: float
    metrics: ProxyMetrics


def add_service_routes(app: FastAPI, proxy: Backends, openmetrics: bool) -> None:
    """``/v1/models`` (the first decode engine's), ``/health`` (every backend's) and ``/metrics`` (the proxy's)
    on ``app``; ``openmetrics``: offer OpenMetrics (trace exemplars) to scrapers that accept it."""
    timeout_s = proxy.timeout_s

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The first decode engine's model list."""
        url = proxy.decode_urls[0]
        headers = engine_headers(request, uuid.uuid4().hex)
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
        backends = await asyncio.gather(*[probe(client, "prefill", u) for u in proxy.prefill_urls],
                                        *[probe(client, "decode", u) for u in proxy.decode_urls])
        healthy = all(b["status"] == "ok" for b in backends)
        return JSONResponse({"status": "ok" if healthy else "degraded", "backends": backends},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        """The proxy's own metrics (Prometheus text format; with tracing on, OpenMetrics — which carries the
        histograms' trace exemplars — to a scraper that accepts it)."""
        if openmetrics:
            encode, media_type = choose_encoder(request.headers.get("accept", ""))
            return Response(encode(proxy.metrics.registry), media_type=media_type)
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)
