"""The prefill engine's first token in stream mode, without engines: which requests qualify (greedy, seeded, and
with ``--seed-streamed-sampling`` random sampling given a seed), the decode engine's stream after the handed-over
token (its own first token checked and removed), the race between the two legs, and a decode engine whose first
token differs (asked again to continue after the client's). Real engines: ``tests/test_e2e_first_token.py``
(stream route)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from p2pkv.grant import GRANT_KEY, STREAMED_KEY
from p2pkv.tools.proxy.app import Proxy
from p2pkv.tools.proxy.first_token import read_first_token, recompute_body
from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from p2pkv.tools.proxy.stream_hand_over import (
    FirstTokenMismatch,
    StreamedFirstTokenStream,
    hand_over_legs,
    stream_blocker,
    stream_hand_over,
)
from p2pkv.tools.proxy.validate import CHAT, COMPLETIONS
from tests.fake_engines import PROMPT_IDS, p2pkv_prefill_answer
from tests.test_proxy import metric
from tests.test_proxy_stream import SECRET, URLS, _answer_params


@pytest.mark.parametrize(("body", "reason"), [
    ({"prompt": "hi", "stream": True, "temperature": 0}, None),
    ({"prompt": "hi", "stream": True, "temperature": 0.0, "seed": 3}, None),
    ({"prompt": "hi", "stream": True}, "not greedy"),  # vLLM's default may be the model's own temperature
    ({"prompt": "hi", "stream": True, "temperature": 0.7}, "not greedy"),
    ({"prompt": "hi", "stream": True, "temperature": False}, "not greedy"),
    ({"prompt": "hi", "stream": True, "temperature": 0.7, "seed": 3}, None),  # both engines' first draw
    ({"prompt": "hi", "stream": True, "seed": 0}, None),
    ({"prompt": "hi", "temperature": 0}, "not streamed"),
    ({"prompt": "hi", "stream": True, "temperature": 0, "stop": ["\n"]}, "stop"),
])
def test_which_streamed_requests_take_the_prefill_token(body: dict, reason: str | None) -> None:
    assert stream_blocker(COMPLETIONS, body) == reason


@pytest.mark.parametrize(("body", "seed"), [
    ({"prompt": "hi", "stream": True}, True),
    ({"prompt": "hi", "stream": True, "temperature": 0.7}, True),
    ({"prompt": "hi", "stream": True, "temperature": 0.7, "seed": 5}, False),
    ({"prompt": "hi", "stream": True, "temperature": 0}, False),
])
def test_random_sampling_gets_a_seed_for_both_legs_only_when_the_proxy_seeds_streams(body: dict, seed: bool) -> None:
    legs = hand_over_legs(COMPLETIONS, body, seed=True)
    assert legs is not None and legs["return_token_ids"] is True
    drawn = legs.get("seed") if "seed" not in body else None
    assert (isinstance(drawn, int) and 0 <= drawn < 2**31) == seed
    assert {k: v for k, v in legs.items() if k not in ("seed", "return_token_ids")} == {
        k: v for k, v in body.items() if k != "seed"}
    unseeded = hand_over_legs(COMPLETIONS, body)
    assert (unseeded is None) == seed, "without --seed-streamed-sampling random sampling keeps the decode token"
    assert hand_over_legs(COMPLETIONS, {**body, "stream": False}, seed=True) is None


def _chunk(text: str, ids: list[int], **choice: Any) -> dict[str, Any]:
    """A decode engine's completions chunk for the client's prompt (asked with token ids)."""
    return {"id": "cmpl-d", "object": "text_completion", "created": 12, "model": "tiny",
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None, **choice}]}


def _writer(path: str = COMPLETIONS, **body: Any) -> StreamedFirstTokenStream:
    request = {"prompt": "hi", "stream": True, "temperature": 0, "max_tokens": 4, **body}
    first = read_first_token(path, request, p2pkv_prefill_answer(path))
    assert first is not None
    return StreamedFirstTokenStream(path, request, first)


def test_the_decode_engines_first_token_is_removed_once_found_equal() -> None:
    writer = _writer(return_token_ids=True, stream_options={"include_usage": True}, logprobs=1)
    logprobs = {"tokens": ["x", "y"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}, {}],
                "text_offset": [0, 1]}
    merged = writer.rewrite_chunk({**_chunk("xy", [7, 8], logprobs=logprobs), "prompt_token_ids": PROMPT_IDS})
    assert writer.confirmed and merged is not None and merged["id"] == "cmpl-p" and "prompt_token_ids" not in merged
    (choice,) = merged["choices"]
    assert (choice["text"], choice["token_ids"]) == ("y", [8])
    assert choice["logprobs"] == {"tokens": ["y"], "token_logprobs": [-0.2], "top_logprobs": [{}],
                                  "text_offset": [1]}  # offsets already count the first token's text
    assert writer.rewrite_chunk(_chunk("z", [9]))["choices"][0]["text"] == "z"
    usage = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                                      "total_tokens": 6}}
    assert writer.rewrite_chunk(usage) is None
    assert writer.usage_chunk["usage"]["completion_tokens"] == 3, "the decode engine counted the client's prompt"


def test_a_chunk_holding_only_the_first_token_is_dropped_and_ids_go_unless_asked() -> None:
    writer = _writer()
    assert writer.rewrite_chunk(_chunk("x", [7])) is None and writer.confirmed
    out = writer.rewrite_chunk(_chunk("y", [8]))
    assert out["choices"][0] == {"index": 0, "text": "y", "finish_reason": None}


def test_a_chat_stream_drops_the_decode_engines_role_chunk_then_its_first_token() -> None:
    writer = _writer(CHAT)
    role = {"id": "d", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}
    assert writer.rewrite_chunk(role) is None and not writer.confirmed
    logprobs = {"content": [{"token": "x", "logprob": -0.1}, {"token": "y", "logprob": -0.2}]}
    out = writer.rewrite_chunk({"id": "d", "choices": [{"index": 0, "delta": {"content": "xy"}, "token_ids": [7, 8],
                                                        "logprobs": logprobs, "finish_reason": None}]})
    assert out["choices"][0]["delta"] == {"content": "y"}
    assert out["choices"][0]["logprobs"] == {"content": [{"token": "y", "logprob": -0.2}]}


@pytest.mark.parametrize("chunk", [_chunk("q", [9]), _chunk("q", [7]), _chunk("x", [])],
                         ids=["other id", "other text", "no ids"])
def test_a_different_first_token_is_a_mismatch(chunk: dict[str, Any]) -> None:
    writer = _writer()
    with pytest.raises(FirstTokenMismatch, match="which the client already has"):
        writer.rewrite_chunk(chunk)


DECODE_URL = "http://127.0.0.1:3"


class Decode:
    """A decode engine's opened stream (what ``run_decode(relay=False)`` returns): ``chunks`` sent after
    ``start`` is set; ``closed`` once the proxy closes it."""

    def __init__(self, chunks: list[dict[str, Any] | str]) -> None:
        self.chunks = chunks
        self.start = asyncio.Event()
        self.closed = False
        self.url = httpx.URL(DECODE_URL + "/v1/completions")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        await self.start.wait()
        for chunk in self.chunks:
            yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode()

    async def aclose(self) -> None:
        self.closed = True


class Legs:
    """What :func:`stream_hand_over` needs of the proxy: its metrics, and a decode leg for a continuation
    (``continued``: the bodies it was asked with; each answers ``continuation``'s chunks)."""

    def __init__(self, continuation: list[dict[str, Any] | str] | None = None) -> None:
        self.metrics = ProxyMetrics()
        self.secret = SECRET
        self.continuation = continuation or []
        self.continued: list[dict[str, Any]] = []
        self.urls: list[str | None] = []
        self.streams: list[Decode] = []

    async def run_decode(self, client, path, body, headers, out_headers, relay=True, leg=None, url=None):  # type: ignore[no-untyped-def]
        self.continued.append(body)
        self.urls.append(url)
        decode = Decode(self.continuation)
        decode.start.set()
        self.streams.append(decode)
        return decode


def _events(raw: bytes) -> list[Any]:
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in raw.decode().split("\n\n") if e]


