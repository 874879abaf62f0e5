"""The proxy against fake engines, all real HTTP on 127.0.0.1: protocol, streaming, errors, health, metrics."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2pkv.tools.proxy import PREFILL_PARAMS, create_app
from tests.fake_engines import CHUNKS, ERROR_BODY, KV_PARAMS, FakeEngine, Served, fresh, stop_all


@dataclass
class Stack:
    p1: FakeEngine
    p2: FakeEngine
    d: FakeEngine
    proxy: str  # [p1, p2] -> [d]
    dead_decode: str  # [p1] -> [refused]
    short_timeout: str  # [p1] -> [d], 0.5 s timeout
    refused: str  # bound, never listening: connections are refused
    prefill_urls: list[str]

    def prefills(self) -> list[dict[str, Any]]:
        return self.p1.seen + self.p2.seen


@pytest.fixture(scope="module")
def proxy_servers():
    p1, p2, d = FakeEngine("p1", "prefill"), FakeEngine("p2", "prefill"), FakeEngine("d", "decode")
    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))
    refused = f"http://127.0.0.1:{refusing.getsockname()[1]}"
    engines = [Served(e.app) for e in (p1, p2, d)]
    u1, u2, ud = (s.url for s in engines)
    proxies = [Served(create_app([u1, u2], [ud], 10.0)), Served(create_app([u1], [refused], 10.0)),
               Served(create_app([u1], [ud], 0.5))]
    yield Stack(p1, p2, d, *(s.url for s in proxies), refused, [u1, u2])
    stop_all(*proxies, *engines)
    refusing.close()


@pytest.fixture
def stack(proxy_servers: Stack) -> Stack:
    return fresh(proxy_servers, proxy_servers.p1, proxy_servers.p2, proxy_servers.d)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` in a Prometheus exposition (0 if absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_protocol_round_robin_request_id_and_auth(stack: Stack, client: httpx.Client,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The engines get the proxy's own request id, never the client's X-Request-Id (vLLM builds its request ids
    from it: a long one, or one with other characters, is refused by the decode engine's params checks, which
    then prefills locally while the prefill hold waits for its lease)."""
    caplog.set_level(logging.INFO, logger="p2pkv.tools.proxy")
    body = {"model": "m", "prompt": "hi", "max_tokens": 7, "stream_options": {"include_usage": True}}
    client_id = "c" * 10 + " <id>\t" + "d" * 240  # 256 characters, some outside [A-Za-z0-9._:@+=/-]
    headers = {"X-Request-Id": client_id, "Authorization": "Bearer k"}
    answered = []
    for _ in range(2):
        r = client.post(f"{stack.proxy}/v1/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        answered.append(r.headers["x-request-id"])
    assert len(stack.p1.seen) == len(stack.p2.seen) == 1  # round-robin alternates
    # each request: one id of the proxy's, the same on both legs and in the answer; never the client's
    assert [s["rid"] for s in stack.prefills()] == [s["rid"] for s in stack.d.seen] == answered
    assert len(set(answered)) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in answered)
    logged = [r.getMessage() for r in caplog.records if "client X-Request-Id" in r.getMessage()]
    shown = "c" * 10 + "??id??" + "d" * 48 + "?..."  # 64 characters, unsafe ones replaced, then cut
    assert logged == [f"request {rid}: client X-Request-Id {shown}" for rid in answered]
    expected_prefill = {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                        "kv_transfer_params": PREFILL_PARAMS}
    for s in stack.prefills():
        assert s["body"] == expected_prefill
        assert s["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert [s["body"] for s in stack.d.seen] == [{**body, "kv_transfer_params": KV_PARAMS}] * 2
    assert {s["auth"] for s in stack.prefills() + stack.d.seen} == {"Bearer k"}


def test_chat_caps_max_completion_tokens_and_generates_request_id(stack: Stack, client: httpx.Client) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    r = client.post(f"{stack.proxy}/v1/chat/completions", json=body)
    assert r.status_code == 200
    (pre,) = stack.prefills()
    (dec,) = stack.d.seen
    assert pre["path"] == dec["path"] == "/v1/chat/completions"
    assert pre["body"]["max_tokens"] == pre["body"]["max_completion_tokens"] == 1
    assert dec["body"] == {**body, "kv_transfer_params": KV_PARAMS}
    assert re.fullmatch(r"[0-9a-f]{32}", pre["rid"]) and pre["rid"] == dec["rid"] == r.headers["x-request-id"]
    assert pre["auth"] is None


def test_streaming_relays_sse_chunks_in_order(stack: Stack, client: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{stack.proxy}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw == b"".join(CHUNKS)
    (pre,) = stack.prefills()
    assert pre["body"]["stream"] is False and "stream_options" not in pre["body"]
    assert stack.d.seen[0]["body"] == {**body, "kv_transfer_params": KV_PARAMS}


def test_client_disconnect_closes_the_decode_stream(stack: Stack, client: httpx.Client) -> None:
    stack.d.mode = "slow_stream"
    with client.stream("POST", f"{stack.proxy}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 3:
                break
    deadline = time.monotonic() + 5
    while not stack.d.closed_after and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stack.d.closed_after and stack.d.closed_after[0] < 100


def test_decode_dying_mid_stream_ends_with_an_error_event(stack: Stack, client: httpx.Client) -> None:
    stack.d.mode = "broken_stream"
    with client.stream("POST", f"{stack.proxy}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == CHUNKS[0].decode().strip()
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["stage"] == "decode" and error["backend"] in error["message"] and error["code"] == 502


def test_prefill_4xx_is_passed_through(stack: Stack, client: httpx.Client) -> None:
    stack.p1.mode = stack.p2.mode = "400"
    r = client.post(f"{stack.proxy}/v1/completions", json={"prompt": "x" * 100})
    assert r.status_code == 400 and r.json() == ERROR_BODY
    assert not stack.d.seen


def test_prefill_without_kv_params_explains(stack: Stack, client: httpx.Client) -> None:
    stack.p1.mode = stack.p2.mode = "no_params"
    r = client.post(f"{stack.proxy}/v1/completions", json={"prompt": "x"})
    err = r.json()["error"]
    assert r.status_code == 502 and err["stage"] == "prefill"
    assert "kv_transfer_params" in err["message"] and "kv_role" in err["message"]
    assert err["backend"] in stack.prefill_urls and err["backend"] in err["message"]
    assert not stack.d.seen


def test_prefill_5xx_and_timeout_name_the_backend(stack: Stack, client: httpx.Client) -> None:
    stack.p1.mode = stack.p2.mode = "500"
    r = client.post(f"{stack.proxy}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"]
    stack.p1.mode = "sleep"
    r = client.post(f"{stack.short_timeout}/v1/completions", json={"prompt": "x"})
    err = r.json()["error"]
    assert r.status_code == 504 and "--timeout" in err["message"] and err["backend"] in err["message"]
    assert not stack.d.seen


def test_dead_decode_gives_502_naming_it(stack: Stack, client: httpx.Client) -> None:
    r = client.post(f"{stack.dead_decode}/v1/completions", json={"prompt": "to a dead decode"})
    err = r.json()["error"]
    assert r.status_code == 502 and err["stage"] == "decode" and stack.refused in err["message"]
    # (a prefill leg an earlier test's proxy timed out on may still land in p1.seen: count this prompt's)
    assert [s["body"]["prompt"] for s in stack.p1.seen].count("to a dead decode") == 1
    metrics = client.get(f"{stack.dead_decode}/metrics").text
    assert metric(metrics, "p2pkv_proxy_errors_total", stage="decode") >= 1
    assert metric(metrics, "p2pkv_proxy_requests_total", endpoint="/v1/completions", status="502") >= 1


def test_health_reports_each_backend(stack: Stack, client: httpx.Client) -> None:
    r = client.get(f"{stack.proxy}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [b["role"] for b in r.json()["backends"]] == ["prefill", "prefill", "decode"]
    r = client.get(f"{stack.dead_decode}/health")
    assert r.status_code == 503
    assert [(b["url"], b["status"]) for b in r.json()["backends"]][1] == (stack.refused, "down")
    stack.d.healthy = False
    assert client.get(f"{stack.proxy}/health").status_code == 503


def test_models_come_from_the_first_decode(stack: Stack, client: httpx.Client) -> None:
    r = client.get(f"{stack.proxy}/v1/models", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["data"][0]["owned_by"] == "d" and r.json()["auth"] == "Bearer k"


def test_metrics_count_requests_and_time_stages(stack: Stack, client: httpx.Client) -> None:
    assert client.post(f"{stack.proxy}/v1/completions", content=b"not json").status_code == 400
    assert client.post(f"{stack.proxy}/v1/completions", json={"prompt": "x"}).status_code == 200
    r = client.get(f"{stack.proxy}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "p2pkv_proxy_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(text, "p2pkv_proxy_requests_total", endpoint="/v1/completions", status="400") >= 1
    for name in ("prefill", "decode", "overhead"):
        assert metric(text, f"p2pkv_proxy_{name}_seconds_count") >= 1


def test_release_reaches_p2pkv_prefill_engines_only() -> None:
    """The proxy frees a p2pkv hold over the side channel; a NixlConnector prefill's port gets nothing.

    vLLM's NixlConnector listener thread stops on any message other than its handshake, so a release
    sent there would break every later pull from that engine.
    """
    from p2pkv.params import make_prefill_response_params
    from p2pkv.tools.proxy.unpulled_holds import _release

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        ours = make_prefill_response_params(engine_id="e", request_id="r", host="127.0.0.1", port=port,
                                            block_ids=[1], tp_size=1, num_tokens=5, expiry_time=None)
        nixl = {k: v for k, v in ours.items() if k != "kv_connector"}  # NixlConnector's params
        assert _release(nixl, None) == 0
        with pytest.raises(TimeoutError):
            listener.accept()
        _release(ours, None)  # no side-channel server answers: 0 held, but the proxy did connect
        conn, _ = listener.accept()
        conn.close()
