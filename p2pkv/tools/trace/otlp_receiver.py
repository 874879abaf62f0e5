"""A small OTLP/HTTP trace receiver: ``POST /v1/traces``, spans kept in memory.

For ``p2pkv trace --listen`` and for tests: point exporters
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, the proxy's
``--otlp-traces-endpoint``, vLLM's
``--otlp-traces-endpoint`` with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``)
at :attr:`OtlpReceiver.url`. Bodies are ``ExportTraceServiceRequest`` as
protobuf (``application/x-protobuf``) or OTLP/JSON (``application/json``),
optionally gzip- or deflate-compressed; the answer is an
``ExportTraceServiceResponse`` in the same encoding. Served by the standard
library's threading HTTP server on a daemon thread; not a collector (no
auth, no TLS): bind it to a trusted address.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pkv.tools.trace.otlp import SpanRecord, from_otlp_json, merged, records_of, save

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

log = logging.getLogger("p2pkv.trace")

TRACES_PATH = "/v1/traces"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest export request accepted (bytes, after decompression); larger ones are answered 413."""


class _TooLarge(Exception):
    """A body over :data:`MAX_BODY_BYTES`."""


MEDIA_TYPES = ("application/x-protobuf", "application/protobuf", "application/json")
"""Content types of export requests accepted (others are answered 415)."""


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def _decompress(body: bytes, encoding: str) -> bytes:
    """``body`` decoded per ``Content-Encoding`` (``""``, ``identity``, ``gzip`` or ``deflate``).

    Raises:
        ValueError: another encoding, or a corrupt body.
        _TooLarge: it inflates past :data:`MAX_BODY_BYTES`.
    """
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ValueError(f"Content-Encoding {encoding!r} not supported (gzip, deflate, identity)")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, MAX_BODY_BYTES + 1)
    except zlib.error as exc:
        raise ValueError(f"corrupt {encoding} body: {exc}") from exc
    if len(out) > MAX_BODY_BYTES:
        raise _TooLarge
    return out


def parse_export(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """An ``ExportTraceServiceRequest`` from a request body.

    Raises:
        ValueError: not protobuf or JSON, or not a valid request (names why).
    """
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    media = _media(content_type)
    if media == "application/json":
        try:
            return from_otlp_json(json.loads(body))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"bad OTLP/JSON body: {exc}") from exc
    if media in ("application/x-protobuf", "application/protobuf"):
        try:
            return ExportTraceServiceRequest.FromString(body)
        except DecodeError as exc:
            raise ValueError(f"bad protobuf body: {exc}") from exc
    raise ValueError(f"Content-Type {content_type!r} not supported (application/x-protobuf, application/json)")


class _Handler(BaseHTTPRequestHandler):
    """``POST /v1/traces``; everything else 404/405."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp receiver: " + format, *args)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._answer(status, json.dumps({"code": status, "message": message}).encode(), "application/json")

    def do_GET(self) -> None:
        self._error(405 if self.path.split("?")[0] == TRACES_PATH else 404, f"POST {TRACES_PATH} only")

    def do_POST(self) -> None:
        if self.path.split("?")[0] != TRACES_PATH:
            self._error(404, f"POST {TRACES_PATH} only")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._error(411, "Content-Length required")
            return
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(413, f"body over {MAX_BODY_BYTES} bytes")
            return
        raw = self.rfile.read(int(length))
        content_type = self.headers.get("Content-Type", "application/x-protobuf")
        if _media(content_type) not in MEDIA_TYPES:
            self._error(415, f"Content-Type {content_type!r} not supported ({', '.join(MEDIA_TYPES)})")
            return
        try:
            request = parse_export(_decompress(raw, self.headers.get("Content-Encoding", "")), content_type)
        except _TooLarge:
            self._error(413, f"body inflates past {MAX_BODY_BYTES} bytes")
            return
        except ValueError as exc:
            self._error(400, str(exc))
            return
        self.server.receiver.add(request)
        if _media(content_type) == "application/json":
            self._answer(200, b"{}", "application/json")
        else:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

            self._answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    receiver: OtlpReceiver


class OtlpReceiver:
    """Receives OTLP/HTTP trace exports on ``host:port`` and keeps their spans (thread-safe).

    Args:
        host: address to listen on (``127.0.0.1`` unless exporters on other hosts send to it).
        port: TCP port (0: any free one; :attr:`port` tells which).

    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._cond = threading.Condition()
        self._requests: list[ExportTraceServiceRequest] = []
        self._spans: list[SpanRecord] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The traces URL to give exporters (``http://host:port/v1/traces``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{TRACES_PATH}"

    def start(self) -> OtlpReceiver:
        """Bind and serve on a daemon thread; returns self.

        Raises:
            OSError: the address cannot be bound (in use, not this host's).
            RuntimeError: already started.
        """
        if self._server is not None:
            raise RuntimeError("the receiver is already running")
        server = _Server((self.host, self.port), _Handler)
        server.receiver = self
        self._server, self.port = server, server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="p2pkv-otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (spans received stay). Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, request: ExportTraceServiceRequest) -> None:
        """Keep one export request's spans (the HTTP handler calls this; tests may too)."""
        records = records_of(request)
        with self._cond:
            self._requests.append(request)
            self._spans.extend(records)
            self._cond.notify_all()

    @property
    def exports(self) -> int:
        """Export requests received so far."""
        with self._cond:
            return len(self._requests)

    def spans(self) -> list[SpanRecord]:
        """Every span received so far, in arrival order (a copy)."""
        with self._cond:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[SpanRecord]], bool], timeout_s: float = 10.0) -> list[SpanRecord]:
        """Wait until ``predicate(spans)`` holds; those spans.

        Raises:
            TimeoutError: it did not hold within ``timeout_s`` seconds (names how many spans had arrived).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise TimeoutError(f"after {timeout_s:g} s: {len(self._spans)} spans received ({names}); "
                                       "the condition still does not hold")
                self._cond.wait(left)
            return list(self._spans)

    def request(self) -> ExportTraceServiceRequest:
        """Everything received, as one ``ExportTraceServiceRequest``."""
        with self._cond:
            return merged(self._requests)

    def save(self, path: Path) -> int:
        """Write everything received to ``path`` as OTLP/JSON; how many spans.

        Raises:
            OSError: the file cannot be written.
        """
        with self._cond:
            request, count = merged(self._requests), len(self._spans)
        save(request, path)
        return count
