"""Layer-streamed transfer end to end, what the suites run in every proxy mode do not cover: the shared engines
behind the session's stream proxy (``--transfer-mode stream``; tests/test_e2e.py, test_hostile.py and the others
that take ``route`` run in stream mode too).

Here: a prompt whose prefill runs in several chunks (each chunk's layers
streamed as computed); lists of prompts, each streamed under its own grant; a forged grant
sent straight to the decode engine; a decode leg the decode engine refuses
(the proxy frees the prefill hold); a prompt the decode engine already has
cached (it declines the stream and the prefill engine frees its hold at
once). Answers must equal the aggregated engine's and no block may stay held.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from p2pkv.grant import ANY_DECODE, GRANT_KEY, make_stream_grant
from p2pkv.tools.demo import LOGPROB_TOLERANCE, complete, kv_cache_usage, max_logprob_diff, read_pull_stats
from p2pkv.tools.proxy.unpulled_holds import release_all
from tests.conftest import BLOCK, MAX_BATCHED_TOKENS, Route

pytestmark = pytest.mark.engines

SEVERAL_BLOCKS = "Each layer streams to the decode engine as the prefill computes it. " * 3  # no other module's prompt


@pytest.fixture
def streamed(routes, pair):
    """``(Route, pull stats file)``: the shared engines behind the session's stream proxy, which has learned the
    prefill engine's address (:func:`tests.conftest.routes`)."""
    return routes["stream"], pair[1]


def _prefill_usage_back_to(client, route: Route, baseline: float, timeout_s: float = 15.0) -> bool:
    """True once the prefill engine's KV cache usage is back at ``baseline`` (what other tests' holds, which end by
    their leases, keep) within ``timeout_s`` (well below the 120 s lease of the holds made here)."""
    deadline = time.monotonic() + timeout_s
    while kv_cache_usage(client, route.url("prefill")) > baseline:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _prefill_address(route: Route, client) -> dict:
    """The prefill engine's address, from one prefill leg's answer (that hold then freed, as a proxy frees it)."""
    body = {"model": "model", "prompt": route.fresh("where are you"), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{route.url('prefill')}/v1/completions", json=body).json()["kv_transfer_params"]
    assert asyncio.run(release_all([params], route.secret.encode())) == 1
    return {k: params[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}


def test_a_prompt_prefilled_in_chunks_streams_each_chunk_and_answers_equal(streamed, client) -> None:
    """The engines compute at most ``MAX_BATCHED_TOKENS`` tokens per step, so this prompt's prefill runs in
    three chunks or more: each chunk's layers are WRITTEN as computed, the block a chunk ended in again with the
    next. Tokens and logprobs equal the aggregated engine's (which prefills in chunks too)."""
    route, stats = streamed
    prompt = route.fresh("Chunk by chunk, layer by layer, the KV streams to the decode engine. " * 12)
    body = {"model": "model", "prompt": prompt, "max_tokens": 1}
    assert client.post(f"{route.url('aggregated')}/v1/completions", json=body).json()["usage"][
        "prompt_tokens"] > 2 * MAX_BATCHED_TOKENS
    ref = complete(client, route.url("aggregated"), prompt, max_tokens=6)
    before = len(read_pull_stats(stats))
    got = complete(client, route.url("proxy"), prompt, max_tokens=6)
    assert got.token_ids == ref.token_ids
    assert max_logprob_diff(got, ref) <= LOGPROB_TOLERANCE
    assert [p["direction"] for p in read_pull_stats(stats)[before:]] == ["stream"]


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


def test_each_prompt_of_a_batch_is_streamed_and_answers_equal(streamed, client) -> None:
    """A list of prompts, answered whole and as one SSE stream: every prompt's KV streamed (its own grant), the
    texts equal the aggregated engine's for the same list."""
    route, stats = streamed
    prompts = [route.fresh(SEVERAL_BLOCKS) + " one", route.fresh("x" * (2 * BLOCK + 3))]
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
    token and is accepted): the client gets the engine's 400, and the prefill engine's streamed hold is freed
    well before the 120 s lease — by the decode engine declining the stream it will not load, or by the proxy
    once the prefill leg answered, whichever comes first — and the next request streams right."""
    route, _ = streamed
    baseline = kv_cache_usage(client, route.url("prefill"))
    bad = {"model": "model", "prompt": route.fresh(SEVERAL_BLOCKS) + " refused", "max_tokens": 10**6}
    got = client.post(f"{route.url('proxy')}/v1/completions", json=bad)
    assert got.status_code == 400, got.text
    assert "max_tokens" in got.text
    assert _prefill_usage_back_to(client, route, baseline), "the streamed hold of a refused decode leg stayed"
    prompt = route.fresh("after a refused decode leg")
    pd = complete(client, route.url("proxy"), prompt, max_tokens=5)
    assert pd.token_ids == complete(client, route.url("aggregated"), prompt, max_tokens=5).token_ids


def test_a_prompt_the_decode_engine_has_cached_declines_the_stream_and_frees_the_hold(streamed, client) -> None:
    """The same prompt twice: the second time the decode engine's prefix cache holds every token it would load
    (a prompt of two blocks and a token), so it takes nothing of the stream and declines it. The prefill engine
    frees that request's hold at once (not at the 120 s lease), and the answer equals the aggregated engine's."""
    route, stats = streamed
    prompt = route.fresh(("Declined when cached. " * 4)[:2 * BLOCK] + "!")  # no other test's first block
    ref = complete(client, route.url("aggregated"), prompt, max_tokens=4).token_ids
    before, baseline = len(read_pull_stats(stats)), kv_cache_usage(client, route.url("prefill"))
    assert complete(client, route.url("proxy"), prompt, max_tokens=4).token_ids == ref
    assert _prefill_usage_back_to(client, route, baseline)
    assert complete(client, route.url("proxy"), prompt, max_tokens=4).token_ids == ref
    assert _prefill_usage_back_to(client, route, baseline), "the declined stream's hold stayed"
    assert [p["direction"] for p in read_pull_stats(stats)[before:]] == ["stream"], \
        "the second request loads nothing: its blocks are in the decode engine's prefix cache"


def test_a_replayed_grant_gets_no_stream_and_no_hold(streamed, client) -> None:
    """A grant is seen by logs, traces, routers and the plaintext proxy → engine hop. Sent again to the prefill
    engine once its first request has finished, it used to stream again, held outside ``max_held_fraction``
    for the lease (16 of 16 blocks against a cap of 8). Now the replay is answered without a hold, naming why,
    and nothing it sent stays held."""
    route, _ = streamed
    baseline = kv_cache_usage(client, route.url("prefill"))
    address = _prefill_address(route, client)
    grant = make_stream_grant(address["remote_engine_id"], ANY_DECODE, route.secret.encode(), time.time() + 60)
    body = {"model": "model", "prompt": route.fresh(SEVERAL_BLOCKS) + " replayed", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, GRANT_KEY: grant}}
    first = client.post(f"{route.url('prefill')}/v1/completions", json=body).json()["kv_transfer_params"]
    assert first.get("do_remote_prefill") is True, first
    again = client.post(f"{route.url('prefill')}/v1/completions", json=body).json()["kv_transfer_params"]
    assert again.get("do_remote_prefill") is False and "already serves request" in again["p2pkv_no_hold"], again
    assert asyncio.run(release_all([first], route.secret.encode())) == 1  # as the proxy frees it
    assert _prefill_usage_back_to(client, route, baseline), "the replay left blocks held"
