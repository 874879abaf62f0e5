"""The proxy's trace spans: one per client request, one per leg, and the first-token hand-over.

Only built when tracing is on (``create_app(otlp_traces_endpoint=...)``):
:class:`RequestSpans` (ASGI middleware) wraps each POST to a proxied route
in a ``p2pkv.proxy.request`` span — a child of the client's ``traceparent``
header when it sends a valid one, else the root of a new trace — and ends it
when the answer (a stream too) has been sent or the client went away. The
handler finds the request's :class:`RequestTrace` in the ASGI scope
(:data:`SCOPE_KEY`) and opens one ``p2pkv.proxy.prefill`` and one
``p2pkv.proxy.decode`` span (:class:`ProxySpan`) per prompt under it; each
leg sends its own span's context to its engine as the ``traceparent``
header (vLLM's ``llm_request`` span) and as
``kv_transfer_params.traceparent`` (p2pkv's ``p2pkv.hold`` and
``p2pkv.pull`` spans). Spans are exported on the SDK's own thread
(:mod:`p2pkv.telemetry.tracing`): a collector that is down never delays a request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from p2pkv.telemetry.tracing import TRACEPARENT_KEY, Tracing, context_of, parse_traceparent, traceparent_of
from p2pkv.tools.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

SERVICE_NAME = "p2pkv-proxy"
"""``service.name`` of the proxy's spans."""
REQUEST_SPAN = "p2pkv.proxy.request"
PREFILL_SPAN = "p2pkv.proxy.prefill"
DECODE_SPAN = "p2pkv.proxy.decode"
FIRST_TOKEN_SPAN = "p2pkv.proxy.first_token"
SCOPE_KEY = "p2pkv.trace"
"""ASGI scope key of the request's :class:`RequestTrace`."""


def reason_of(exc: BaseException | str) -> str:
    """What an ERROR status says about a failure: an upstream error's message, a cancellation, or the exception."""
    if isinstance(exc, str):
        return exc
    if isinstance(exc, UpstreamError):
        return exc.message
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled: the client went away"
    return f"{type(exc).__name__}: {exc}"


class ProxySpan:
    """One span under a request span (a leg, or the first-token hand-over), ended at most once.

    Args:
        tracing: the proxy's tracer.
        span: the started OpenTelemetry span.
    """

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing, self.span = tracing, span
        self.ended = False
        self.traceparent = traceparent_of(span)
        """The W3C ``traceparent`` naming this span as the parent (sent to the engine)."""
        self.trace_id = self.traceparent[3:35]
        """The trace's id (32 hex digits)."""

    def send(self, url: str, path: str, headers: dict[str, str],
             body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
        """The headers and body to send ``url`` for this leg: both carry this span's ``traceparent``.

        ``body["kv_transfer_params"]`` gets ``traceparent`` (overwriting one
        already there, e.g. copied from a prefill answer); ``headers`` the
        ``traceparent`` header. The engine's URL is recorded on the span.
        """
        self.span.set_attributes({"p2pkv.engine_url": url, "url.full": f"{url}{path}"})
        params = {**(body.get("kv_transfer_params") or {}), TRACEPARENT_KEY: self.traceparent}
        if isinstance(remote := params.get("remote_request_id"), str):
            self.span.set_attribute("p2pkv.remote_request_id", remote)
        return {**headers, TRACEPARENT_KEY: self.traceparent}, {**body, "kv_transfer_params": params}

    def answered(self, status: int) -> None:
        """Record the engine's HTTP status code."""
        self.span.set_attribute("http.response.status_code", status)

    def params(self, params: Any) -> None:
        """Record what a prefill answer's ``kv_transfer_params`` name: ``p2pkv.remote_request_id``."""
        if isinstance(params, dict) and isinstance(remote := params.get("remote_request_id"), str):
            self.span.set_attribute("p2pkv.remote_request_id", remote)

    def failed(self, exc: BaseException | str) -> None:
        """Mark the span ERROR with why (ignored once ended)."""
        if self.ended:
            return
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, reason_of(exc)))

    def end(self) -> None:
        """End the span now (later calls do nothing)."""
        if not self.ended:
            self.ended = True
            self.tracing.ended(self.span)


