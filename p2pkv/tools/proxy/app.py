"""The proxy's FastAPI app: prefill (1 token) → decode (relayed), one pair per prompt, round-robin over engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from p2pkv.params import TRANSFER_MODE_KEY
from p2pkv.telemetry.tracing import Tracing
from p2pkv.tools.proxy.batch import split_prompts
from p2pkv.tools.proxy.fanout import Batch
from p2pkv.tools.proxy.first_token import (
    Fallback,
    FirstToken,
    FirstTokenSource,
    first_token_or_fallback,
    request_fallback,
)
from p2pkv.tools.proxy.hand_over import hand_over_stream
from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from p2pkv.tools.proxy.proxy_spans import (
    SCOPE_KEY,
    SERVICE_NAME,
    ProxySpan,
    RequestSpans,
    RequestTrace,
    exemplar,
    leg_of,
)
from p2pkv.tools.proxy.service import add_service_routes
from p2pkv.tools.proxy.stream import StreamLegs
from p2pkv.tools.proxy.stream_route import stream_prompt
from p2pkv.tools.proxy.turns import TurnMemory
from p2pkv.tools.proxy.unpulled_holds import release_all
from p2pkv.tools.proxy.upstream import (
    RelayedStream,
    UpstreamError,
    engine_headers,
    prefill_answer,
    prefill_body,
    status_error,
    transport_error,
)
from p2pkv.tools.proxy.validate import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FANOUT,
    DEFAULT_MAX_PROMPTS,
    BadRequest,
    check_request,
    client_request_id,
    read_json,
)

DISCONNECT_POLL_S = 0.25
"""How often a non-streaming request checks whether its client went away (seconds)."""
TRACE_FLUSH_S = 2.0
"""Longest the proxy's shutdown waits for queued spans to go out (seconds)."""
KEEPALIVE_S = 2.0
"""How long (seconds) the proxy keeps an idle connection to an engine: well below the 5 s after which vLLM's HTTP
server (uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes it."""
RESENT_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""Transport errors after which a prefill leg is sent once more, on another connection: the engine's server dropped
the connection as the request went out or before it answered (seen under load: 1 of 1,536 prefill legs at 512
concurrent requests on a 2-core host, docs/reliability.md). A prefill leg asks for one token and a hold, so sending it
again gives the same answer; if the first one reached the engine, its hold is never pulled and its lease frees it."""
ROUTES = ("/v1/completions", "/v1/chat/completions")
"""The proxied OpenAI endpoints."""

log = logging.getLogger("p2pkv.tools.proxy")

logger = logging.getLogger("p2pkv.proxy")


class RoundRobin:
    """Cycles over backend base URLs.

    Raises:
        ValueError: an empty list.
    """

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one backend URL is needed")
        self.urls = list(urls)
        self._next = 0

    def peek(self) -> str:
        """The backend URL :meth:`next` returns next, without taking it."""
        return self.urls[self._next]

    def next(self) -> str:
        """The next backend URL."""
        url = self.urls[self._next]
        self._next = (self._next + 1) % len(self.urls)
        return url


class Proxy:
    """One prefill and one decode request per prompt, and what to do when a leg fails.

    Args:
        prefill_urls / decode_urls: engine base URLs, used round-robin.
        timeout_s: timeout of each request to an engine (seconds).
        secret: the side-channel secret, to free prefill holds whose decode leg failed.
        first_token_from: where a streaming request's first token comes from
            when it may (see :mod:`p2pkv.tools.proxy.first_token`).
        max_fanout: most prefill/decode pairs one batched request runs at once
            (see :mod:`p2pkv.tools.proxy.fanout`).
        transfer_mode: ``"pull"`` or ``"push"``: set as ``p2pkv_transfer_mode``
            in every decode leg's ``kv_transfer_params`` (the decode engines'
            ``transfer_mode`` is overridden per request); ``"stream"``: see
            :meth:`stream_legs`; ``""``: left to them.
        seed_streams: stream mode: draw a seed for both legs of a streaming
            request that samples at random without one, so that its first
            token can come from the prefill engine
            (:func:`p2pkv.tools.proxy.stream_hand_over.seeded`).

    Raises:
        ValueError: an empty backend list, or ``max_fanout`` below 1.
    """

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float,
                 secret: bytes | None, first_token_from: FirstTokenSource = "prefill",
                 max_fanout: int = DEFAULT_MAX_FANOUT, transfer_mode: str = "", seed_streams: bool = False) -> None:
        if max_fanout < 1:
            raise ValueError(f"max_fanout={max_fanout}: must be >= 1 (pairs at once)")
        self.prefill_urls, self.decode_urls = prefill_urls, decode_urls
        self.prefill, self.decode = RoundRobin(prefill_urls), RoundRobin(decode_urls)
        self.timeout_s, self.secret = timeout_s, secret
        self.first_token_from, self.max_fanout = first_token_from, max_fanout
        self.metrics = ProxyMetrics()
        self.transfer_mode = transfer_mode
        self.seed_streams = seed_streams
        self.streams = StreamLegs(secret, timeout_s) if transfer_mode == "stream" and secret else None
        self.turns = TurnMemory()
        self._background: set[asyncio.Task] = set()

    async def run_prefill(self, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                          headers: dict[str, str], leg: ProxySpan | None = None,
                          turn: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ask a prefill engine for one token; its answer (with ``kv_transfer_params``). Raises UpstreamError.

        ``leg`` (tracing on): the prompt's ``p2pkv.proxy.prefill`` span; its
        context goes with the request, the outcome is recorded on it, and it
        is ended here. ``turn``: the params of the conversation's last kept turn
        (:mod:`p2pkv.tools.proxy.turns`), sent with the leg so that its engine loads
        that turn's blocks first.
        """
        url = self.prefill.next()
        sent = prefill_body(body)
        if turn is not None:  # loaded in this proxy's mode, as its decode legs are (else as the engine picks)
            mode = {TRANSFER_MODE_KEY: self.transfer_mode} if self.transfer_mode in ("pull", "push") else {}
            sent["kv_transfer_params"] = {**sent["kv_transfer_params"], **turn, **mode}
        return await self._prefill_leg(client, url, path, sent, headers, leg)

    async def _prefill_leg(self, client: httpx.AsyncClient, url: str, path: str, sent: dict[str, Any],
                           headers: dict[str, str], leg: ProxySpan | None) -> dict[str, Any]:
        """:meth:`run_prefill` of ``sent`` to the prefill engine at ``url``."""
        if leg is not None:
            headers, sent = leg.send(url, path, headers, sent)
        try:
            return await self._prefill(client, url, path, sent, headers, leg)
        except BaseException as exc:
            if leg is not None:
                leg.failed(exc)
            raise
        finally:
            if leg is not None:
                leg.end()

    async def _prefill(self, client: httpx.AsyncClient, url: str, path: str, sent: dict[str, Any],
                       headers: dict[str, str], leg: ProxySpan | None) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            try:
                resp = await client.post(f"{url}{path}", json=sent, headers=headers)
            except RESENT_ERRORS as exc:
                log.warning("prefill engine %s dropped the connection of a prefill leg (%s: %s); sending it again",
                            url, type(exc).__name__, exc)
                resp = await client.post(f"{url}{path}", json=sent, headers=headers)
        except httpx.HTTPError as exc:
            raise transport_error("prefill", url, exc, self.timeout_s) from exc
        finally:
            self.metrics.prefill_seconds.observe(time.perf_counter() - start, exemplar(leg))
        if leg is not None:
            leg.answered(resp.status_code)
        if resp.status_code >= 500:
            raise status_error("prefill", url, resp.status_code, resp.text)
        if resp.status_code >= 400:
            raise UpstreamError(resp.status_code, f"prefill engine {url} answered {resp.status_code}", "prefill",
                                url, body=resp.content, media_type=resp.headers.get("content-type"))
        answer = prefill_answer(url, resp)
        if leg is not None:
            leg.params(answer["kv_transfer_params"])
        if self.streams is not None:
            self.streams.learn(url, answer["kv_transfer_params"])
        if self.transfer_mode and isinstance(answer["kv_transfer_params"], dict):
            answer["kv_transfer_params"][TRANSFER_MODE_KEY] = self.transfer_mode  # "stream": pushed (no grant)
        return answer

    def start_stream(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                     trace: RequestTrace | None = None, index: int = 0) -> dict[str, Any] | None:
        """Layer-stream the prompt of ``body`` (:mod:`p2pkv.tools.proxy.stream`): its prefill leg sent now, in the
        background; the decode leg's ``kv_transfer_params``, to be sent at once. None (nothing sent) when this
        proxy does not stream, or while the next prefill engine's address is not known.

        ``index``: the prompt's place in a batch (its spans' index).
        """
        if self.streams is None:
            return None
        url = self.prefill.peek()
        legs = self.streams.legs(url, body)
        if legs is None:  # not taken: the push that teaches its address goes to this engine
            return None
        self.prefill.next()
        prefill, params = legs
        task = asyncio.create_task(self._prefill_leg(client, url, path, prefill, headers,
                                                     leg_of(trace, "prefill", index)))
        self._background.add(task)
        task.add_done_callback(_prefill_done(self._background))
        self.streams.started(params, task)
        return params

    def decode_ended(self, body: dict[str, Any]) -> None:
        """The decode leg ``body`` of a streamed prompt ended (answered to its last byte, or refused, unreachable,
        or the client went away first): once its prefill leg has answered, the hold that answer names is freed
        (:meth:`p2pkv.tools.proxy.stream.StreamLegs.ended`). Never earlier: a decode engine whose answer has only
        begun may not have sent its stream's destination yet, and a hold freed first stops the stream."""
        prefill = self.streams.ended(body) if self.streams is not None else None
        if prefill is None:
            return

        async def free() -> None:
            try:
                answer = await asyncio.wait_for(asyncio.shield(prefill), self.timeout_s)
            except Exception:  # the prefill leg failed: it holds nothing (its failure is logged)
                return
            if self.streams is None or not self.streams.claimed(body["kv_transfer_params"]):
                await self.release([answer["kv_transfer_params"]])

        task = asyncio.create_task(free())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stream_legs(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                          out_headers: dict[str, str], trace: RequestTrace | None = None,
                          params: list[dict[str, Any]] | None = None) -> Response:
        """Both legs of one prompt at once, layer-streamed (:func:`p2pkv.tools.proxy.stream_route.stream_prompt`).
        Raises UpstreamError."""
        return await stream_prompt(self, client, path, body, headers, out_headers, trace, params)

    async def run_decode(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], relay: bool = True,
                         leg: ProxySpan | None = None, url: str | None = None) -> Response | httpx.Response:
        """Send a request to a decode engine (``url``, else the next in turn); its answer relayed (or,
        ``relay=False``, the opened stream for merging). Raises UpstreamError; a 4xx answer is passed through.

        ``leg`` (tracing on): the prompt's ``p2pkv.proxy.decode`` span; its
        context goes with the request (also as ``kv_transfer_params.traceparent``).
        It is ended here unless an open stream is returned: a relayed stream
        ends it after its last byte; with ``relay=False`` the caller ends it.
        Likewise the leg's end (:meth:`decode_ended`): here for an answer read
        whole or a failure, after the last byte of a relayed stream, and by the
        caller after it closed a stream returned with ``relay=False``.
        """
        url = url or self.decode.next()
        if leg is not None:
            headers, body = leg.send(url, path, headers, body)
        try:
            resp = await self._decode(client, url, path, body, headers, out_headers, relay, leg)
        except BaseException as exc:
            self.decode_ended(body)
            if leg is not None:
                leg.failed(exc)
                leg.end()
            raise
        if isinstance(resp, Response) and not isinstance(resp, RelayedStream):
            self.decode_ended(body)
            if leg is not None:
                leg.end()
        return resp

    async def _decode(self, client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], out_headers: dict[str, str], relay: bool,
                      leg: ProxySpan | None) -> Response | httpx.Response:
        start = time.perf_counter()
        upstream = client.build_request("POST", f"{url}{path}", json=body, headers=headers)
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            self.metrics.decode_seconds.observe(time.perf_counter() - start, exemplar(leg))
            raise transport_error("decode", url, exc, self.timeout_s) from exc
        if leg is not None:
            leg.answered(resp.status_code)
        if body.get("stream") is True and resp.status_code < 400:
            if not relay:
                return resp

            def relayed(seconds: float) -> None:
                self.metrics.decode_seconds.observe(seconds, exemplar(leg))
                self.decode_ended(body)
                if leg is not None:
                    leg.end()

            def broke(reason: str) -> None:
                self.metrics.errors.labels("decode").inc()
                if leg is not None:
                    leg.failed(reason)

            def first(seconds: float) -> None:
                self.metrics.decode_first_byte_seconds.observe(seconds, exemplar(leg))

            return RelayedStream(resp, url, relayed, broke, start, headers=out_headers, on_first=first)
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            raise transport_error("decode", url, exc, self.timeout_s) from exc
        finally:
            await resp.aclose()
            self.metrics.decode_seconds.observe(time.perf_counter() - start, exemplar(leg))
        if resp.status_code >= 500:
            raise status_error("decode", url, resp.status_code, content.decode(errors="replace"))
        if resp.status_code >= 400:
            raise UpstreamError(resp.status_code, f"decode engine {url} answered {resp.status_code}", "decode",
                                url, body=content, media_type=resp.headers.get("content-type"))
        return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type",
                        "application/json"), headers=out_headers)

    async def release(self, params_list: list[dict[str, Any]]) -> None:
        """Free the prefill holds of decode legs that will never pull."""
        if params_list:
            held = await release_all(params_list, self.secret)
            self.metrics.releases.inc(held)

    async def serve(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                    out_headers: dict[str, str], waited: list[float], trace: RequestTrace | None = None) -> Response:
        """Both legs of every prompt. Raises UpstreamError (prefill holds of failed decodes freed).

        ``waited[0]`` accumulates the seconds spent waiting on engines.
        ``trace`` (tracing on): the request's spans; each leg gets its own under it.
        """
        bodies = split_prompts(body) if path == "/v1/completions" else [body]
        if trace is not None:
            trace.prompts(len(bodies), body.get("stream") is True)
        t = time.perf_counter()
        params: list[dict[str, Any]] = []
        try:
            if len(bodies) > 1:
                batch = Batch(self, client, path, headers, out_headers, self.max_fanout, trace)
                if body.get("stream") is True:
                    self.metrics.count_first_token(Fallback.REQUEST)  # several prompts
                    return await batch.stream(bodies)
                return await batch.answers(bodies)
            if self.streams is not None:
                return await self.stream_legs(client, path, bodies[0], headers, out_headers, trace, params)
            return await self.one_prompt(client, path, bodies[0], headers, out_headers, trace, params)
        except asyncio.CancelledError:  # the client went away: nobody will pull these
            await asyncio.shield(self.release(params))
            raise
        finally:
            waited[0] += time.perf_counter() - t

    async def one_prompt(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], trace: RequestTrace | None, params: list[dict[str, Any]]
                         ) -> Response:
        """One prompt's prefill leg, then its decode leg, after the prefill engine's first token when that may go
        (:mod:`p2pkv.tools.proxy.first_token`); the prefill's ``kv_transfer_params`` are appended to ``params`` (the
        caller frees them if the client leaves). Raises UpstreamError."""
        fallback = request_fallback(path, body, self.first_token_from)  # a request not streamed: REQUEST
        asked = body if fallback is not None else {**body, "return_token_ids": True}
        answer = await self.turns.prefill(path, body, lambda turn: self.run_prefill(
            client, path, asked, headers, leg_of(trace, "prefill"), turn), self.metrics.turns.labels)
        params.append(answer["kv_transfer_params"])
        first = fallback if fallback is not None else first_token_or_fallback(path, body, answer)
        if body.get("stream") is True:
            self.metrics.count_first_token(first)
        if isinstance(first, FirstToken):
            return hand_over_stream(self, client, path, body, first, params[-1], headers, out_headers, trace)
        resp = await self.decode_one(client, path, {**body, "kv_transfer_params": params[-1]}, headers, out_headers,
                                     trace)
        self.remember_turn(path, body, resp)
        return resp

    def remember_turn(self, path: str, body: dict[str, Any], resp: Response) -> None:
        """Remember the kept turn a whole decode answer to ``body`` names, for the conversation's next turn (a
        streamed answer names none)."""
        self.turns.remember_answer(path, body, resp.status_code,
                                   None if isinstance(resp, RelayedStream) else resp.body, self.metrics.turns.labels)

    async def decode_one(self, client: httpx.AsyncClient, path: str, leg: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], trace: RequestTrace | None = None) -> Response:
        """The decode leg of a single-prompt request, relayed; its prefill hold is freed when it fails."""
        try:
            return await self.run_decode(client, path, leg, headers, out_headers,  # type: ignore[return-value]
                                         leg=leg_of(trace, "decode"))
        except UpstreamError:
            await self.release([leg["kv_transfer_params"]])
            raise