def _client_stream(decode: Decode, prefill_first: bool, body: dict[str, Any],
                   legs: Legs | None = None) -> tuple[list[Any], Legs]:
    """The client's events when the prefill leg answers before (or after) the decode engine's first event."""
    legs = legs or Legs()

    async def run() -> bytes:
        prefill: asyncio.Future = asyncio.get_running_loop().create_future()
        response = stream_hand_over(legs, None, decode, prefill, COMPLETIONS, body, {}, {})  # type: ignore[arg-type]
        out = b""
        iterator = response.body_iterator.__aiter__()
        if prefill_first:
            prefill.set_result(p2pkv_prefill_answer(COMPLETIONS))
        else:
            decode.start.set()
        out += await iterator.__anext__()
        prefill.done() or prefill.set_result(p2pkv_prefill_answer(COMPLETIONS))
        decode.start.set()
        async for chunk in iterator:
            out += chunk
        return out

    return _events(asyncio.run(run())), legs


BODY = {"prompt": "hi", "stream": True, "temperature": 0, "max_tokens": 3}
DECODED = [_chunk("x", [7]), _chunk("y", [8]), _chunk("z", [9], finish_reason="length"), "[DONE]"]


def test_the_prefill_token_goes_first_when_the_prefill_leg_answers_first() -> None:
    decode = Decode(DECODED)
    events, legs = _client_stream(decode, True, BODY)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y", "z"] and events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"cmpl-p"} and all("token_ids" not in e["choices"][0]
                                                                 for e in events[:-1])
    assert decode.closed
    assert metric_of(legs, "prefill") == 1 and metric_of(legs, "decode") == 0


