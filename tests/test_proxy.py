"""The proxy against fake engines (real HTTP on 127.0.0.1): protocol, errors, round-robin."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from p2pkv.proxy.app import create_app
from p2pkv.proxy.server import normalize_url
from tests.conftest import free_ports

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]],
          "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r", "tp_size": 1}


def fake_prefill(seen: list[dict], name: str, with_params: bool = True, status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append({"engine": name, "body": await request.json(), "rid": request.headers.get("x-request-id")})
        if status != 200:
            return JSONResponse({"error": "bad prompt"}, status_code=status)
        out = {"choices": [{"text": "x"}]}
        if with_params:
            out["kv_transfer_params"] = PARAMS
        return out

    @app.get("/health")
    async def health():
        return {}

    return app


def fake_decode(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append({"engine": "decode", "body": body, "rid": request.headers.get("x-request-id")})
        if body.get("stream"):
            async def gen():
                for i in range(3):
                    yield f"data: chunk{i}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return {"choices": [{"text": "decoded"}]}

    @app.get("/health")
    async def health():
        return {}

    return app


class Served:
    def __init__(self, app: FastAPI, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


@pytest.fixture
def stack():
    seen: list[dict] = []
    p1, p2, d, px, dead = free_ports(5)
    servers = [Served(fake_prefill(seen, "p1"), p1), Served(fake_prefill(seen, "p2"), p2),
               Served(fake_decode(seen), d)]
    app = create_app([f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"], [f"http://127.0.0.1:{d}"], 10.0)
    servers.append(Served(app, px))
    yield f"http://127.0.0.1:{px}", seen, dead
    for s in servers:
        s.stop()


def test_protocol_round_robin_and_request_id(stack) -> None:
    url, seen, _ = stack
    body = {"model": "m", "prompt": "hi", "max_tokens": 7, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=10) as c:
        for _ in range(2):
            r = c.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "abc"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    prefills = [s for s in seen if s["engine"] != "decode"]
    decodes = [s for s in seen if s["engine"] == "decode"]
    assert [s["engine"] for s in prefills] == ["p1", "p2"]
    for s in prefills:
        assert s["body"]["max_tokens"] == 1 and s["body"]["stream"] is False
        assert "stream_options" not in s["body"]
        assert s["body"]["kv_transfer_params"]["do_remote_decode"] is True
    for s in decodes:
        assert s["body"]["max_tokens"] == 7 and s["body"]["kv_transfer_params"] == PARAMS
    assert {s["rid"] for s in seen} == {"abc"}


def test_streaming_relays_chunks_in_order(stack) -> None:
    url, _, _ = stack
    with httpx.Client(timeout=10) as c, c.stream("POST", f"{url}/v1/completions",
                                                 json={"prompt": "hi", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines == ["data: chunk0", "data: chunk1", "data: chunk2", "data: [DONE]"]


def test_errors_name_the_backend(stack) -> None:
    url, _, dead = stack
    with httpx.Client(timeout=10) as c:
        assert c.post(f"{url}/v1/completions", content=b"not json").status_code == 400
        metrics = c.get(f"{url}/metrics").text
        assert "p2pkv_proxy_requests_total" in metrics
    bad = create_app([f"http://127.0.0.1:{dead}"], [f"http://127.0.0.1:{dead}"], 2.0)
    (port,) = free_ports(1)
    s = Served(bad, port)
    try:
        with httpx.Client(timeout=10) as c:
            r = c.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
            assert r.status_code == 502 and str(dead) in r.json()["error"]["message"]
            assert c.get(f"http://127.0.0.1:{port}/health").status_code == 503
    finally:
        s.stop()


def test_prefill_without_params_and_prefill_4xx() -> None:
    seen: list[dict] = []
    p_noparams, p_400, d, px1, px2 = free_ports(5)
    servers = [Served(fake_prefill(seen, "a", with_params=False), p_noparams),
               Served(fake_prefill(seen, "b", status=400), p_400), Served(fake_decode(seen), d)]
    servers.append(Served(create_app([f"http://127.0.0.1:{p_noparams}"], [f"http://127.0.0.1:{d}"]), px1))
    servers.append(Served(create_app([f"http://127.0.0.1:{p_400}"], [f"http://127.0.0.1:{d}"]), px2))
    try:
        with httpx.Client(timeout=10) as c:
            r = c.post(f"http://127.0.0.1:{px1}/v1/completions", json={"prompt": "x"})
            assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]
            r = c.post(f"http://127.0.0.1:{px2}/v1/completions", json={"prompt": "x"})
            assert r.status_code == 400
        assert not [s for s in seen if s["engine"] == "decode"]
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:8100", "http://127.0.0.1:8100"), ("http://host:80", "http://host:80"),
    ("[::1]:9000", "http://[::1]:9000"),
])
def test_normalize_url(value, expected) -> None:
    assert normalize_url(value) == expected


@pytest.mark.parametrize("value", ["host", "host:0", "host:99999", ":80"])
def test_normalize_url_rejects(value) -> None:
    with pytest.raises(ValueError, match="--decode"):
        normalize_url(value, "--decode")
