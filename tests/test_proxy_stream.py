"""The proxy's layer-streamed dispatch without engines: what it learns, which engine it asks, the legs it sends.

The legs it would send to engines are recorded by replacing the proxy's two
HTTP calls; the grants are checked with the real :func:`p2pkv.grant.check_stream_grant`.
Real engines behind a stream proxy: tests/test_e2e_stream.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from fastapi.responses import Response

from p2pkv.grant import ANY_DECODE, GRANT_KEY, StreamGrantError, check_stream_grant
from p2pkv.params import make_prefill_response_params
from p2pkv.tools.proxy.app import Proxy
from p2pkv.tools.proxy.fanout import Batch
from p2pkv.tools.proxy.upstream import UpstreamError

SECRET = b"s" * 32
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _answer_params(engine_id: str, port: int, secret: bytes | None = SECRET) -> dict[str, Any]:
    """What a prefill engine answers for a held prompt (signed with ``secret``; None: unsigned)."""
    return make_prefill_response_params(engine_id=engine_id, request_id="r1", host="127.0.0.1", port=port,
                                        block_ids=[1, 2], tp_size=1, num_tokens=20, expiry_time=time.time() + 60,
                                        secret=secret)


class Recorded(Proxy):
    """A stream proxy whose engine calls are recorded: prefill legs as ``(url, body)``, decode legs' bodies."""

    def __init__(self) -> None:
        super().__init__(URLS, ["http://127.0.0.1:3"], 5.0, SECRET, transfer_mode="stream")
        self.prefills: list[tuple[str, dict[str, Any]]] = []
        self.decodes: list[dict[str, Any]] = []

    async def _prefill_leg(self, client, url, path, sent, headers, leg):  # type: ignore[override]
        self.prefills.append((url, sent))
        return {"kv_transfer_params": {}}

    async def run_prefill(self, client, path, body, headers, leg=None, turn=None):  # type: ignore[override]
        url = self.prefill.next()
        self.prefills.append((url, body))
        return {"kv_transfer_params": {"pushed": url}}

    async def run_decode(self, client, path, body, headers, out_headers, relay=True, leg=None):  # type: ignore[override]
        self.decodes.append(body)
        index = len(self.decodes) - 1
        return Response(json.dumps({"id": "x", "choices": [{"index": 0, "text": str(index)}]}).encode(),
                        media_type="application/json")


def test_only_an_answer_signed_with_the_secret_teaches_an_address() -> None:
    proxy = Recorded()
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p-unsigned", 7000, secret=None))
    proxy.streams.learn(URLS[0], _answer_params("p-other", 7000, secret=b"o" * 32))
    proxy.streams.learn(URLS[0], {"kv_connector": "P2pKvConnector", "p2pkv_no_hold": "role decode"})
    assert proxy.streams.addresses == {}
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))
    address = proxy.streams.addresses[URLS[0]]
    assert (address.engine_id, address.host, address.port, address.tp_size) == ("p0", "127.0.0.1", 7000, 1)
    staged = make_prefill_response_params(engine_id="p0", request_id="r2", host="127.0.0.1", port=7000,
                                          block_ids=[1, 2], tp_size=1, pp_size=2, num_tokens=20,
                                          expiry_time=time.time() + 60, secret=SECRET)
    proxy.streams.learn(URLS[0], staged)
    assert proxy.streams.addresses[URLS[0]].pp_size == 2  # its decode legs name every stage's workers
    legs = proxy.streams.legs(URLS[0], {"prompt": "x", "max_tokens": 4})
    assert legs is not None and legs[1]["pp_size"] == 2
    for leg in legs:  # the grant both legs carry names the stages: the engine and the decode leg check it so
        check_stream_grant(leg["kv_transfer_params"][GRANT_KEY] if "kv_transfer_params" in leg else leg[GRANT_KEY],
                           SECRET, prefill_engine_id="p0", decode_engine_id=ANY_DECODE, now=time.time(), pp_size=2)
    with pytest.raises(StreamGrantError, match=r"\(pp_size 1\)"):
        check_stream_grant(legs[1][GRANT_KEY], SECRET, prefill_engine_id="p0", decode_engine_id=ANY_DECODE,
                           now=time.time())