def test_the_decode_stream_is_relayed_when_its_first_event_comes_first() -> None:
    decode = Decode(DECODED)
    events, legs = _client_stream(decode, False, BODY)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y", "z"] and events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"cmpl-d"}, "the decode engine's stream as it is"
    assert all("token_ids" not in e["choices"][0] for e in events[:-1]), "the client did not ask for token ids"
    assert metric_of(legs, "decode") == 1 and metric_of(legs, "prefill") == 0
    assert fallbacks(legs.metrics, "decode_first") == 1


CONTINUED = [_chunk("y", [8]), _chunk("w", [10], finish_reason="length"), "[DONE]"]
"""A decode engine continuing after the client's first token (token 7, ``"x"``)."""


@pytest.mark.parametrize("decoded", [[_chunk("q", [9]), _chunk("y", [8]), "[DONE]"], ["[DONE]"]],
                         ids=["another first token", "no first token"])
def test_a_decode_engine_that_does_not_continue_the_handed_over_token_is_asked_again_after_it(
        decoded: list[Any]) -> None:
    """The client already has the prefill engine's token: the decode stream that sampled another one (or none)
    is closed unread, and a decode engine asked to continue after the client's token with no KV to load (its
    prompt the prompt's ids plus that token, one token less to generate); the client's stream reads as one
    answer, no error."""
    decode = Decode(decoded)
    legs = Legs(CONTINUED)
    events, _ = _client_stream(decode, True, BODY, legs)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y", "w"] and events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"cmpl-p"} and not any("error" in e for e in events[:-1])
    assert decode.closed and all(stream.closed for stream in legs.streams)
    (continued,) = legs.continued
    assert continued["prompt"] == [*PROMPT_IDS, 7] and continued["max_tokens"] == BODY["max_tokens"] - 1
    assert "kv_transfer_params" not in continued and "return_token_ids" not in continued
    assert legs.urls == [DECODE_URL], "asked of the engine whose prefix cache holds the streamed blocks"
    text = _text(legs.metrics)
    assert metric(text, "p2pkv_proxy_first_token_mismatches_total") == 1
    assert metric(text, "p2pkv_proxy_errors_total", stage="decode") == 0


def test_a_chat_continuation_carries_the_prompt_ids_in_kv_transfer_params_alone_and_no_seed() -> None:
    first = read_first_token(CHAT, {**BODY, "messages": []}, p2pkv_prefill_answer(CHAT))
    assert first is not None
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 4}
    want = {**body, "max_completion_tokens": 3, "kv_transfer_params": {"prompt_token_ids": [*PROMPT_IDS, 7]}}
    assert recompute_body(CHAT, {**body, "seed": 3, "temperature": 0.7}, first) == {**want, "temperature": 0.7}, (
        "the seed's first draw made the first token: the continuation draws afresh")


