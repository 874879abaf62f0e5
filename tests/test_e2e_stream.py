"""Layer-streamed transfer end to end: the shared engines behind a proxy run with ``--transfer-mode stream``.

The proxy learns the prefill engine's address from its first answer (that
request is pushed), then sends both legs of each single prompt at once under
one grant; the prefill rank WRITEs each layer into the decode engine's
blocks as its forward computes it. Tokens (and logprobs) must equal the
aggregated engine's, every request shape a client sends must work, the
decode engine must have moved the KV by ``stream``, and no blocks may stay
held. A forged grant sent straight to the decode engine must leave it
answering correctly.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from p2pkv.grant import ANY_DECODE, GRANT_KEY, make_stream_grant
from p2pkv.tools.demo import LOGPROB_TOLERANCE, complete, max_logprob_diff, read_pull_stats, wait_blocks_released
from p2pkv.tools.proxy.release import release_all
from tests.conftest import BLOCK, Route, start_mode_proxy

pytestmark = pytest.mark.engines

PROMPTS = {
    "one block and a token": "x" * (BLOCK + 1),
    "several blocks": "Prefill and decode run apart; the KV cache moves between them. " * 3,
}


@pytest.fixture(scope="module")
def streamed(pair, client):
    """``(Route, pull stats file)``: the shared engines behind a stream proxy that has learned the prefill
    engine's address (its first request, pushed)."""
    from p2pkv.tools.deploy.processes import stop_children

    p, stats = pair
    url, child = start_mode_proxy(p, "stream")
    try:
        route = Route(p, "stream", url)
        complete(client, url, route.fresh("learn where the prefill engine is"), max_tokens=2)
        yield route, stats
    finally:
        stop_children([child])


def _releases(client, proxy_url: str) -> float:
    """The proxy's ``p2pkv_proxy_prefill_releases_total``: prefill holds it freed (per rank)."""
    for line in client.get(f"{proxy_url}/metrics").text.splitlines():
        if line.startswith("p2pkv_proxy_prefill_releases_total "):
            return float(line.split()[1])
    raise AssertionError("the proxy's /metrics has no p2pkv_proxy_prefill_releases_total")


