"""The engines' p2pkv spans, exported for real over OTLP/HTTP to a receiver on 127.0.0.1.

The end-to-end trace through real engines is in ``tests/test_e2e_tracing.py``;
here the span builders meet cases that run cannot reach cheaply: a hold
ended by each cause, and a prefill request aborted before its hold began.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from p2pkv.config import P2pKvConfig
from p2pkv.telemetry.hold_spans import HoldEnd, emit_hold_span
from p2pkv.telemetry.tracing import Tracing, parse_traceparent, traces_endpoint
from p2pkv.tools.trace.otlp_receiver import OtlpReceiver

PARENT_TRACE, PARENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"


@pytest.mark.parametrize("ended", list(HoldEnd))
def test_a_hold_span_says_why_it_ended_under_the_prefill_leg(ended: HoldEnd) -> None:
    with OtlpReceiver() as receiver:
        tracing = Tracing.get("p2pkv-prefill", receiver.url)
        assert tracing is not None
        start = time.time_ns() - 5_000_000
        emit_hold_span(tracing, "cmpl-1-0", TRACEPARENT, start, ended, "prefill-0", 1, 7)
        (span,) = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
    assert (span.trace_id, span.parent_span_id, span.service) == (PARENT_TRACE, PARENT_SPAN, "p2pkv-prefill")
    assert span.attributes["p2pkv.hold.end"] == ended.value and span.attributes["p2pkv.blocks"] == 7
    assert span.start_ns == start and span.end_ns >= start + 5_000_000
    assert (span.status_code == "ERROR") == (ended is HoldEnd.EXPIRED)


def test_a_prefill_request_aborted_before_its_hold_is_traced_as_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.request import RequestStatus

    from p2pkv.scheduler import SchedulerSide

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
        config = P2pKvConfig(insecure=True)
        side = SchedulerSide("prefill-0", config, 16, "127.0.0.1", 5600, 1)
        request = SimpleNamespace(request_id="cmpl-2-0", status=RequestStatus.FINISHED_ABORTED,
                                  kv_transfer_params={"do_remote_decode": True, "traceparent": TRACEPARENT})
        assert side.request_finished(request, [3, 4]) == (False, None)  # type: ignore[arg-type]
        (span,) = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
        side.shutdown()
    assert span.name == "p2pkv.hold" and span.attributes["p2pkv.hold.end"] == "aborted"
    assert span.parent_span_id == PARENT_SPAN and "p2pkv.tp_rank" not in span.attributes


def test_tracing_is_off_without_an_endpoint_and_traceparents_are_checked() -> None:
    assert traces_endpoint("", {}) == "" and Tracing.get("p2pkv-decode", "") is None
    assert traces_endpoint("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert traces_endpoint("http://mine", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env"}) == "http://mine"
    assert parse_traceparent(TRACEPARENT) == TRACEPARENT
    for bad in (None, 7, "", TRACEPARENT.upper(), f"00-{'0' * 32}-{PARENT_SPAN}-01", TRACEPARENT + "x",
                f"01-{PARENT_TRACE}-{PARENT_SPAN}-01"):
        assert parse_traceparent(bad) is None
