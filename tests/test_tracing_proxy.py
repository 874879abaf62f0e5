"""The proxy's trace spans, received for real: fake engines and an OTLP/HTTP receiver, all on 127.0.0.1.

Each request's spans go from the proxy's OpenTelemetry SDK over OTLP/HTTP
(protobuf) to :class:`p2pkv.tools.trace.otlp_receiver.OtlpReceiver`; the fake
engines record the ``traceparent`` header and ``kv_transfer_params`` each leg
sent them.
"""

from __future__ import annotations

import re
import socket
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from p2pkv.telemetry.tracing import Tracing
from p2pkv.tools.proxy import PREFILL_PARAMS, create_app
from p2pkv.tools.proxy.proxy_spans import DECODE_SPAN, FIRST_TOKEN_SPAN, PREFILL_SPAN, REQUEST_SPAN, SERVICE_NAME
from p2pkv.tools.trace.otlp import SpanRecord
from p2pkv.tools.trace.otlp_receiver import OtlpReceiver
from tests.fake_engines import KV_PARAMS, FakeEngine, Served, fresh, stop_all

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass
class Stack:
    p: FakeEngine
    d: FakeEngine
    receiver: OtlpReceiver
    traced: str  # proxy exporting to the receiver
    off: str  # proxy without tracing
    blind: str  # proxy exporting to a port nothing listens on
    blind_endpoint: str
    prefill_url: str
    decode_url: str


@pytest.fixture(scope="module")
def tracing_servers():
    p, d = FakeEngine("p", "prefill"), FakeEngine("d", "decode")
    engines = [Served(e.app) for e in (p, d)]
    up, ud = (s.url for s in engines)
    receiver = OtlpReceiver("127.0.0.1", 0).start()
    dead = socket.socket()  # bound, never listening: the collector is down
    dead.bind(("127.0.0.1", 0))
    blind_endpoint = f"http://127.0.0.1:{dead.getsockname()[1]}/v1/traces"
    proxies = [Served(create_app([up], [ud], 10.0, otlp_traces_endpoint=receiver.url)),
               Served(create_app([up], [ud], 10.0)),
               Served(create_app([up], [ud], 10.0, otlp_traces_endpoint=blind_endpoint))]
    yield Stack(p, d, receiver, *(s.url for s in proxies), blind_endpoint, up, ud)
    stop_all(*proxies, *engines)
    receiver.stop()
    dead.close()


@pytest.fixture
def tracing_stack(tracing_servers: Stack) -> Stack:
    return fresh(tracing_servers, tracing_servers.p, tracing_servers.d)


def traceparent(span: SpanRecord, sent: object) -> object:
    """``sent`` when it is a sampled ``traceparent`` naming ``span`` (the SDK picks the other flag bits), else
    the one expected, for the assertion's message."""
    expected = f"00-{span.trace_id}-{span.span_id}-"
    if isinstance(sent, str) and sent.startswith(expected) and int(sent[len(expected):], 16) & 1:
        return sent
    return expected + "01"


def request_spans(receiver: OtlpReceiver, request_id: str, expected: Counter[str]) -> dict[str, list[SpanRecord]]:
    """The spans of the trace holding request ``request_id``'s request span, by name, once they are exactly
    ``expected`` (name → count); each list in prompt order."""

    def mine(spans: list[SpanRecord]) -> list[SpanRecord]:
        roots = [s for s in spans if s.name == REQUEST_SPAN and s.attributes.get("p2pkv.request_id") == request_id]
        return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

    spans = mine(receiver.wait_for(lambda spans: Counter(s.name for s in mine(spans)) == expected))
    out: dict[str, list[SpanRecord]] = {}
    for s in sorted(spans, key=lambda s: s.attributes.get("p2pkv.prompt_index", 0)):
        out.setdefault(s.name, []).append(s)
    return out


