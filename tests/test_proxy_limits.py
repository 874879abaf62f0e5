"""What the proxy accepts (body size, JSON types, prompt count) and how many prefill/decode pairs a batch runs at
once; fake engines over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from p2pkv.tools.proxy import create_app
from p2pkv.tools.proxy.validate import CHAT, COMPLETIONS
from tests.fake_engines import CHUNKS, ERROR_BODY, Concurrency, FakeEngine, Served, fresh, stop_all

LIMIT = 4096
"""The test proxy's --max-body-bytes."""
FANOUT, MAX_PROMPTS = 3, 16


@dataclass
class Pair:
    p: FakeEngine
    d: FakeEngine
    proxy: str  # --max-body-bytes LIMIT, --max-fanout FANOUT, --max-prompts MAX_PROMPTS
    serial: str  # --max-fanout 1

    def url(self, path: str = "/v1/completions") -> str:
        return f"{self.proxy}{path}"

    def asked(self) -> int:
        return len(self.p.seen) + len(self.d.seen)


@pytest.fixture(scope="module")
def limits_servers() -> Iterator[Pair]:
    p, d = FakeEngine("p", "prefill"), FakeEngine("d", "decode")
    engines = [Served(e.app) for e in (p, d)]
    urls = [[s.url] for s in engines]
    proxies = [Served(create_app(*urls, 10.0, max_body_bytes=LIMIT, max_fanout=FANOUT, max_prompts=MAX_PROMPTS)),
               Served(create_app(*urls, 10.0, max_fanout=1))]
    yield Pair(p, d, *(s.url for s in proxies))
    stop_all(*proxies, *engines)


@pytest.fixture
def limited_pair(limits_servers: Pair) -> Pair:
    return fresh(limits_servers, limits_servers.p, limits_servers.d)


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


# ---- body size ----------------------------------------------------------------------------------------------


def _body_of(size: int) -> bytes:
    """A JSON completions body of exactly ``size`` bytes."""
    head = b'{"prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_body_at_the_limit_is_served(limited_pair: Pair, client: httpx.Client) -> None:
    r = client.post(limited_pair.url(), content=_body_of(LIMIT), headers={"content-type": "application/json"})
    assert r.status_code == 200 and len(limited_pair.d.seen) == 1


def test_body_over_the_limit_is_413_from_content_length(limited_pair: Pair, client: httpx.Client) -> None:
    err = _error(client.post(limited_pair.url(), content=_body_of(LIMIT + 1)), 413)
    assert str(LIMIT) in err["message"] and "--max-body-bytes" in err["message"]
    assert limited_pair.asked() == 0


def test_chunked_body_over_the_limit_is_413_without_reading_it_all() -> None:
    """No Content-Length: the proxy counts while the body streams in and stops reading at the limit (the app is
    called in-process, so the test sees how much of the body it asked for)."""
    pulled = [0]
    total, chunk = 64 * 1024 * 1024, 1024

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        while pulled[0] < total:
            pulled[0] += chunk
            yield b"x" * chunk
        yield b'"}'

    async def post() -> httpx.Response:
        app = create_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], max_body_bytes=LIMIT)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            return await c.post("/v1/completions", content=chunks())

    err = _error(asyncio.run(post()), 413)
    assert str(LIMIT) in err["message"] and "--max-body-bytes" in err["message"]
    assert pulled[0] <= LIMIT + chunk, f"the proxy read {pulled[0]} bytes of a body over {LIMIT}"


def test_a_413_closes_the_connection_so_the_client_stops_sending(limited_pair: Pair, client: httpx.Client) -> None:
    """Over real HTTP: the server does not drain the rest of an oversized chunked upload."""
    sent, total = [0], 256 * 1024 * 1024

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        while sent[0] < total:
            sent[0] += 64 * 1024
            yield b"x" * (64 * 1024)
        yield b'"}'

    try:
        r: httpx.Response | None = client.post(limited_pair.url(), content=chunks())
    except httpx.TransportError:  # the proxy closed while the client was still writing: also a refusal
        r = None
    if r is not None:
        assert _error(r, 413)["code"] == 413 and r.headers["connection"] == "close"
    assert sent[0] < total // 8, f"the client sent {sent[0]} bytes of an oversized body"
    assert limited_pair.asked() == 0