def test_a_one_token_answer_is_the_prefill_token_and_the_decode_stream_is_closed() -> None:
    decode = Decode(DECODED)
    events, _ = _client_stream(decode, True, {**BODY, "max_tokens": 1})
    assert events[0]["choices"][0]["finish_reason"] == "length" and events[1:] == ["[DONE]"]
    assert decode.closed


def _text(metrics: ProxyMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def metric_of(legs: Legs, source: str) -> float:
    return metric(_text(legs.metrics), "p2pkv_proxy_first_tokens_total", source=source)


def fallbacks(metrics: ProxyMetrics, reason: str) -> float:
    return metric(_text(metrics), "p2pkv_proxy_first_token_fallbacks_total", reason=reason)


class Streaming(Proxy):
    """A stream proxy whose legs are recorded: the prefill leg answers at once, the decode engine's stream
    is :class:`Decode`."""

    def __init__(self) -> None:
        super().__init__(URLS, ["http://127.0.0.1:3"], 5.0, SECRET, transfer_mode="stream")
        self.prefills: list[dict[str, Any]] = []
        self.decodes: list[dict[str, Any]] = []

    async def _prefill_leg(self, client, url, path, sent, headers, leg):  # type: ignore[override]
        self.prefills.append(sent)
        answer = p2pkv_prefill_answer(path)
        answer["kv_transfer_params"][GRANT_KEY] = sent["kv_transfer_params"][GRANT_KEY]
        answer["kv_transfer_params"]["remote_engine_id"] = "p0"  # the engine the grant names: it streamed
        answer["kv_transfer_params"][STREAMED_KEY] = True
        return answer

    async def _decode(self, client, url, path, body, headers, out_headers, relay, leg):  # type: ignore[override]
        self.decodes.append(body)
        decode = Decode(DECODED)
        asyncio.get_running_loop().call_later(0.05, decode.start.set)  # the prefill leg answers first
        return decode

    async def release(self, params_list):  # type: ignore[override]
        pass


@pytest.mark.parametrize(("extra", "handed"), [({"temperature": 0}, True), ({}, False)], ids=["greedy", "random"])
def test_both_legs_are_asked_for_token_ids_only_when_the_token_may_be_handed_over(extra: dict, handed: bool) -> None:
    proxy = Streaming()
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))
    body = {"prompt": "hi", "stream": True, "max_tokens": 3, **extra}

    async def run() -> list[Any]:
        resp = await proxy.stream_legs(None, COMPLETIONS, body, {}, {})  # type: ignore[arg-type]
        if not handed:
            return []
        return _events(b"".join([chunk async for chunk in resp.body_iterator]))

    events = asyncio.run(run())
    (prefill,), (decode,) = proxy.prefills, proxy.decodes
    assert (prefill.get("return_token_ids") is True) == handed == (decode.get("return_token_ids") is True)
    if handed:
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y", "z"]
        assert {e["id"] for e in events[:-1]} == {"cmpl-p"}, "the first token came from the prefill leg"
    assert metric(_text(proxy.metrics), "p2pkv_proxy_first_tokens_total", source="prefill" if handed else
                  "decode") == 1
    assert fallbacks(proxy.metrics, "sampling") == (0 if handed else 1)  # unseeded random sampling


def test_a_client_gone_before_the_first_byte_closes_the_decode_stream_and_ends_the_leg_once() -> None:
    """The client leaves before anything was sent: the decode stream is still closed (its engine aborts the
    request) and the decode leg's end reported once (the proxy frees the prefill hold then)."""
    decode = Decode(DECODED)  # never sends: its first event and the prefill's answer never come
    ended: list[int] = []

    async def run() -> None:
        prefill: asyncio.Future = asyncio.get_running_loop().create_future()
        response = stream_hand_over(Legs(), None, decode, prefill, COMPLETIONS, BODY, {}, {},  # type: ignore[arg-type]
                                    on_end=lambda: ended.append(1))

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the server learns of the disconnect from the failed send
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            raise OSError("the client is gone")  # at the headers: the body is never read

        with contextlib.suppress(Exception):
            await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 5)

    asyncio.run(run())
    assert decode.closed and ended == [1]