def _prefill_done(tasks: set[asyncio.Task]) -> Any:
    """A streamed prompt's prefill leg ended: forgotten, its failure logged (the decode leg, whose stream then
    stops, answers the client: by its load-failure policy, or an error)."""
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning("p2pkv proxy: a streamed prompt's prefill leg failed: %s", exc)
    return done


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response | None:
    """``work``'s answer, or None once the client has gone away (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return None


def create_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 300.0,
               secret: bytes | None = None, first_token_from: FirstTokenSource = "prefill",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_fanout: int = DEFAULT_MAX_FANOUT,
               max_prompts: int = DEFAULT_MAX_PROMPTS, otlp_traces_endpoint: str = "",
               transfer_mode: str = "", seed_streams: bool = False) -> FastAPI:
    """Build the proxy app (one shared ``httpx.AsyncClient``, opened and closed by the app's lifespan).

    Args:
        prefill_urls: base URLs of prefill engines (``http://host:port``), used round-robin.
        decode_urls: base URLs of decode engines, used round-robin.
        timeout_s: timeout of each request to an engine (seconds); a decode
            stream may take longer as long as bytes keep coming.
        secret: the engines' side-channel secret (to free prefill holds after a failed decode leg).
        first_token_from: ``"prefill"`` (default): a streaming request's first
            token is sent from the prefill engine's answer when the request
            allows it (:mod:`p2pkv.tools.proxy.first_token`); ``"decode"``:
            always from the decode engine.
        max_body_bytes: largest request body read (bytes); a larger one is answered 413.
        max_fanout: most prefill/decode pairs a completions request with a
            list of prompts runs at once.
        max_prompts: most prompts one completions request may carry (more: 400).
        otlp_traces_endpoint: OTLP/HTTP traces URL (``""``: tracing off, the
            default); on, each request gets spans (:mod:`p2pkv.tools.proxy.proxy_spans`).
        transfer_mode: ``"pull"`` / ``"push"``: every decode leg asks for that
            direction (``kv_transfer_params.p2pkv_transfer_mode``); ``"stream"``:
            single prompts are layer-streamed, both legs at once (with a secret;
            :mod:`p2pkv.tools.proxy.stream`), batches pushed; ``""``: the
            decode engines' ``transfer_mode`` decides.
        seed_streams: stream mode: a streaming request that samples at random
            without a seed gets one drawn for both legs, so that its first
            token can come from the prefill engine (vLLM then samples its
            batch on the per-request generator path).

    Raises:
        ValueError: an empty backend list, or a limit below 1.
        ImportError: tracing asked for without the OpenTelemetry SDK and OTLP/HTTP exporter installed.
    """
    if max_body_bytes < 1 or max_prompts < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes} and max_prompts={max_prompts} must be >= 1")
    if transfer_mode not in ("", "pull", "push", "stream"):
        raise ValueError(f"transfer_mode={transfer_mode!r}: expected 'pull', 'push', 'stream' or '' (the engines "
                         "decide)")
    proxy = Proxy(prefill_urls, decode_urls, timeout_s, secret, first_token_from, max_fanout, transfer_mode,
                  seed_streams)
    tracing = Tracing.get(SERVICE_NAME, otlp_traces_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Idle connections are dropped before the engines' servers drop them (vLLM's uvicorn: 5 s), or a request
        # sent on one the server is closing that very moment fails with a ReadError (seen: a spurious 502).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S)
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)
        try:
            yield
        finally:
            await app.state.client.aclose()
            if tracing is not None:  # spans still queued go out now (at most TRACE_FLUSH_S)
                await asyncio.to_thread(tracing.flush, TRACE_FLUSH_S)

    app = FastAPI(title="p2pkv proxy", lifespan=lifespan)
    app.state.metrics = proxy.metrics
    app.state.proxy = proxy
    app.state.tracing = tracing
    for path in ROUTES:
        app.add_api_route(path, _endpoint(proxy, path, max_body_bytes, max_prompts), methods=["POST"])
    if tracing is not None:
        app.add_middleware(RequestSpans, tracing=tracing, routes=frozenset(ROUTES))
    add_service_routes(app, proxy, openmetrics=tracing is not None)
    return app


def _endpoint(proxy: Proxy, path: str, max_body_bytes: int, max_prompts: int) -> Any:
    metrics = proxy.metrics

    async def handle(request: Request) -> Response:
        """An OpenAI request through prefill then decode (one pair per prompt).

        The engines get the proxy's own request id (``X-Request-Id``, 32 hex
        digits, also in the answer's headers), never the client's: vLLM builds
        its request ids from it, and the decode engine refuses ids that are
        too long or hold other characters. The client's header is only logged
        next to it.
        """
        t0 = time.perf_counter()
        request_id = uuid.uuid4().hex
        out_headers = {"X-Request-Id": request_id}
        if (client_id := client_request_id(request.headers.get("x-request-id"))) is not None:
            log.info("request %s: client X-Request-Id %s", request_id, client_id)
        trace: RequestTrace | None = request.scope.get(SCOPE_KEY)
        if trace is not None:
            trace.named(request_id, client_id)
        try:
            body = await read_json(request, max_body_bytes)
            check_request(path, body, max_prompts)
        except BadRequest as exc:
            metrics.requests.labels(path, str(exc.status)).inc()
            # 413: close the connection rather than let the server drain the rest of the body
            close = {"Connection": "close"} if exc.status == 413 else {}
            return JSONResponse(exc.payload(), status_code=exc.status, headers={**out_headers, **close})
        client: httpx.AsyncClient = request.app.state.client
        waited = [0.0]
        work = proxy.serve(client, path, body, engine_headers(request, request_id), out_headers, waited, trace)
        try:
            resp = await work if body.get("stream") is True else await _unless_disconnected(request, work)
        except UpstreamError as exc:
            if trace is not None and exc.backend_failed:
                trace.failed(exc)
            if exc.backend_failed:
                metrics.errors.labels(exc.stage).inc()
                log.warning("request %s (client X-Request-Id %s): %s", request_id, client_id, exc.message)
            metrics.requests.labels(path, str(exc.status)).inc()
            resp = exc.response()
            resp.headers["X-Request-Id"] = request_id
            return resp
        if resp is None:  # the client went away: both legs were cancelled
            metrics.requests.labels(path, "499").inc()
            return Response(status_code=499)
        metrics.overhead_seconds.observe(max(0.0, time.perf_counter() - t0 - waited[0]), exemplar(trace))
        metrics.requests.labels(path, str(resp.status_code)).inc()
        return resp

    return handle