def test_an_engine_not_learned_yet_gets_the_push_that_teaches_it() -> None:
    """With two prefill engines, one learned: the unlearned one is not skipped by the round robin (it would
    never be learned), and the learned one gets both legs at once under a grant for any decode engine."""
    proxy = Recorded()
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))

    async def run() -> None:
        for _ in range(3):
            await proxy.stream_legs(None, "/v1/completions", {"prompt": "hi", "max_tokens": 3}, {}, {})  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the background prefill legs run

    asyncio.run(run())
    assert sorted(url for url, _ in proxy.prefills) == [URLS[0], URLS[0], URLS[1]]
    assert proxy.decodes[1]["kv_transfer_params"] == {"pushed": URLS[1]}
    streamed = [proxy.decodes[0], proxy.decodes[2]]
    sent = [body for url, body in proxy.prefills if url == URLS[0]]
    for prefill, decode in zip(sent, streamed, strict=True):
        params = decode["kv_transfer_params"]
        assert params["remote_engine_id"] == "p0" and params["remote_port"] == 7000
        assert prefill["kv_transfer_params"][GRANT_KEY] == params[GRANT_KEY]
        assert prefill["max_tokens"] == 1 and decode["max_tokens"] == 3
        check_stream_grant(params[GRANT_KEY], SECRET, prefill_engine_id="p0", decode_engine_id=ANY_DECODE,
                           now=time.time())



class Hanging(Recorded):
    """A stream proxy whose decode engine never answers, and whose releases are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[dict[str, Any]] = []
        self.decoding = asyncio.Event()

    async def run_decode(self, client, path, body, headers, out_headers, relay=True, leg=None):  # type: ignore[override]
        self.decodes.append(body)
        self.decoding.set()
        await asyncio.Event().wait()

    async def release(self, params_list):  # type: ignore[override]
        self.released += params_list


def test_a_client_gone_during_the_push_that_teaches_an_address_frees_its_hold() -> None:
    """The first prompt to a prefill engine not learned yet is pushed (its answer teaches the address); a client
    that leaves while its decode leg runs leaves a hold nobody will load: it is freed then, not at its lease."""
    proxy = Hanging()

    async def run() -> None:
        task = asyncio.create_task(proxy.serve(None, "/v1/completions", {"prompt": "hi", "max_tokens": 3},  # type: ignore[arg-type]
                                               {}, {}, [0.0]))
        await asyncio.wait_for(proxy.decoding.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert [url for url, _ in proxy.prefills] == [URLS[0]], "the prompt was pushed"
    assert proxy.released == [{"pushed": URLS[0]}]

def test_each_prompt_of_a_batch_streams_under_its_own_grant() -> None:
    proxy = Recorded()
    proxy.prefill = type(proxy.prefill)([URLS[0]])
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))
    bodies = [{"prompt": p, "max_tokens": 2} for p in ("a", "b", "c")]

    async def run() -> Response:
        batch = Batch(proxy, None, "/v1/completions", {}, {}, max_fanout=2)  # type: ignore[arg-type]
        answer = await batch.answers(bodies)
        await asyncio.sleep(0)
        return answer

    merged = json.loads(asyncio.run(run()).body)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2]
    grants = [d["kv_transfer_params"][GRANT_KEY] for d in proxy.decodes]
    assert sorted(d["prompt"] for d in proxy.decodes) == ["a", "b", "c"]
    assert len(set(grants)) == 3, "every prompt is its own stream"
    assert sorted(b["kv_transfer_params"][GRANT_KEY] for _, b in proxy.prefills) == sorted(grants)


class Answering(Recorded):
    """A stream proxy whose decode engine answers ``status`` (``_decode`` replaced, the rest of ``run_decode`` as
    built) and whose releases are recorded."""

    run_decode = Proxy.run_decode

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status
        self.released: list[dict[str, Any]] = []

    async def _prefill_leg(self, client, url, path, sent, headers, leg):  # type: ignore[override]
        await asyncio.sleep(0.01)  # the prefill engine answers after the decode engine
        return {"kv_transfer_params": {"held": sent["kv_transfer_params"][GRANT_KEY]}}

    async def _decode(self, client, url, path, body, headers, out_headers, relay, leg):  # type: ignore[override]
        self.decodes.append(body)
        if self.status >= 400:
            raise UpstreamError(self.status, "refused", "decode", url)
        return Response(b"{}", media_type="application/json")

    async def release(self, params_list):  # type: ignore[override]
        self.released += params_list


@pytest.mark.parametrize("status", [200, 400], ids=["answered", "refused"])
def test_a_decode_leg_that_ends_frees_the_hold_its_prefill_leg_made_once_that_answers(status: int) -> None:
    """Nobody loads from the hold once the decode leg ended: a refused one never will; an answered one has loaded
    (a streamed hold is already freed by its stream, and the release finds nothing) or prefilled the prompt
    itself (the prefill engine held it without streaming: a refused grant, a prompt given as embeddings), whose hold
    would otherwise last its lease."""
    proxy = Answering(status)
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))

    async def run() -> bool:
        try:
            await proxy.stream_legs(None, "/v1/completions", {"prompt": "hi", "max_tokens": 3}, {}, {})  # type: ignore[arg-type]
            refused = False
        except UpstreamError:
            refused = True
        while proxy._background:
            await asyncio.sleep(0.01)
        return refused

    assert asyncio.run(run()) == (status >= 400)
    (decode,) = proxy.decodes
    assert proxy.released == [{"held": decode["kv_transfer_params"][GRANT_KEY]}]
    assert proxy.streams.ended(decode) is None, "the prefill leg is forgotten once its decode leg ended"


class OpenStream:
    """A decode engine's stream opened but not yet answered (what ``run_decode(relay=False)`` returns): its events
    come once ``go`` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.closed = False
        self.url = "http://127.0.0.1:3/v1/completions"

    async def aiter_raw(self):  # type: ignore[no-untyped-def]
        await self.go.wait()
        chunk = {"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": "x",
                                                                            "finish_reason": "length"}]}
        yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    async def aclose(self) -> None:
        self.closed = True


