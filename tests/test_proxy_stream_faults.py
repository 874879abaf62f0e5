"""A streamed prompt whose prefill leg fails, or answers for another engine id (a restart), without engines.

In stream mode the decode leg is already under way when the prefill leg ends. A failed prefill leg used to
leave the decode leg waiting for its stream until ``stream_timeout_s`` (64.6 s before an HTTP 502, measured);
now the decode leg is cancelled and the client gets the prefill leg's error at once. A prefill engine that
restarted refuses the old grant and holds the prompt for a push: its decode leg goes again with those params and
the client gets the answer instead of an error. The engines are replaced by the proxy's two HTTP calls, as in
tests/test_proxy_stream.py; real engines: tests/test_e2e_stream.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from fastapi.responses import Response

from p2pkv.grant import GRANT_KEY, STREAMED_KEY
from p2pkv.tools.proxy.app import Proxy
from p2pkv.tools.proxy.fanout import Batch
from p2pkv.tools.proxy.upstream import UpstreamError
from tests.test_proxy_stream import URLS, _answer_params

SECRET = b"s" * 32
BODY = {"prompt": "hi", "max_tokens": 3}


class NeverStreams(httpx.Response):
    """A decode engine's stream: ``events``, then (``waits``) nothing more for ever (it waits for KV that will not
    come)."""

    def __init__(self, events: list[str] | None = None, waits: bool = True) -> None:
        super().__init__(200, request=httpx.Request("POST", "http://127.0.0.1:3/v1/completions"))
        self.events, self.waits = events or [], waits
        self.closed = False

    async def aiter_raw(self):  # type: ignore[no-untyped-def]
        for data in self.events:
            yield f"data: {data}\n\n".encode()
        if self.waits:
            await asyncio.sleep(3600)

    async def aclose(self) -> None:
        self.closed = True


class Faulty(Proxy):
    """A stream proxy whose prefill leg ends as ``prefill`` says after ``after_s``, whose first decode leg
    waits for ever (or fails with ``decode_fails``), and whose later decode legs answer at once."""

    run_decode = Proxy.run_decode

    def __init__(self, prefill: str, decode_fails: bool = False, first_events: list[str] | None = None) -> None:
        super().__init__(URLS, ["http://127.0.0.1:3"], 30.0, SECRET, transfer_mode="stream")
        assert self.streams is not None
        self.streams.learn(URLS[0], _answer_params("p0", 7000))
        self.prefill_ends, self.decode_fails, self.first_events = prefill, decode_fails, first_events
        self.decodes: list[dict[str, Any]] = []
        self.cancelled = 0
        self.released: list[dict[str, Any]] = []
        self.stream = NeverStreams(first_events, waits=not first_events or first_events[-1] != "[DONE]")

    async def prefill_engine(self, request: httpx.Request) -> httpx.Response:
        """The prefill engine behind the proxy's real prefill leg (a mock transport): it fails, or answers for
        the grant's engine or a restarted one."""
        await asyncio.sleep(0.05)
        if self.prefill_ends == "fails":
            raise httpx.ConnectError("connection refused", request=request)
        engine = "p0-restarted" if self.prefill_ends == "restarted" else "p0"
        params = {**_answer_params(engine, 7000), **({STREAMED_KEY: True} if self.prefill_ends == "streamed" else {})}
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})

    async def _decode(self, client, url, path, body, headers, out_headers, relay, leg):  # type: ignore[override]
        self.decodes.append(body)
        if GRANT_KEY not in body["kv_transfer_params"]:  # the leg sent again (no stream): answered at once
            if body.get("stream") is True:
                return NeverStreams([json.dumps({"choices": [{"index": 0, "text": "again"}]}), "[DONE]"], waits=False)
            return Response(json.dumps({"choices": [{"index": 0, "text": "again"}]}).encode(),
                            media_type="application/json")
        if body.get("stream") is True:
            return self.stream
        if self.decode_fails:
            raise UpstreamError(502, "decode engine answered HTTP 500", "decode", url)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")

    async def release(self, params_list):  # type: ignore[override]
        self.released += params_list


def _client(proxy: Faulty) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(proxy.prefill_engine))


def _whole(proxy: Faulty) -> tuple[Any, float]:
    async def run() -> Any:
        async with _client(proxy) as client:
            try:
                return await proxy.stream_legs(client, "/v1/completions", dict(BODY), {}, {})
            except UpstreamError as exc:
                return exc

    start = time.monotonic()
    return asyncio.run(asyncio.wait_for(run(), 10)), time.monotonic() - start


