"""One trace's spans placed on a timeline: which trace, the span tree, lanes and rows (no drawing here).

A lane per ``service.name`` (the proxy, the prefill and decode engines'
p2pkv spans, vLLM's own), in the order the services' first spans start;
inside a lane one row per span, in the tree's depth-first order (children
by start time), so a span's children of the same service sit right under
it, indented one step per ancestor in the lane. Times are milliseconds
since the trace's first span started.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2pkv.tools.trace.otlp import SpanRecord

REQUEST_ID_KEYS = ("p2pkv.request_id", "p2pkv.remote_request_id", "p2pkv.client_request_id", "gen_ai.request.id")
"""Attributes ``--request-id`` looks in: the proxy's id, the prefill engine's, the client's, vLLM's."""


def by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """Spans grouped by trace id (each group in arrival order)."""
    out: dict[str, list[SpanRecord]] = {}
    for span in spans:
        out.setdefault(span.trace_id, []).append(span)
    return out


def _carries(span: SpanRecord, request_id: str, exact: bool) -> bool:
    for key in REQUEST_ID_KEYS:
        value = span.attributes.get(key)
        if isinstance(value, str) and (value == request_id if exact else request_id in value):
            return True
    return False


def pick_trace(spans: Sequence[SpanRecord], trace_id: str | None = None,
               request_id: str | None = None) -> list[SpanRecord]:
    """The spans of one trace: ``trace_id``'s; else the one with a span whose request id attribute
    (:data:`REQUEST_ID_KEYS`) is ``request_id`` (or, when none equals it, contains it: vLLM's ids embed the
    proxy's); else the trace that started last.

    Raises:
        LookupError: no spans, or no trace matches (names what was asked).
    """
    traces = by_trace(spans)
    if not traces:
        raise LookupError("no spans received or read")
    if trace_id is not None:
        wanted = trace_id.strip().lower()
        if wanted not in traces:
            raise LookupError(f"no trace {trace_id} among the {len(traces)} traces read")
        return traces[wanted]
    if request_id is not None:
        for exact in (True, False):
            hits = [t for t, group in traces.items() if any(_carries(s, request_id, exact) for s in group)]
            if hits:
                return traces[max(hits, key=lambda t: min(s.start_ns for s in traces[t]))]
        raise LookupError(f"no span carries request id {request_id!r} (attributes {', '.join(REQUEST_ID_KEYS)})")
    return max(traces.values(), key=lambda group: min(s.start_ns for s in group))


def tree(spans: Sequence[SpanRecord]) -> list[tuple[SpanRecord, int]]:
    """The spans in depth-first order with their depth (roots 0; children by start time).

    A span whose parent is not among ``spans`` (the client's span, or one not
    received) counts as a root.
    """
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    roots: list[SpanRecord] = []
    for span in spans:
        if span.parent_span_id and span.parent_span_id in ids and span.parent_span_id != span.span_id:
            children.setdefault(span.parent_span_id, []).append(span)
        else:
            roots.append(span)

    def start(span: SpanRecord) -> tuple[int, int]:
        return span.start_ns, -span.end_ns

    out: list[tuple[SpanRecord, int]] = []
    seen: set[str] = set()
    stack = [(s, 0) for s in sorted(roots, key=start, reverse=True)]
    while stack:
        span, depth = stack.pop()
        if span.span_id in seen:
            continue
        seen.add(span.span_id)
        out.append((span, depth))
        stack.extend((c, depth + 1) for c in sorted(children.get(span.span_id, ()), key=start, reverse=True))
    out.extend((s, 0) for s in spans if s.span_id not in seen)  # parent cycles: shown, at the top level
    return out


@dataclass(frozen=True)
class Lane:
    """The rows of one service.

    Attributes:
        service: ``service.name`` (``"(no service.name)"`` when empty).
        first_row: its first row (0 = top).
        rows: how many rows (one per span).
    """

    service: str
    first_row: int
    rows: int


@dataclass(frozen=True)
class Bar:
    """One span on the timeline.

    Attributes:
        span: the span.
        lane: index into :attr:`Layout.lanes`.
        row: its row (0 = top; inside its lane's rows).
        depth: its ancestors in the same lane (indentation steps).
        start_ms / end_ms: from the trace's first start (milliseconds).
        label: ``"name  1.23 ms"``.
        failed: its status is ERROR.
    """

    span: SpanRecord
    lane: int
    row: int
    depth: int
    start_ms: float
    end_ms: float
    label: str
    failed: bool


@dataclass(frozen=True)
class Layout:
    """A trace ready to draw.

    Attributes:
        trace_id: the trace's id (hex).
        lanes: one per service, top to bottom.
        bars: one per span, in row order.
        total_ms: first start to last end (milliseconds).
    """

    trace_id: str
    lanes: list[Lane]
    bars: list[Bar]
    total_ms: float

    @property
    def rows(self) -> int:
        """Rows in all."""
        return sum(lane.rows for lane in self.lanes)


def label(span: SpanRecord) -> str:
    """A bar's text: the span's name and duration (ms)."""
    return f"{span.name}  {span.duration_ms:.2f} ms"


def layout(spans: Sequence[SpanRecord]) -> Layout:
    """Place one trace's spans (see the module's docstring).

    Raises:
        ValueError: no spans, or spans of several traces.
    """
    if not spans:
        raise ValueError("no spans to lay out")
    if len({s.trace_id for s in spans}) != 1:
        raise ValueError("spans of several traces: pick one first (pick_trace)")
    order = tree(spans)
    t0 = min(s.start_ns for s in spans)
    services: dict[str, int] = {}  # service → earliest start
    for span, _ in order:
        services[span.service] = min(services.get(span.service, span.start_ns), span.start_ns)
    names = sorted(services, key=lambda name: (services[name], name))
    lane_of = {name: i for i, name in enumerate(names)}
    per_lane: list[list[SpanRecord]] = [[] for _ in names]
    for span, _ in order:
        per_lane[lane_of[span.service]].append(span)
    by_id = {s.span_id: s for s in spans}
    lanes: list[Lane] = []
    bars: list[Bar] = []
    row = 0
    for index, (name, members) in enumerate(zip(names, per_lane, strict=True)):
        lanes.append(Lane(name or "(no service.name)", row, len(members)))
        for span in members:
            depth, parent = 0, by_id.get(span.parent_span_id)
            seen = {span.span_id}
            while parent is not None and parent.span_id not in seen:
                seen.add(parent.span_id)
                depth += parent.service == span.service
                parent = by_id.get(parent.parent_span_id)
            bars.append(Bar(span, index, row, depth, (span.start_ns - t0) / 1e6,
                            (max(span.end_ns, span.start_ns) - t0) / 1e6, label(span), span.failed))
            row += 1
    total = (max(max(s.end_ns, s.start_ns) for s in spans) - t0) / 1e6
    return Layout(spans[0].trace_id, lanes, bars, total)


def summary(spans: Sequence[SpanRecord]) -> str:
    """The trace as text: one line per span in tree order — the name indented two spaces per ancestor, its
    service, start (ms after the trace's first span) and duration (ms); a failed span's status message after.
    """
    if not spans:
        return "no spans"
    t0 = min(s.start_ns for s in spans)
    end = max(max(s.end_ns, s.start_ns) for s in spans)
    order = tree(spans)
    services = {s.service for s in spans}
    names = max(len("span"), *(2 * depth + len(span.name) for span, depth in order))
    width = max(len("service"), *(len(s) for s in services))
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans, {len(services)} services, {(end - t0) / 1e6:.2f} ms",
             f"{'span':<{names}}  {'service':<{width}}  {'start ms':>10}  {'dur ms':>10}"]
    for span, depth in order:
        line = (f"{'  ' * depth + span.name:<{names}}  {span.service:<{width}}  "
                f"{(span.start_ns - t0) / 1e6:>10.2f}  {span.duration_ms:>10.2f}")
        if span.failed:
            line += f"  ERROR: {span.status_message or '(no message)'}"
        lines.append(line)
    return "\n".join(lines)
