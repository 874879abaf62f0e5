"""OTLP trace data: typed span records, and the OTLP/JSON form of ``ExportTraceServiceRequest``.

Protobuf messages are opentelemetry-proto's; JSON goes through protobuf's
``json_format`` with the two changes the OTLP/JSON encoding makes to the
standard proto3 mapping
(https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding): trace
and span ids are hex strings (not base64), and enums are integers. A file
may hold one request (``{"resourceSpans": [...]}``), a JSON list of them, or
one per line (the OpenTelemetry Collector's ``file`` exporter).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})
"""OTLP/JSON fields that hold ids as hex strings."""


@dataclass(frozen=True)
class SpanRecord:
    """One span as received.

    Attributes:
        trace_id: 32 hex digits.
        span_id: 16 hex digits.
        parent_span_id: the parent's 16 hex digits; ``""`` for a root span.
        name: the span's name (e.g. ``p2pkv.proxy.request``).
        service: its resource's ``service.name`` (``""`` when it has none).
        start_ns / end_ns: start and end, nanoseconds since the Unix epoch.
        attributes: the span's attributes (strings, numbers, booleans, lists, dicts).
        status_code: ``"UNSET"``, ``"OK"`` or ``"ERROR"``.
        status_message: the status description (why it failed).
        kind: ``"INTERNAL"``, ``"SERVER"``, ``"CLIENT"``, ``"PRODUCER"``, ``"CONSUMER"`` or ``"UNSPECIFIED"``.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    status_code: str = "UNSET"
    status_message: str = ""
    kind: str = "INTERNAL"

    @property
    def duration_ms(self) -> float:
        """End minus start (milliseconds; 0 for a span that ends before it starts)."""
        return max(0, self.end_ns - self.start_ns) / 1e6

    @property
    def failed(self) -> bool:
        """The span's status is ERROR."""
        return self.status_code == "ERROR"


def any_value(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as Python (bytes as hex; None when unset)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


def records_of(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Every span of ``request`` as a :class:`SpanRecord`, in the order they appear."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        service = ""
        for kv in resource_spans.resource.attributes:
            if kv.key == "service.name":
                service = str(any_value(kv.value) or "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(SpanRecord(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(), name=span.name, service=service,
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                    attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                    status_code=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
                    status_message=span.status.message,
                    kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_")))
    return out


def _convert_ids(node: Any, convert: Any) -> Any:
    """``node`` (parsed JSON) with every id field's string passed through ``convert``."""
    if isinstance(node, list):
        return [_convert_ids(v, convert) for v in node]
    if isinstance(node, dict):
        return {k: convert(v) if k in _ID_FIELDS and isinstance(v, str) and v else _convert_ids(v, convert)
                for k, v in node.items()}
    return node


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return value  # not hex: already protobuf's base64
    return base64.b64encode(raw).decode()


def to_otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """``request`` in the OTLP/JSON encoding (hex ids, integer enums, lowerCamelCase names)."""
    from google.protobuf import json_format

    return _convert_ids(json_format.MessageToDict(request, use_integers_for_enums=True), _b64_to_hex)


def from_otlp_json(data: Mapping[str, Any]) -> ExportTraceServiceRequest:
    """An ``ExportTraceServiceRequest`` from its OTLP/JSON form (hex or base64 ids).

    Raises:
        ValueError: ``data`` is not an ``ExportTraceServiceRequest`` (names what is wrong).
    """
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    if not isinstance(data, Mapping):
        raise ValueError(f"expected a JSON object with resourceSpans, got {type(data).__name__}")
    try:
        return json_format.ParseDict(_convert_ids(dict(data), _hex_to_b64), ExportTraceServiceRequest(),
                                     ignore_unknown_fields=True)
    except (json_format.ParseError, binascii.Error, TypeError) as exc:
        raise ValueError(f"not an OTLP ExportTraceServiceRequest: {exc}") from exc


def merged(requests: Iterable[ExportTraceServiceRequest]) -> ExportTraceServiceRequest:
    """One request holding every resource's spans of ``requests``, in order."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = ExportTraceServiceRequest()
    for request in requests:
        out.resource_spans.extend(request.resource_spans)
    return out


def load(path: Path) -> ExportTraceServiceRequest:
    """The spans of an OTLP/JSON file: one request, a JSON list of them, or one request per line.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds no OTLP trace data (names the line that failed).
    """
    text = path.read_text()
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return from_otlp_json(whole)
    if isinstance(whole, list):
        return merged(from_otlp_json(item) for item in whole)
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(from_otlp_json(json.loads(line)))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    if not requests:
        raise ValueError(f"{path}: empty; expected OTLP/JSON trace data ({{\"resourceSpans\": [...]}})")
    return merged(requests)


def save(request: ExportTraceServiceRequest, path: Path) -> None:
    """Write ``request`` to ``path`` as OTLP/JSON (one object, indented).

    Raises:
        OSError: the file cannot be written.
    """
    path.write_text(json.dumps(to_otlp_json(request), indent=1) + "\n")