class Streaming(Answering):
    """A stream proxy whose decode engine opens a stream at once and sends its events only when told."""

    def __init__(self) -> None:
        super().__init__(200)
        self.stream = OpenStream()

    async def _decode(self, client, url, path, body, headers, out_headers, relay, leg):  # type: ignore[override]
        self.decodes.append(body)
        return self.stream


def test_a_decode_stream_that_has_only_opened_does_not_free_the_hold_its_stream_needs() -> None:
    """A decode engine answers a streaming request's headers before it has sent its stream's destination (it
    sends it once its scheduler has allocated the blocks); the prefill leg may answer meanwhile (a prompt in its
    prefix cache). Freeing the hold then would stop the stream and fail the decode engine's load: the hold is
    freed only once the decode stream has ended."""
    proxy = Streaming()
    assert proxy.streams is not None
    proxy.streams.learn(URLS[0], _answer_params("p0", 7000))
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0}

    async def run() -> tuple[list[Any], bytes]:
        response = await proxy.stream_legs(None, "/v1/completions", body, {}, {})  # type: ignore[arg-type]
        await asyncio.sleep(0.1)  # the prefill leg has answered (after 0.01 s)
        before = list(proxy.released)
        proxy.stream.go.set()
        out = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined]
        while proxy._background:
            await asyncio.sleep(0.01)
        return before, out

    before, out = asyncio.run(run())
    assert before == [], "the hold was freed while the decode stream had only opened"
    (decode,) = proxy.decodes
    assert proxy.released == [{"held": decode["kv_transfer_params"][GRANT_KEY]}]
    assert b'"text": "x"' in out and proxy.stream.closed
