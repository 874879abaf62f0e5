"""Streamed answers whose client leaves before the first byte (the body is never iterated, so its own ``finally``
never runs): what the answer holds is still let go (:class:`p2pkv.tools.proxy.closing.ClosingStream`).

* The first-token hand-over of pull and push mode frees the prefill hold its decode engine was never asked to
  load, once (also when the first token ended the answer, or the answer went out whole), and the hold of a
  client that leaves while the decode leg is being sent (the decode engine may never see it); not the hold of a
  decode stream that began (its engine's pull or notify-only pull ends it).
* A batch of streamed prompts stops its pairs: every decode stream is closed (its engine aborts the request,
  instead of generating for nobody) and every decode leg is reported ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from p2pkv.tools.proxy.fanout import Batch
from p2pkv.tools.proxy.first_token import FirstToken
from p2pkv.tools.proxy.hand_over import hand_over_stream
from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from tests.test_proxy_stream import Recorded

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}
PARAMS = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()  # the server learns of the disconnect from the failed send
    return {"type": "http.disconnect"}


async def _gone(message: dict[str, Any]) -> None:
    raise OSError("the client is gone")  # at the headers: the body is never read


async def _read_whole(message: dict[str, Any]) -> None:
    pass


class Legs:
    """What :func:`hand_over_stream` needs of the proxy; the decode leg is never asked here."""

    def __init__(self) -> None:
        self.metrics = ProxyMetrics()
        self.secret = None
        self.released: list[list[dict[str, Any]]] = []
        self.asked = 0

    async def run_decode(self, *args: Any, **kwargs: Any) -> httpx.Response:
        self.asked += 1
        raise AssertionError("the decode engine is not asked in these tests")

    async def release(self, params_list: list[dict[str, Any]]) -> None:
        self.released.append(params_list)


def _first(finish_reason: str | None) -> FirstToken:
    return FirstToken(token_id=7, text="x", finish_reason=finish_reason, stop_reason=None, prompt_token_ids=[1, 2],
                      logprobs=None, id="cmpl-p", created=0, model="model")


@pytest.mark.parametrize(("finish_reason", "send"), [(None, _gone), ("length", _gone), ("length", _read_whole)],
                         ids=["gone_before_first_byte", "one_token_gone", "one_token_read"])
def test_a_hand_over_whose_decode_engine_was_never_asked_frees_the_hold_once(finish_reason: str | None,
                                                                             send: Any) -> None:
    legs = Legs()
    body = {"prompt": "hi", "max_tokens": 1 if finish_reason else 4, "stream": True}

    async def run() -> None:
        response = hand_over_stream(legs, None, "/v1/completions", body, _first(finish_reason),  # type: ignore[arg-type]
                                    PARAMS, {}, {})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(response(SCOPE, _never_disconnects, send), 5)

    asyncio.run(run())
    assert legs.released == [[PARAMS]] and legs.asked == 0


class Sending(Legs):
    """A proxy whose decode leg is still being sent (connecting, say) when the client leaves."""

    async def run_decode(self, *args: Any, **kwargs: Any) -> httpx.Response:
        self.asked += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class Answering(Legs):
    """A proxy whose decode engine answers the continuation: one token, then the end."""

    async def run_decode(self, *args: Any, **kwargs: Any) -> httpx.Response:
        self.asked += 1
        event = ('data: {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "model", "choices": '
                 '[{"index": 0, "text": "y", "logprobs": null, "finish_reason": "length", "stop_reason": null}]}'
                 '\n\ndata: [DONE]\n\n')
        return httpx.Response(200, stream=httpx.ByteStream(event.encode()),
                              request=httpx.Request("POST", "http://127.0.0.1:3/v1/completions"))


@pytest.mark.parametrize(("legs", "released"), [(Sending, [[PARAMS]]), (Answering, [])],
                         ids=["left_while_the_decode_leg_is_sent", "decode_stream_began"])
def test_a_hand_over_frees_the_hold_unless_its_decode_stream_began(legs: type[Legs], released: list) -> None:
    """The client reads the first token and leaves: the hold is freed unless the decode engine's stream began."""
    proxy = legs()
    body = {"prompt": "hi", "max_tokens": 4, "stream": True}
    first_sent = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            first_sent.set()

    async def receive() -> dict[str, Any]:
        await first_sent.wait()
        if legs is Answering:  # reads the whole answer
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        response = hand_over_stream(proxy, None, "/v1/completions", body, _first(None),  # type: ignore[arg-type]
                                    PARAMS, {}, {})
        await asyncio.wait_for(response(SCOPE, receive, send), 5)

    asyncio.run(run())
    assert proxy.asked == 1 and proxy.released == released
    assert (b'"text": "y"' in b"".join(sent)) is (legs is Answering)


class Endless(httpx.AsyncByteStream):
    """The body of a decode engine's opened stream that sends nothing until closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    async def aclose(self) -> None:
        self.closed = True


class Opened(Recorded):
    """A proxy whose decode legs open :class:`Endless` streams and whose decode legs' ends are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[Endless] = []
        self.ended: list[dict[str, Any]] = []

    async def run_decode(self, client, path, body, headers, out_headers, relay=True, leg=None):  # type: ignore[override]
        self.opened.append(Endless())
        return httpx.Response(200, stream=self.opened[-1],
                              request=httpx.Request("POST", "http://127.0.0.1:3/v1/completions"))

    def decode_ended(self, body: dict[str, Any]) -> None:
        self.ended.append(body)


def test_a_batch_stream_whose_client_left_before_the_first_byte_stops_its_pairs() -> None:
    proxy = Opened()
    bodies = [{"prompt": p, "max_tokens": 4, "stream": True} for p in ("a", "b")]

    async def run() -> None:
        batch = Batch(proxy, None, "/v1/completions", {}, {}, max_fanout=2)  # type: ignore[arg-type]
        response = await batch.stream(bodies)
        while len(proxy.opened) < 2:  # both pairs' decode streams open
            await asyncio.sleep(0.01)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(response(SCOPE, _never_disconnects, _gone), 5)
        for _ in range(100):  # the cancelled pairs run their cleanup
            if len(proxy.ended) == 2:
                break
            await asyncio.sleep(0.01)
        # checked while the loop runs: asyncio.run cancels what is left when it returns
        assert [s.closed for s in proxy.opened] == [True, True]
        assert sorted(e["prompt"] for e in proxy.ended) == ["a", "b"]

    asyncio.run(run())