# ---- JSON types ---------------------------------------------------------------------------------------------

BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (COMPLETIONS, {"prompt": ["a", "b"], "stream": 1}, "stream"),  # was a 500: the engines streamed, json.loads broke
    (COMPLETIONS, {"prompt": "a", "stream": "yes"}, "stream"),
    (CHAT, {"messages": [], "stream": 1}, "stream"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "a"}}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], ["a"]]}, "prompt"),
    (COMPLETIONS, {"prompt": [[[1]]]}, "prompt"),
    (COMPLETIONS, {"prompt": [True, False]}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": ["hi"]}, "messages"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 8.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": True}, "max_tokens"),
    (CHAT, {"messages": [], "max_completion_tokens": [4]}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "a", "min_tokens": "2"}, "min_tokens"),
    (COMPLETIONS, {"prompt": "a", "n": "1"}, "n"),
    (COMPLETIONS, {"prompt": "a", "n": True}, "n"),
    (COMPLETIONS, {"prompt": "a", "best_of": 1.0}, "best_of"),
    (COMPLETIONS, {"prompt": "a", "seed": "3"}, "seed"),
    (COMPLETIONS, {"prompt": "a", "temperature": "0"}, "temperature"),
    (COMPLETIONS, {"prompt": "a", "return_token_ids": 1}, "return_token_ids"),
    (COMPLETIONS, {"prompt": "a", "kv_transfer_params": "x"}, "kv_transfer_params"),
    (COMPLETIONS, {"prompt": "a", "kv_transfer_params": [1]}, "kv_transfer_params"),
    (COMPLETIONS, {"prompt": "a", "stream": True, "stream_options": True}, "stream_options"),
    (COMPLETIONS, {"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (CHAT, {"messages": [], "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_FIELDS,
                         ids=[f"{f}={json.dumps(b.get(f, b))[:20]}" for _, b, f in BAD_FIELDS])
def test_a_field_of_the_wrong_type_is_400_naming_it(limited_pair: Pair, client: httpx.Client, path: str,
                                                    body: dict[str, Any], field: str) -> None:
    err = _error(client.post(limited_pair.url(path), json=body), 400)
    assert err["param"] == field and field in err["message"]
    assert limited_pair.asked() == 0


@pytest.mark.parametrize(("content", "expected"), [
    (b"[1, 2]", "JSON object, got array"), (b'"text"', "JSON object, got string"), (b"null", "got null"),
    (b"{not json", "not JSON"), (b"[" * 4000, "not JSON"), (b"\xff\xfe", "not JSON"),
], ids=["array", "string", "null", "broken", "deep", "not-utf8"])
def test_a_body_that_is_not_an_object_is_400(limited_pair: Pair, client: httpx.Client, content: bytes,
                                             expected: str) -> None:
    err = _error(client.post(limited_pair.url(), content=content), 400)
    assert expected in err["message"]
    assert limited_pair.asked() == 0


@pytest.mark.parametrize("body", [
    {"prompt": "a", "stream": None, "max_tokens": None, "n": None, "stream_options": None, "temperature": 0},
    {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.5, "seed": 1, "n": 1, "kv_transfer_params": {}},
    {"prompt": [[1, 2], [3]], "stream": False},
], ids=["nulls", "token-ids", "token-id-lists"])
def test_well_typed_bodies_pass(limited_pair: Pair, client: httpx.Client, body: dict[str, Any]) -> None:
    assert client.post(limited_pair.url(), json=body).status_code == 200


def test_more_prompts_than_the_cap_is_400_naming_the_flag(limited_pair: Pair, client: httpx.Client) -> None:
    assert client.post(limited_pair.url(), json={"prompt": ["a"] * MAX_PROMPTS}).status_code == 200
    limited_pair.p.reset()
    limited_pair.d.reset()
    err = _error(client.post(limited_pair.url(), json={"prompt": [[1]] * (MAX_PROMPTS + 1)}), 400)
    assert err["param"] == "prompt" and f"--max-prompts {MAX_PROMPTS}" in err["message"]
    assert limited_pair.asked() == 0


# ---- bounded fan-out ----------------------------------------------------------------------------------------


def _slow_pairs(limited_pair: Pair) -> Concurrency:
    tracker = Concurrency()
    for e in (limited_pair.p, limited_pair.d):
        e.tracker, e.delay_s = tracker, 0.05
    return tracker


def test_a_batch_runs_at_most_max_fanout_pairs_at_once(limited_pair: Pair, client: httpx.Client) -> None:
    tracker = _slow_pairs(limited_pair)
    prompts = [f"p{i}" for i in range(12)]
    r = client.post(limited_pair.url(), json={"prompt": prompts, "max_tokens": 4})
    assert r.status_code == 200
    assert [(c["index"], c["text"]) for c in r.json()["choices"]] == [(i, "decoded") for i in range(12)]
    assert tracker.peak == FANOUT  # both engines together: never more than FANOUT requests in flight
    prompts_seen = [sorted(s["body"]["prompt"] for s in e.seen) for e in (limited_pair.p, limited_pair.d)]
    assert prompts_seen == [sorted(prompts)] * 2


def test_a_streamed_batch_runs_at_most_max_fanout_pairs_at_once(limited_pair: Pair, client: httpx.Client) -> None:
    tracker = _slow_pairs(limited_pair)
    with client.stream("POST", limited_pair.url(), json={"prompt": [f"p{i}" for i in range(9)], "stream": True}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    per_prompt = len(CHUNKS) - 1
    assert sorted(c["choices"][0]["index"] for c in chunks) == sorted(list(range(9)) * per_prompt)
    assert tracker.peak == FANOUT


def test_a_failed_pair_stops_the_batch(limited_pair: Pair, client: httpx.Client) -> None:
    """One pair at a time: the second prompt's decode leg fails, its error is the answer, later prompts never
    reach an engine."""
    limited_pair.d.fail_prompt = "p1"
    r = client.post(f"{limited_pair.serial}/v1/completions", json={"prompt": ["p0", "p1", "p2", "p3"]})
    assert r.status_code == 400 and r.json() == ERROR_BODY
    assert [s["body"]["prompt"] for s in limited_pair.p.seen] == ["p0", "p1"]
    assert [s["body"]["prompt"] for s in limited_pair.d.seen] == ["p0", "p1"]


def test_a_streamed_batch_reports_a_later_failure_in_the_stream(limited_pair: Pair, client: httpx.Client) -> None:
    limited_pair.d.fail_prompt = "p1"
    body = {"prompt": ["p0", "p1", "p2"], "stream": True}
    with client.stream("POST", f"{limited_pair.serial}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["code"] == 400 and errors[0]["stage"] == "decode"
    indices = {json.loads(e)["choices"][0]["index"] for e in events[:-1] if "choices" in json.loads(e)}
    assert indices == {0, 2}  # the prompts after the failed one still ran


def test_a_streamed_batch_failing_first_answers_the_error(limited_pair: Pair, client: httpx.Client) -> None:
    limited_pair.d.fail_prompt = "p0"
    r = client.post(f"{limited_pair.serial}/v1/completions", json={"prompt": ["p0", "p1"], "stream": True})
    assert r.status_code == 400 and r.json() == ERROR_BODY
    assert [s["body"]["prompt"] for s in limited_pair.p.seen] == ["p0"]  # the batch stopped before p1's prefill
