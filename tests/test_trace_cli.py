"""``p2pkv trace`` and its parts: the OTLP/HTTP receiver, OTLP/JSON files, the timeline layout, the PNG.

Spans are made by the OpenTelemetry SDK (one tracer provider per service, as
the proxy and the two engines each have) and exported over OTLP/HTTP to the
receiver on 127.0.0.1, so every path a real span takes is exercised.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from p2pkv.tools.cli import main as p2pkv
from p2pkv.tools.trace.otlp import SpanRecord, load, records_of, to_otlp_json
from p2pkv.tools.trace.otlp_receiver import OtlpReceiver
from p2pkv.tools.trace.timeline import layout, pick_trace, summary, tree
from tests.conftest import free_ports

MS = 1_000_000
"""Nanoseconds in a millisecond."""
T0 = 1_700_000_000_000 * MS
"""The made-up trace's start (nanoseconds since the epoch)."""
REQUEST_ID = "9f1c2b3a4d5e6f708192a3b4c5d6e7f8"
TREE = [  # (service, name, parent name, start ms, end ms, error)
    ("p2pkv-proxy", "p2pkv.proxy.request", None, 0, 40, None),
    ("p2pkv-proxy", "p2pkv.proxy.prefill", "p2pkv.proxy.request", 1, 11, None),
    ("vllm-prefill", "llm_request", "p2pkv.proxy.prefill", 2, 10, None),
    ("p2pkv-prefill", "p2pkv.hold", "p2pkv.proxy.prefill", 9, 30, None),
    ("p2pkv-proxy", "p2pkv.proxy.decode", "p2pkv.proxy.request", 12, 39, None),
    ("p2pkv-decode", "p2pkv.pull", "p2pkv.proxy.decode", 13, 29, None),
    ("p2pkv-decode", "p2pkv.pull.transfer", "p2pkv.pull", 14, 25, None),
    ("p2pkv-decode", "p2pkv.pull.fence", "p2pkv.pull", 25, 28, "hold gone: lease expired"),
]
"""A request's spans as the proxy and engines make them: names, services, parents, times (ms from T0)."""
TREE_ORDER = ["p2pkv.proxy.request", "p2pkv.proxy.prefill", "llm_request", "p2pkv.hold", "p2pkv.proxy.decode",
              "p2pkv.pull", "p2pkv.pull.transfer", "p2pkv.pull.fence"]


