"""One trace per client request, across the proxy, the prefill engine and the decode engine (real engines).

The shared pair (prefill, decode, the bundled proxy) exports its spans over
OTLP/HTTP to the session's receiver (:class:`p2pkv.tools.trace.otlp_receiver.OtlpReceiver`,
decoding the protobuf with ``opentelemetry-proto``): the proxy's request and
leg spans, vLLM's own request spans, p2pkv's hold span on the prefill engine
and pull span (with its phases) on the decode engine must share one trace id
with the right parents.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from p2pkv.params import CAPABILITY_KEY, sign_params
from p2pkv.tools.trace.otlp import SpanRecord
from p2pkv.tools.trace.otlp_receiver import OtlpReceiver
from tests.conftest import BLOCK, free_ports

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def traced(routes, otlp) -> tuple[object, OtlpReceiver]:
    """The shared pair (``tests/conftest.py``: its proxy and engines export every span to the session's
    receiver on 127.0.0.1), seen through its push proxy (the prefill engine WRITEs), and that receiver."""
    return routes["push"], otlp


def _one(spans: list[SpanRecord], name: str, trace_id: str) -> SpanRecord:
    found = [s for s in spans if s.name == name and s.trace_id == trace_id]
    assert len(found) == 1, f"{len(found)} spans {name!r} in trace {trace_id}: {[s.name for s in spans]}"
    return found[0]


def _inside(child: SpanRecord, parent: SpanRecord, slack_ns: int = 2_000_000) -> bool:
    """``child`` lies within ``parent`` (a little slack: the spans come from different processes' clocks)."""
    return parent.start_ns - slack_ns <= child.start_ns <= child.end_ns <= parent.end_ns + slack_ns


def _trace_has(trace_id: str, names: dict[str, int]):
    """A receiver predicate: trace ``trace_id`` has at least ``n`` spans of each ``name`` (spans from the
    proxy, each engine's p2pkv and each engine's vLLM leave on their own exporters' schedules)."""
    def holds(spans: list[SpanRecord]) -> bool:
        return all(sum(s.trace_id == trace_id and s.name == name for s in spans) >= n for name, n in names.items())
    return holds


WHOLE = {"p2pkv.proxy.request": 1, "p2pkv.proxy.prefill": 1, "p2pkv.proxy.decode": 1, "p2pkv.hold": 1,
         "p2pkv.pull": 1, "p2pkv.pull.notify": 1, "llm_request": 2}


def _stream(client: httpx.Client, url: str, prompt: str, headers: dict[str, str] | None = None) -> str:
    body = {"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.iter_lines()
                       if line.startswith("data: {"))
    assert text
    return request_id


def test_a_request_is_one_trace_across_proxy_prefill_and_decode(traced, client) -> None:
    pair, receiver = traced
    request_id = _stream(client, pair.url("proxy"), "trace me " * 6)
    spans = receiver.wait_for(lambda s: any(x.name == "p2pkv.proxy.request" and
                                            x.attributes.get("p2pkv.request_id") == request_id for x in s),
                              timeout_s=30)
    root = next(s for s in spans if s.name == "p2pkv.proxy.request" and
                s.attributes.get("p2pkv.request_id") == request_id)
    trace = root.trace_id
    spans = receiver.wait_for(_trace_has(trace, WHOLE), timeout_s=30)
    prefill_leg, decode_leg = _one(spans, "p2pkv.proxy.prefill", trace), _one(spans, "p2pkv.proxy.decode", trace)
    hold, pull = _one(spans, "p2pkv.hold", trace), _one(spans, "p2pkv.pull", trace)
    assert prefill_leg.parent_span_id == decode_leg.parent_span_id == root.span_id
    assert hold.parent_span_id == prefill_leg.span_id and hold.service == "p2pkv-prefill"
    assert pull.parent_span_id == decode_leg.span_id and pull.service == "p2pkv-decode"
    assert hold.attributes["p2pkv.hold.end"] == "notified" and hold.attributes["p2pkv.blocks"] >= 1
    assert pull.attributes["p2pkv.remote_request_id"] == hold.attributes["p2pkv.request_id"]
    assert pull.attributes["p2pkv.bytes"] > 0 and pull.attributes["p2pkv.mode"] == "push"  # the push proxy
    assert pull.status_code != "ERROR"
    phases = {s.name: s for s in spans if s.trace_id == trace and s.parent_span_id == pull.span_id}
    assert {"p2pkv.pull.transfer", "p2pkv.pull.fence", "p2pkv.pull.notify"} <= set(phases)
    assert all(_inside(p, pull, 0) for p in phases.values())
    assert _inside(decode_leg, root) and _inside(prefill_leg, root)
    vllm = [s for s in spans if s.trace_id == trace and s.name == "llm_request"]
    assert {s.parent_span_id for s in vllm} == {prefill_leg.span_id, decode_leg.span_id}, "vLLM's own spans"


def test_a_client_trace_context_is_continued(traced, client) -> None:
    pair, receiver = traced
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    _stream(client, pair.url("proxy"), "continue my trace " * 3, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    spans = receiver.wait_for(_trace_has(trace_id, WHOLE), timeout_s=30)
    root = _one(spans, "p2pkv.proxy.request", trace_id)
    assert root.parent_span_id == client_span
    assert _one(spans, "p2pkv.hold", trace_id).trace_id == trace_id


def test_a_failed_pull_span_carries_its_kind(traced, client) -> None:
    """Params signed by a secret holder but naming a side channel where nothing listens: the pull fails
    (kind handshake) and its span says so, under the caller's trace context."""
    pair, receiver = traced
    prompt = "f" * (BLOCK + 7)
    answer = client.post(f"{pair.url('prefill')}/v1/completions", json={
        "model": "model", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = {k: v for k, v in answer.json()["kv_transfer_params"].items() if k != CAPABILITY_KEY}
    (dead,) = free_ports(1)
    bad = sign_params({**params, "remote_port": dead}, pair.secret.encode(), time.time() + 60)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    bad["traceparent"] = f"00-{trace_id}-b7ad6b7169203331-01"
    resp = client.post(f"{pair.url('decode')}/v1/completions", json={
        "model": "model", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": bad})
    assert resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] not in ("length", "stop")
    spans = receiver.wait_for(lambda s: any(x.trace_id == trace_id and x.name == "p2pkv.pull" for x in s),
                              timeout_s=30)
    pull = _one(spans, "p2pkv.pull", trace_id)
    assert pull.parent_span_id == "b7ad6b7169203331"
    assert pull.status_code == "ERROR" and pull.attributes["p2pkv.failure_kind"] == "handshake"
    # the genuine params still pull, and free the hold
    ok = client.post(f"{pair.url('decode')}/v1/completions", json={
        "model": "model", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": answer.json()["kv_transfer_params"]})
    assert ok.status_code == 200