ONE_PAIR = Counter({REQUEST_SPAN: 1, PREFILL_SPAN: 1, DECODE_SPAN: 1})


def test_one_request_is_one_trace_and_each_leg_names_its_span(tracing_stack: Stack, client: httpx.Client) -> None:
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    rid = r.headers["x-request-id"]
    spans = request_spans(tracing_stack.receiver, rid, ONE_PAIR)
    (req,), (pre,), (dec,) = spans[REQUEST_SPAN], spans[PREFILL_SPAN], spans[DECODE_SPAN]
    assert req.parent_span_id == "" and req.kind == "SERVER"  # no client traceparent: a new trace
    assert pre.parent_span_id == dec.parent_span_id == req.span_id
    assert {s.service for s in (req, pre, dec)} == {SERVICE_NAME}
    assert req.start_ns <= pre.start_ns <= pre.end_ns <= dec.start_ns <= dec.end_ns <= req.end_ns
    assert {s.status_code for s in (req, pre, dec)} == {"UNSET"}
    # each engine got its own leg's span as the parent, in the header and in kv_transfer_params
    (seen_p,), (seen_d,) = tracing_stack.p.seen, tracing_stack.d.seen
    assert seen_p["traceparent"] == traceparent(pre, seen_p["traceparent"])
    assert seen_p["body"]["kv_transfer_params"] == {**PREFILL_PARAMS, "traceparent": seen_p["traceparent"]}
    assert seen_d["traceparent"] == traceparent(dec, seen_d["traceparent"])
    assert seen_d["body"]["kv_transfer_params"] == {**KV_PARAMS, "traceparent": seen_d["traceparent"]}
    assert req.attributes == {"http.route": "/v1/completions", "http.request.method": "POST",
                              "p2pkv.request_id": rid, "p2pkv.prompts": 1, "p2pkv.stream": False,
                              "http.response.status_code": 200}
    for span, url in ((pre, tracing_stack.prefill_url), (dec, tracing_stack.decode_url)):
        assert span.kind == "CLIENT"
        assert span.attributes["p2pkv.engine_url"] == url
        assert span.attributes["url.full"] == f"{url}/v1/completions"
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["p2pkv.request_id"] == rid and span.attributes["p2pkv.prompt_index"] == 0
        assert span.attributes["p2pkv.remote_request_id"] == KV_PARAMS["remote_request_id"]


def test_a_client_traceparent_makes_the_request_span_its_child(tracing_stack: Stack, client: httpx.Client) -> None:
    header = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    r = client.post(f"{tracing_stack.traced}/v1/chat/completions", headers={"traceparent": header},
                    json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)
    (req,), (pre,), (dec,) = spans[REQUEST_SPAN], spans[PREFILL_SPAN], spans[DECODE_SPAN]
    assert req.trace_id == pre.trace_id == dec.trace_id == CLIENT_TRACE
    assert req.parent_span_id == CLIENT_SPAN and req.attributes["http.route"] == "/v1/chat/completions"
    assert tracing_stack.p.seen[0]["traceparent"] == traceparent(pre, tracing_stack.p.seen[0]["traceparent"]) != header

    r = client.post(f"{tracing_stack.traced}/v1/completions",
                    headers={"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN}-01"},
                    json={"prompt": "hi"})  # an all-zero trace id is not valid: a new trace
    (req,) = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)[REQUEST_SPAN]
    assert req.parent_span_id == "" and req.trace_id not in (CLIENT_TRACE, "0" * 32)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_list_gets_a_pair_of_legs_per_prompt(tracing_stack: Stack, client: httpx.Client, stream: bool) -> None:
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": ["a", "b", "c"], "stream": stream})
    assert r.status_code == 200
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"],
                          Counter({REQUEST_SPAN: 1, PREFILL_SPAN: 3, DECODE_SPAN: 3}))
    (req,) = spans[REQUEST_SPAN]
    assert req.attributes["p2pkv.prompts"] == 3 and req.attributes["p2pkv.stream"] is stream
    for name in (PREFILL_SPAN, DECODE_SPAN):
        assert [s.attributes["p2pkv.prompt_index"] for s in spans[name]] == [0, 1, 2]
        assert {s.parent_span_id for s in spans[name]} == {req.span_id}
        assert all(req.start_ns <= s.start_ns <= s.end_ns <= req.end_ns for s in spans[name])
    for pre, dec in zip(spans[PREFILL_SPAN], spans[DECODE_SPAN], strict=True):
        assert pre.end_ns <= dec.start_ns
    prompt_of = {s["body"]["prompt"]: s for s in tracing_stack.p.seen}
    decode_of = {s["body"]["prompt"]: s for s in tracing_stack.d.seen}
    for prompt, pre, dec in zip("abc", spans[PREFILL_SPAN], spans[DECODE_SPAN], strict=True):
        for seen, span in ((prompt_of[prompt], pre), (decode_of[prompt], dec)):
            assert seen["traceparent"] == traceparent(span, seen["traceparent"])
            assert seen["body"]["kv_transfer_params"]["traceparent"] == seen["traceparent"]