class RequestTrace:
    """The spans of one client request: ``p2pkv.proxy.request`` and its children.

    Args:
        tracing: the proxy's tracer.
        route: the request's path (``/v1/completions``, ``/v1/chat/completions``).
        traceparent: the client's ``traceparent`` header (None or not valid: a new trace).
    """

    def __init__(self, tracing: Tracing, route: str, traceparent: str | None) -> None:
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind

        self.tracing, self.route = tracing, route
        parent = context_of(traceparent) or Context()  # an empty context: a new trace, whatever is current
        self.span = tracing.tracer.start_span(REQUEST_SPAN, context=parent, kind=SpanKind.SERVER, attributes={
            "http.route": route, "http.request.method": "POST"})
        self.trace_id = f"{self.span.get_span_context().trace_id:032x}"
        """The trace's id (32 hex digits)."""
        self.request_id = ""
        self.children: list[ProxySpan] = []
        self.ended = self.errored = False

    def named(self, request_id: str, client_request_id: str | None) -> None:
        """Record the proxy's request id (and the client's ``X-Request-Id``, shown form, when it sent one)."""
        self.request_id = request_id
        self.span.set_attribute("p2pkv.request_id", request_id)
        if client_request_id is not None:
            self.span.set_attribute("p2pkv.client_request_id", client_request_id)

    def prompts(self, count: int, stream: bool) -> None:
        """Record how many prompts (prefill/decode pairs) the request has and whether it streams."""
        self.span.set_attributes({"p2pkv.prompts": count, "p2pkv.stream": stream})

    def _child(self, name: str, kind_client: bool, index: int, attributes: dict[str, Any]) -> ProxySpan:
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self.tracing.tracer.start_span(
            name, context=set_span_in_context(self.span), kind=SpanKind.CLIENT if kind_client else SpanKind.INTERNAL,
            attributes={"http.route": self.route, "p2pkv.request_id": self.request_id, "p2pkv.prompt_index": index,
                        **attributes})
        child = ProxySpan(self.tracing, span)
        self.children.append(child)
        return child

    def leg(self, stage: str, index: int) -> ProxySpan:
        """A started ``p2pkv.proxy.prefill`` / ``p2pkv.proxy.decode`` span for prompt ``index`` (0-based).

        Raises:
            ValueError: ``stage`` is neither ``"prefill"`` nor ``"decode"``.
        """
        if stage not in ("prefill", "decode"):
            raise ValueError(f"stage {stage!r}: expected 'prefill' or 'decode'")
        return self._child(PREFILL_SPAN if stage == "prefill" else DECODE_SPAN, True, index, {})

    def first_token(self, params: dict[str, Any], finish_reason: str | None) -> ProxySpan:
        """A started ``p2pkv.proxy.first_token`` span: the prefill answer's token on its way to the client."""
        attributes: dict[str, Any] = {"p2pkv.first_token.source": "prefill"}
        if isinstance(remote := params.get("remote_request_id"), str):
            attributes["p2pkv.remote_request_id"] = remote
        if finish_reason is not None:
            attributes["p2pkv.first_token.finish_reason"] = finish_reason
        return self._child(FIRST_TOKEN_SPAN, False, 0, attributes)

    def status(self, code: int) -> None:
        """Record the status code the client got; 5xx marks the span ERROR (keeping a reason already set)."""
        self.span.set_attribute("http.response.status_code", code)
        if code >= 500 and not self.errored:
            self.failed(f"HTTP {code}")

    def failed(self, exc: BaseException | str) -> None:
        """Mark the request span ERROR with why."""
        from opentelemetry.trace import Status, StatusCode

        if not self.ended:
            self.errored = True
            self.span.set_status(Status(StatusCode.ERROR, reason_of(exc)))

    def end(self) -> None:
        """End the request span, and first any child still open (later calls do nothing)."""
        if self.ended:
            return
        now = time.time_ns()
        for child in self.children:
            if not child.ended:
                child.ended = True
                self.tracing.ended(child.span, now)
        self.ended = True
        self.tracing.ended(self.span, now)


def exemplar(traced: ProxySpan | RequestTrace | None) -> dict[str, str] | None:
    """Exemplar labels tying a histogram observation to ``traced``'s trace (``trace_id``; None: tracing off).

    Served on ``/metrics`` in the OpenMetrics format, so Grafana can link a
    slow observation to its trace (docs/tracing.md).
    """
    return None if traced is None else {"trace_id": traced.trace_id}


def leg_of(trace: RequestTrace | None, stage: str, index: int = 0) -> ProxySpan | None:
    """A started leg span under ``trace``, or None when tracing is off (``trace`` None)."""
    return None if trace is None else trace.leg(stage, index)


def _header(scope: Scope, name: bytes) -> str | None:
    """The value of header ``name`` (lower case) when the request has exactly one, else None."""
    values = [v for k, v in scope.get("headers") or () if k.lower() == name]
    return values[0].decode("latin-1") if len(values) == 1 else None


class RequestSpans:
    """ASGI middleware: a :class:`RequestTrace` around each POST to ``routes``, ended once the answer is sent.

    Args:
        app: the wrapped ASGI app.
        tracing: the proxy's tracer.
        routes: the paths traced (the proxied OpenAI endpoints).
    """

    def __init__(self, app: ASGIApp, tracing: Tracing, routes: frozenset[str]) -> None:
        self.app, self.tracing, self.routes = app, tracing, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request inside its span; the span records the status code sent and ends after the last byte."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.routes:
            await self.app(scope, receive, send)
            return
        trace = RequestTrace(self.tracing, scope["path"], parse_traceparent(_header(scope, TRACEPARENT_KEY.encode())))
        scope[SCOPE_KEY] = trace

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                trace.status(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            trace.failed(exc)
            raise
        finally:
            trace.end()