def _prefill_address(route: Route, client) -> dict:
    """The prefill engine's address, from one prefill leg's answer (that hold then freed, as a proxy frees it)."""
    body = {"model": "model", "prompt": route.fresh("where are you"), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{route.url('prefill')}/v1/completions", json=body).json()["kv_transfer_params"]
    assert asyncio.run(release_all([params], route.secret.encode())) == 1
    return {k: params[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_streamed_tokens_and_logprobs_equal_aggregated(streamed, client, name) -> None:
    route, stats = streamed
    before = len(read_pull_stats(stats))
    prompt = route.fresh(PROMPTS[name])
    pd = complete(client, route.url("proxy"), prompt, max_tokens=12)
    ref = complete(client, route.url("aggregated"), prompt, max_tokens=12)
    assert pd.token_ids == ref.token_ids
    assert max_logprob_diff(pd, ref) <= LOGPROB_TOLERANCE
    pulls = read_pull_stats(stats)[before:]
    assert [p["direction"] for p in pulls] == ["stream"], "the prompt's KV must have been streamed, once"
    loaded = len(prompt.encode()) - 1  # the decode engine computes the last prompt token itself
    assert pulls[0]["blocks"] == -(-loaded // BLOCK)


def test_streamed_sse_and_chat_match(streamed, client) -> None:
    route, _ = streamed
    body = {"model": "model", "prompt": route.fresh(PROMPTS["several blocks"]) + " sse", "max_tokens": 10,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    text = ""
    with client.stream("POST", f"{route.url('proxy')}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    ref = client.post(f"{route.url('aggregated')}/v1/completions", json={**body, "stream": False}).json()
    assert text == ref["choices"][0]["text"]
    chat = {"model": "model", "messages": [{"role": "user", "content": route.fresh("Stream this, please")}],
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    pd = client.post(f"{route.url('proxy')}/v1/chat/completions", json=chat).json()
    ref = client.post(f"{route.url('aggregated')}/v1/chat/completions", json=chat).json()
    assert pd["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_a_forged_grant_is_refused_and_the_answer_stays_correct(streamed, client) -> None:
    """A grant made with another secret is refused by the decode engine, which prefills the prompt itself:
    it answers as the aggregated engine does, starts no transfer, and nothing hangs."""
    route, stats = streamed
    address = _prefill_address(route, client)
    prompt = route.fresh("A grant is good for one stream only. " * 2)
    body = {"model": "model", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    ref = client.post(f"{route.url('aggregated')}/v1/completions", json=body).json()["choices"][0]["text"]
    forged = make_stream_grant(address["remote_engine_id"], ANY_DECODE, b"x" * 32, time.time() + 60)
    params = {"do_remote_prefill": True, **address, GRANT_KEY: forged, "p2pkv_transfer_mode": "stream"}
    before = len(read_pull_stats(stats))
    got = client.post(f"{route.url('decode')}/v1/completions", json={**body, "kv_transfer_params": params})
    assert got.status_code == 200
    assert got.json()["choices"][0]["text"] == ref
    assert len(read_pull_stats(stats)) == before, "a forged grant must not start a transfer"


def test_stream_holds_no_blocks_after_requests(streamed, client) -> None:
    route, _ = streamed
    complete(client, route.url("proxy"), route.fresh("one more streamed request"), max_tokens=4)
    time.sleep(0.5)
    assert wait_blocks_released(client, route.url("prefill"), timeout_s=30) == 0.0
    assert wait_blocks_released(client, route.url("decode"), timeout_s=30) == 0.0


def test_each_prompt_of_a_batch_is_streamed_and_answers_equal(streamed, client) -> None:
    """A list of prompts, answered whole and as one SSE stream: every prompt's KV streamed (its own grant), the
    texts equal the aggregated engine's for the same list."""
    route, stats = streamed
    prompts = [route.fresh(PROMPTS["several blocks"]) + " one", route.fresh("x" * (2 * BLOCK + 3))]
    body = {"model": "model", "prompt": prompts, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    ref = client.post(f"{route.url('aggregated')}/v1/completions", json=body).json()
    ref_texts = [c["text"] for c in sorted(ref["choices"], key=lambda c: c["index"])]
    before = len(read_pull_stats(stats))
    got = client.post(f"{route.url('proxy')}/v1/completions", json=body)
    assert got.status_code == 200, got.text
    assert [c["text"] for c in sorted(got.json()["choices"], key=lambda c: c["index"])] == ref_texts
    assert [p["direction"] for p in read_pull_stats(stats)[before:]] == ["stream", "stream"]
    texts = ["", ""]
    sse = {**body, "prompt": [p + " sse" for p in prompts], "stream": True}
    ref = client.post(f"{route.url('aggregated')}/v1/completions", json={**sse, "stream": False}).json()
    with client.stream("POST", f"{route.url('proxy')}/v1/completions", json=sse) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in sorted(ref["choices"], key=lambda c: c["index"])]


def test_a_refused_decode_leg_frees_the_prefill_hold_and_the_next_request_is_right(streamed, client) -> None:
    """The decode engine refuses the leg (``max_tokens`` past the model's length; the prefill leg asks for one
    token and is accepted): the client gets the engine's 400, the prefill engine's streamed hold is freed by
    the proxy once its prefill leg answered (well before the 120 s lease), and the next request streams right."""
    route, _ = streamed
    released = _releases(client, route.url("proxy"))
    bad = {"model": "model", "prompt": route.fresh(PROMPTS["several blocks"]) + " refused", "max_tokens": 10**6}
    got = client.post(f"{route.url('proxy')}/v1/completions", json=bad)
    assert got.status_code == 400, got.text
    deadline = time.monotonic() + 15
    while _releases(client, route.url("proxy")) == released and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _releases(client, route.url("proxy")) == released + 1, "the prefill rank's hold must have been freed"
    assert wait_blocks_released(client, route.url("prefill"), timeout_s=15) == 0.0
    prompt = route.fresh("after a refused decode leg")
    pd = complete(client, route.url("proxy"), prompt, max_tokens=5)
    assert pd.token_ids == complete(client, route.url("aggregated"), prompt, max_tokens=5).token_ids