def _streamed(proxy: Faulty, extra: dict[str, Any]) -> tuple[list[Any], float]:
    async def run() -> list[Any]:
        async with _client(proxy) as client:
            resp = await proxy.stream_legs(client, "/v1/completions", {**BODY, "stream": True, **extra}, {}, {})
            raw = b"".join([chunk async for chunk in resp.body_iterator])
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                for line in raw.decode().splitlines() if line.startswith("data: ")]

    start = time.monotonic()
    return asyncio.run(asyncio.wait_for(run(), 10)), time.monotonic() - start


def test_a_failed_prefill_leg_ends_a_whole_answer_at_once_with_its_error() -> None:
    proxy = Faulty("fails")
    got, seconds = _whole(proxy)
    assert isinstance(got, UpstreamError) and got.stage == "prefill" and "connection refused" in got.message
    assert seconds < 2.0 and proxy.cancelled == 1, "the decode leg was left waiting for its stream"


@pytest.mark.parametrize("extra", [{"temperature": 0}, {}], ids=["handed_over", "decode_first"])
def test_a_failed_prefill_leg_ends_a_streamed_answer_at_once_with_its_error(extra: dict) -> None:
    proxy = Faulty("fails")
    events, seconds = _streamed(proxy, extra)
    assert seconds < 2.0 and proxy.stream.closed, "the decode stream was left waiting for its KV"
    assert events[-1] == "[DONE]" and events[0]["error"]["stage"] == "prefill", events


def test_an_answer_for_another_engine_sends_the_decode_leg_again_with_its_params() -> None:
    """The prefill engine restarted since its address was learned: the new process refused the old grant and
    held the prompt for a push. The decode leg goes again with its params; the first leg's end frees nothing."""
    proxy = Faulty("restarted")
    got, _ = _whole(proxy)
    assert isinstance(got, Response) and json.loads(got.body)["choices"][0]["text"] == "again"
    first, again = proxy.decodes
    assert GRANT_KEY in first["kv_transfer_params"] and again["kv_transfer_params"]["remote_engine_id"] == \
        "p0-restarted"
    assert proxy.cancelled == 1 and proxy.released == [], "the hold the second leg loads was freed"
    assert proxy.streams is not None and proxy.streams.addresses[URLS[0]].engine_id == "p0-restarted", \
        "the restarted engine was not re-learned"


def test_a_decode_leg_that_failed_before_the_restarted_engines_answer_goes_again() -> None:
    proxy = Faulty("restarted", decode_fails=True)
    got, _ = _whole(proxy)
    assert isinstance(got, Response) and json.loads(got.body)["choices"][0]["text"] == "again"
    assert len(proxy.decodes) == 2 and proxy.released == []


def test_a_streamed_decode_leg_whose_first_event_is_its_failure_goes_again_after_a_restart() -> None:
    failed = json.dumps({"error": {"message": "Internal server error", "code": 500}})
    proxy = Faulty("restarted", first_events=[failed])
    events, _ = _streamed(proxy, {"temperature": 0})
    assert [e["choices"][0]["text"] for e in events if e != "[DONE]"] == ["again"], events
    assert proxy.stream.closed and proxy.released == []


def test_a_grant_the_prefill_engine_refused_sends_the_decode_leg_again_with_its_hold() -> None:
    """The prefill engine answered for the grant's engine, with a hold, but did not stream it (its answer lacks
    the streamed mark: it refused the grant, say one expired in its queue): the decode leg goes again as a push."""
    proxy = Faulty("streamed")
    proxy.prefill_ends = "held"
    got, _ = _whole(proxy)
    assert isinstance(got, Response) and json.loads(got.body)["choices"][0]["text"] == "again"


def test_a_streamed_prompt_that_streams_is_left_alone() -> None:
    """The prefill leg answers for the grant's engine (it streamed): nothing is sent again."""
    done = json.dumps({"choices": [{"index": 0, "text": "z", "finish_reason": "length"}]})
    proxy = Faulty("streamed", first_events=[done, "[DONE]"])
    events, _ = _streamed(proxy, {})
    assert len(proxy.decodes) == 1 and [e["choices"][0]["text"] for e in events if e != "[DONE]"] == ["z"]