def export_spans(endpoint: str, shift_ms: int = 0, request_id: str = REQUEST_ID, failed: bool = True) -> None:
    """Make :data:`TREE`'s spans with the OpenTelemetry SDK (a provider per service) and export them to
    ``endpoint`` over OTLP/HTTP; the trace starts ``shift_ms`` after :data:`T0`."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    providers: dict[str, TracerProvider] = {}
    made = {}
    for service, name, parent, start, end, error in TREE:
        if service not in providers:
            providers[service] = TracerProvider(resource=Resource.create({"service.name": service}),
                                                shutdown_on_exit=False)
            providers[service].add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        context = set_span_in_context(made[parent]) if parent else None
        attributes = {"p2pkv.request_id": request_id} if service == "p2pkv-proxy" else {}
        made[name] = providers[service].get_tracer("test").start_span(
            name, context=context, start_time=T0 + (shift_ms + start) * MS, attributes=attributes)
        made[name]._p2pkv_end = T0 + (shift_ms + end) * MS  # ended below, children first
        if error and failed:
            made[name].set_status(Status(StatusCode.ERROR, error))
    for span in reversed(list(made.values())):
        span.end(end_time=span._p2pkv_end)
    for provider in providers.values():
        provider.shutdown()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver("127.0.0.1", 0) as r:
        yield r


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height (pixels), from its IHDR chunk.

    Raises:
        AssertionError: not a PNG.
    """
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def red_pixels(path: Path) -> int:
    """Pixels of the failed-span colour in a PNG."""
    import matplotlib.image
    import numpy as np

    from p2pkv.tools.trace.draw import FAILED_COLOR

    rgb = matplotlib.image.imread(path)[..., :3]
    target = np.array([int(FAILED_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(rgb - target).max(axis=-1) < 0.02).sum())


def test_the_receiver_keeps_what_the_sdk_exports(receiver: OtlpReceiver, tmp_path: Path) -> None:
    export_spans(receiver.url)
    spans = receiver.wait_for(lambda s: len(s) == len(TREE), timeout_s=5)
    by_name = {s.name: s for s in spans}
    assert [(by_name[n].service, by_name[n].start_ns, by_name[n].end_ns) for _, n, *_ in TREE] == [
        (service, T0 + start * MS, T0 + end * MS) for service, _, _, start, end, _ in TREE]
    assert len({s.trace_id for s in spans}) == 1 and all(re.fullmatch(r"[0-9a-f]{32}", s.trace_id) for s in spans)
    for _, name, parent, *_ in TREE:
        assert by_name[name].parent_span_id == (by_name[parent].span_id if parent else "")
    fence = by_name["p2pkv.pull.fence"]
    assert (fence.status_code, fence.status_message, fence.failed) == ("ERROR", "hold gone: lease expired", True)
    assert by_name["p2pkv.proxy.request"].attributes == {"p2pkv.request_id": REQUEST_ID}

    saved = tmp_path / "spans.json"
    assert receiver.save(saved) == len(TREE)
    data = json.loads(saved.read_text())  # OTLP/JSON: hex ids, lowerCamelCase, integer enums
    span = data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == spans[0].trace_id and re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
    assert isinstance(span["kind"], int) and "startTimeUnixNano" in span
    assert records_of(load(saved)) == spans  # and back, unchanged


def test_the_receiver_takes_json_and_gzip_and_refuses_the_rest(receiver: OtlpReceiver) -> None:
    with OtlpReceiver() as source:
        export_spans(source.url)
        source.wait_for(lambda s: len(s) == len(TREE), timeout_s=5)
        request = source.request()
    with httpx.Client(timeout=5) as client:
        r = client.post(receiver.url, json=to_otlp_json(request))
        assert r.status_code == 200 and r.json() == {}
        assert len(receiver.spans()) == len(TREE)
        r = client.post(receiver.url, content=gzip.compress(request.SerializeToString()),
                        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
        assert receiver.spans() == source.spans() * 2 and receiver.exports == 2
        assert client.post(receiver.url, content=b"\xff\x00junk",
                           headers={"Content-Type": "application/x-protobuf"}).status_code == 400
        assert client.post(receiver.url, content=b"{", headers={"Content-Type": "application/json"}).status_code == 400
        assert client.post(receiver.url, content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
        assert client.post(receiver.url.replace("/v1/traces", "/v1/metrics"), content=b"").status_code == 404
        assert client.get(receiver.url).status_code == 405
    assert len(receiver.spans()) == 2 * len(TREE)
    with pytest.raises(TimeoutError, match="16 spans received"):
        receiver.wait_for(lambda s: len(s) > 16, timeout_s=0.2)


def spans_file(tmp_path: Path) -> Path:
    """An OTLP/JSON file of two traces: :data:`TREE` at T0 (request :data:`REQUEST_ID`, failed fence) and the same
    shape 100 ms later for another request, nothing failed."""
    with OtlpReceiver() as receiver:
        export_spans(receiver.url)
        export_spans(receiver.url, shift_ms=100, request_id="other", failed=False)
        receiver.wait_for(lambda s: len(s) == 2 * len(TREE), timeout_s=5)
        path = tmp_path / "spans.json"
        receiver.save(path)
    return path


SUMMARY_LINE = re.compile(r"( *)(\S+) +(\S+) +([\d.]+) +([\d.]+)(?:  ERROR: (.*))?")
"""A span's line of the summary: indentation, name, service, start ms, duration ms, error."""


def summary_lines(text: str) -> list[tuple[int, str, str, float, float, str | None]]:
    """(depth, name, service, start ms, duration ms, error) of each span line of a summary, in order."""
    out = []
    for line in text.splitlines()[2:]:
        m = SUMMARY_LINE.fullmatch(line)
        assert m, line
        indent, name, service, start, dur, error = m.groups()
        out.append((len(indent) // 2, name, service, float(start), float(dur), error))
    return out


def test_p2pkv_trace_draws_the_request_and_prints_its_tree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = spans_file(tmp_path)
    png = tmp_path / "trace.png"
    assert p2pkv(["trace", "--file", str(path), "--request-id", REQUEST_ID, "--out", str(png)]) == 0
    out = capsys.readouterr().out
    width, height = png_size(png)
    assert width == 1400 and 300 <= height <= 800 and png.stat().st_size > 10_000
    assert red_pixels(png) > 100  # the failed fence
    lines = out.splitlines()
    assert re.fullmatch(r"trace [0-9a-f]{32}: 8 spans, 4 services, 40\.00 ms", lines[0])
    assert summary_lines(out) == [
        (0, "p2pkv.proxy.request", "p2pkv-proxy", 0.0, 40.0, None),
        (1, "p2pkv.proxy.prefill", "p2pkv-proxy", 1.0, 10.0, None),
        (2, "llm_request", "vllm-prefill", 2.0, 8.0, None),
        (2, "p2pkv.hold", "p2pkv-prefill", 9.0, 21.0, None),
        (1, "p2pkv.proxy.decode", "p2pkv-proxy", 12.0, 27.0, None),
        (2, "p2pkv.pull", "p2pkv-decode", 13.0, 16.0, None),
        (3, "p2pkv.pull.transfer", "p2pkv-decode", 14.0, 11.0, None),
        (3, "p2pkv.pull.fence", "p2pkv-decode", 25.0, 3.0, "hold gone: lease expired")]

    # the default is the trace that started last: the other request's, nothing failed
    assert p2pkv(["trace", "--file", str(path), "--out", str(png)]) == 0
    latest = capsys.readouterr().out
    assert "ERROR" not in latest and latest.splitlines()[0] != lines[0]
    assert red_pixels(png) == 0
    trace_id = lines[0].split()[1].rstrip(":")
    assert p2pkv(["trace", "--file", str(path), "--trace-id", trace_id, "--out", str(png)]) == 0
    assert capsys.readouterr().out == out


def test_p2pkv_trace_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = spans_file(tmp_path)
    png = tmp_path / "x.png"
    assert p2pkv(["trace", "--file", str(path), "--trace-id", "0" * 32, "--out", str(png)]) == 1
    assert p2pkv(["trace", "--file", str(path), "--request-id", "nobody", "--out", str(png)]) == 1
    assert "no span carries request id 'nobody'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{\"resourceSpans\": 7}\n")
    assert p2pkv(["trace", "--file", str(bad), "--out", str(png)]) == 2
    assert p2pkv(["trace", "--file", str(tmp_path / "missing.json"), "--out", str(png)]) == 2
    assert p2pkv(["trace", "--file", str(path), "--seconds", "1", "--out", str(png)]) == 2
    assert p2pkv(["trace", "--listen", "nohost", "--out", str(png)]) == 2
    assert not png.exists()


def test_p2pkv_trace_listens_saves_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (port,) = free_ports(1, run=1)
    saved, png = tmp_path / "got.json", tmp_path / "got.png"
    argv = ["trace", "--listen", f"127.0.0.1:{port}", "--seconds", "3", "--save", str(saved), "--out", str(png)]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(p2pkv(argv)))
    thread.start()
    deadline = time.monotonic() + 60  # a guard against a hang only: starting its server may take a while
    while True:  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "p2pkv trace --listen did not open its port"
            time.sleep(0.05)
    export_spans(f"http://127.0.0.1:{port}/v1/traces")
    thread.join(timeout=10)
    assert result == [0]
    captured = capsys.readouterr()
    assert f"receiving OTLP/HTTP traces at http://127.0.0.1:{port}/v1/traces" in captured.err
    assert "8 spans" in captured.err and summary_lines(captured.out)[0][:2] == (0, "p2pkv.proxy.request")
    assert len(records_of(load(saved))) == len(TREE) and png_size(png)[0] == 1400


def record(name: str, service: str, span_id: str, parent: str, start: int, end: int,
           error: bool = False) -> SpanRecord:
    return SpanRecord("ab" * 16, span_id, parent, name, service, start * MS, end * MS,
                      status_code="ERROR" if error else "UNSET")


def test_the_layout_puts_children_in_their_parents_lane_under_them() -> None:
    spans = [  # arrival order is not tree order
        record("pull.fence", "decode", "f" * 16, "c" * 16, 25, 28, error=True),
        record("proxy.decode", "proxy", "b" * 16, "a" * 16, 12, 39),
        record("pull", "decode", "c" * 16, "b" * 16, 13, 29),
        record("proxy.request", "proxy", "a" * 16, "9" * 16, 5, 45),  # its parent is the client's: a root
        record("pull.transfer", "decode", "e" * 16, "c" * 16, 14, 25),
        record("proxy.prefill", "proxy", "d" * 16, "a" * 16, 6, 11),
        record("hold", "prefill", "1" * 16, "d" * 16, 9, 30),
    ]
    plan = layout(spans)
    assert [(lane.service, lane.first_row, lane.rows) for lane in plan.lanes] == [
        ("proxy", 0, 3), ("prefill", 3, 1), ("decode", 4, 3)]
    assert [b.span.name for b in plan.bars] == ["proxy.request", "proxy.prefill", "proxy.decode", "hold", "pull",
                                                "pull.transfer", "pull.fence"]
    bars = {b.span.span_id: b for b in plan.bars}
    for bar in plan.bars:
        lane = plan.lanes[bar.lane]
        assert lane.service == bar.span.service and lane.first_row <= bar.row < lane.first_row + lane.rows
        parent = bars.get(bar.span.parent_span_id)
        if parent is not None and parent.span.service == bar.span.service:
            assert parent.lane == bar.lane and parent.row < bar.row and bar.depth == parent.depth + 1
        else:
            assert bar.depth == 0  # a lane's top span
    assert [b.row for b in plan.bars] == list(range(7)) and plan.rows == 7
    request = plan.bars[0]
    assert (request.start_ms, request.end_ms, request.label) == (0.0, 40.0, "proxy.request  40.00 ms")
    assert [b.failed for b in plan.bars] == [False] * 6 + [True] and plan.total_ms == 40.0
    assert [(s.name, d) for s, d in tree(spans)] == [("proxy.request", 0), ("proxy.prefill", 1), ("hold", 2),
                                                     ("proxy.decode", 1), ("pull", 2), ("pull.transfer", 3),
                                                     ("pull.fence", 3)]
    assert summary_lines(summary(spans))[-1] == (3, "pull.fence", "decode", 20.0, 3.0, "(no message)")
    with pytest.raises(ValueError, match="several traces"):
        layout([*spans, SpanRecord("cd" * 16, "2" * 16, "", "x", "proxy", 0, 1)])


def test_pick_trace_by_request_id_falls_back_to_a_contained_id() -> None:
    vllm = SpanRecord("12" * 16, "3" * 16, "", "llm_request", "vllm", 50 * MS, 60 * MS,
                      {"gen_ai.request.id": f"cmpl-{REQUEST_ID}-0"})
    proxy = SpanRecord("34" * 16, "4" * 16, "", "p2pkv.proxy.request", "p2pkv-proxy", 70 * MS, 80 * MS,
                       {"p2pkv.request_id": "other"})
    assert pick_trace([vllm, proxy], request_id=REQUEST_ID) == [vllm]
    assert pick_trace([vllm, proxy]) == [proxy]
    with pytest.raises(LookupError):
        pick_trace([])