def test_a_failed_decode_leg_is_an_error_span(tracing_stack: Stack, client: httpx.Client) -> None:
    tracing_stack.d.mode = "500"
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)
    (req,), (pre,), (dec,) = spans[REQUEST_SPAN], spans[PREFILL_SPAN], spans[DECODE_SPAN]
    assert pre.status_code == "UNSET"
    assert dec.status_code == "ERROR" and "HTTP 500" in dec.status_message
    assert tracing_stack.decode_url in dec.status_message and dec.attributes["http.response.status_code"] == 500
    assert req.status_code == "ERROR" and req.status_message == dec.status_message
    assert req.attributes["http.response.status_code"] == 502

    tracing_stack.d.mode = "400"  # the decode engine refuses: the leg failed, the proxy passed the answer on
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)
    assert spans[DECODE_SPAN][0].status_code == "ERROR"
    assert spans[REQUEST_SPAN][0].status_code == "UNSET"  # a 4xx is the client's, not the server's failure
    assert spans[REQUEST_SPAN][0].attributes["http.response.status_code"] == 400


def test_a_decode_stream_breaking_marks_its_span(tracing_stack: Stack, client: httpx.Client) -> None:
    tracing_stack.d.mode = "broken_stream"
    with client.stream("POST", f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        text = r.read().decode()
    assert r.status_code == 200 and "failed mid-stream" in text
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)
    (dec,) = spans[DECODE_SPAN]
    assert dec.status_code == "ERROR" and "failed mid-stream" in dec.status_message
    assert dec.end_ns <= spans[REQUEST_SPAN][0].end_ns


def test_the_first_token_hand_over_and_a_continued_decode_leg(tracing_stack: Stack, client: httpx.Client) -> None:
    tracing_stack.p.mode = "p2pkv"
    with client.stream("POST", f"{tracing_stack.traced}/v1/completions",
                       json={"prompt": "hi", "stream": True, "max_tokens": 4}) as r:
        r.read()
    assert r.status_code == 200
    spans = request_spans(tracing_stack.receiver, r.headers["x-request-id"], Counter({**ONE_PAIR, FIRST_TOKEN_SPAN: 1}))
    (req,), (pre,), (first,), (dec,) = (spans[n] for n in (REQUEST_SPAN, PREFILL_SPAN, FIRST_TOKEN_SPAN,
                                                           DECODE_SPAN))
    assert first.parent_span_id == dec.parent_span_id == req.span_id and first.kind == "INTERNAL"
    assert pre.end_ns <= first.start_ns <= first.end_ns <= dec.start_ns <= dec.end_ns <= req.end_ns
    (seen_d,) = tracing_stack.d.seen
    assert seen_d["body"]["kv_transfer_params"]["appended_tokens"] == 1
    assert seen_d["body"]["kv_transfer_params"]["traceparent"] == seen_d["traceparent"]
    assert seen_d["traceparent"] == traceparent(dec, seen_d["traceparent"])