def test_a_failed_prefill_leg_ends_a_batch_of_streamed_prompts_at_once() -> None:
    """Each prompt of a list streams under its own grant; their prefill legs fail: the batch answers the prefill
    leg's error at once, its decode legs cancelled."""
    proxy = Faulty("fails")

    async def run() -> Any:
        async with _client(proxy) as client:
            batch = Batch(proxy, client, "/v1/completions", {}, {}, max_fanout=2)
            try:
                return await batch.answers([{**BODY, "prompt": "a"}, {**BODY, "prompt": "b"}])
            except UpstreamError as exc:
                return exc

    start = time.monotonic()
    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert isinstance(got, UpstreamError) and got.stage == "prefill", got
    assert time.monotonic() - start < 2.0 and proxy.cancelled >= 1


def test_a_failed_prefill_leg_ends_a_streamed_list_of_streamed_prompts_at_once() -> None:
    """The same for a list of prompts answered as one SSE stream: the batch's answer is the prefill leg's error,
    at once, and the decode streams are closed (their engines give the streams up)."""
    proxy = Faulty("fails")

    async def run() -> Any:
        async with _client(proxy) as client:
            batch = Batch(proxy, client, "/v1/completions", {}, {}, max_fanout=2)
            try:
                return await batch.stream([{**BODY, "prompt": "a", "stream": True},
                                           {**BODY, "prompt": "b", "stream": True}])
            except UpstreamError as exc:
                return exc

    start = time.monotonic()
    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert isinstance(got, UpstreamError) and got.stage == "prefill", got
    assert time.monotonic() - start < 2.0 and proxy.stream.closed


@pytest.mark.parametrize("first_events", [None, [json.dumps({"error": {"message": "Internal server error",
                                                                      "code": 500}})]],
                         ids=["no_event_yet", "first_event_its_failure"])
def test_a_streamed_list_whose_prefill_engine_restarted_sends_each_decode_leg_again(first_events: Any) -> None:
    """A list of prompts answered as one SSE stream, its prefill engine restarted since its address was learned:
    each prompt's decode leg goes again with the new process's params (before the first decode stream's first
    event, or after that event was its failure), the client gets every prompt's answer, and no hold those legs
    load is freed."""
    proxy = Faulty("restarted", first_events=first_events)

    async def run() -> list[Any]:
        async with _client(proxy) as client:
            batch = Batch(proxy, client, "/v1/completions", {}, {}, max_fanout=2)
            resp = await batch.stream([{**BODY, "prompt": "a", "stream": True},
                                       {**BODY, "prompt": "b", "stream": True}])
            raw = b"".join([chunk async for chunk in resp.body_iterator])
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                for line in raw.decode().splitlines() if line.startswith("data: ")]

    events = asyncio.run(asyncio.wait_for(run(), 10))
    texts = sorted(c["text"] for e in events if e != "[DONE]" for c in e["choices"] if c.get("text"))
    assert texts == ["again", "again"] and not any("error" in e for e in events if e != "[DONE]"), events
    assert [GRANT_KEY in d["kv_transfer_params"] for d in proxy.decodes].count(False) == 2, proxy.decodes
    assert proxy.stream.closed and proxy.released == [], "a hold the legs sent again load was freed"


@pytest.mark.parametrize("error", [httpx.ReadError, httpx.RemoteProtocolError])
def test_a_prefill_leg_whose_connection_drops_is_sent_once_more(error: type[httpx.TransportError]) -> None:
    """The prefill engine's server drops the connection once (a pooled connection closed under load): the leg is
    sent again and answered; dropped twice, the client gets a 502 naming the engine."""
    sent: list[httpx.Request] = []

    def drops(times: int):  # type: ignore[no-untyped-def]
        async def engine(request: httpx.Request) -> httpx.Response:
            sent.append(request)
            if len(sent) <= times:
                raise error("", request=request)
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}],
                                             "kv_transfer_params": _answer_params("p0", 7000)})
        return engine

    async def leg(times: int) -> Any:
        sent.clear()
        proxy = Proxy(URLS[:1], ["http://127.0.0.1:3"], 30.0, SECRET)
        async with httpx.AsyncClient(transport=httpx.MockTransport(drops(times))) as client:
            try:
                return await proxy.run_prefill(client, "/v1/completions", dict(BODY), {})
            except UpstreamError as exc:
                return exc

    answer = asyncio.run(leg(1))
    assert answer["kv_transfer_params"]["remote_engine_id"] == "p0" and len(sent) == 2
    failed = asyncio.run(leg(2))
    assert isinstance(failed, UpstreamError) and failed.status == 502 and URLS[0] in failed.message
    assert len(sent) == 2