def test_a_traceparent_in_the_prefill_answer_is_replaced_by_the_decode_legs(tracing_stack: Stack,
                                                                             client: httpx.Client) -> None:
    stale = f"00-{'a' * 32}-{'b' * 16}-01"
    tracing_stack.p.params = {**KV_PARAMS, "traceparent": stale}
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi"})
    (dec,) = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)[DECODE_SPAN]
    sent = tracing_stack.d.seen[0]["body"]["kv_transfer_params"]
    assert sent == {**KV_PARAMS, "traceparent": traceparent(dec, sent["traceparent"])}


def test_histograms_carry_the_trace_as_an_exemplar(tracing_stack: Stack, client: httpx.Client) -> None:
    """With tracing on, /metrics in OpenMetrics ties each latency bucket's last observation to its trace."""
    r = client.post(f"{tracing_stack.traced}/v1/completions", json={"prompt": "hi"})
    (req,) = request_spans(tracing_stack.receiver, r.headers["x-request-id"], ONE_PAIR)[REQUEST_SPAN]
    accept = {"Accept": "application/openmetrics-text; version=1.0.0, text/plain; version=0.0.4; q=0.5"}
    m = client.get(f"{tracing_stack.traced}/metrics", headers=accept)
    assert m.headers["content-type"].startswith("application/openmetrics-text")
    for name in ("prefill", "decode", "overhead"):
        bucket = rf'^p2pkv_proxy_{name}_seconds_bucket{{le="[^"]+"}} \d+(\.\d+)?'
        assert re.search(bucket + rf' # {{trace_id="{req.trace_id}"}}', m.text, re.M), name
    off = client.get(f"{tracing_stack.off}/metrics", headers=accept)  # tracing off: the text format, as ever
    assert off.headers["content-type"].startswith("text/plain") and "trace_id" not in off.text


def test_tracing_off_sends_no_traceparent(tracing_stack: Stack, client: httpx.Client) -> None:
    header = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    body = {"prompt": "hi", "max_tokens": 3}
    r = client.post(f"{tracing_stack.off}/v1/completions", json=body, headers={"traceparent": header})
    assert r.status_code == 200
    (seen_p,), (seen_d,) = tracing_stack.p.seen, tracing_stack.d.seen
    assert seen_p["traceparent"] is None and seen_d["traceparent"] is None
    assert seen_p["body"]["kv_transfer_params"] == PREFILL_PARAMS
    assert seen_d["body"] == {**body, "kv_transfer_params": KV_PARAMS}
    rid = r.headers["x-request-id"]
    time.sleep(0.5)  # two of the traced proxies' export rounds
    assert not [s for s in tracing_stack.receiver.spans() if s.attributes.get("p2pkv.request_id") == rid]


def test_a_collector_that_is_down_neither_slows_nor_fails_requests(tracing_stack: Stack, client: httpx.Client) -> None:
    took = []
    for stream in (False, True, False, True, False):
        t = time.perf_counter()
        r = client.post(f"{tracing_stack.blind}/v1/completions", json={"prompt": "hi", "stream": stream})
        took.append(time.perf_counter() - t)
        assert r.status_code == 200 and r.content
    assert max(took) < 1.0, took  # an export waits up to 2 s: none happened on a request's path
    assert all(s["traceparent"] for s in tracing_stack.p.seen + tracing_stack.d.seen)  # tracing was on
    tracing = Tracing.get(SERVICE_NAME, tracing_stack.blind_endpoint)
    assert tracing is not None
    tracing.flush(timeout_s=10.0)
    assert tracing.dropped >= 15  # every span of the five requests failed to export, and was counted
