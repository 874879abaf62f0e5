"""Multi-turn reuse through the proxy (:mod:`p2pkv.tools.proxy.turns`): the params a decode engine answers a kept
turn with go, once, with the prefill leg of the conversation's next turn, found by what that turn's prompt starts
with; nothing else does.

Engines are a mock transport: the decode engine answers every whole request with a kept turn's params, and the
prefill legs the proxy sends are recorded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from p2pkv.tools.proxy import turns as turns_module
from p2pkv.tools.proxy.app import Proxy
from p2pkv.tools.proxy.turns import TurnMemory
from p2pkv.turns import make_turn_params

SECRET = b"s" * 32
PREFILL, DECODE = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _kept(request_id: str, expiry_s: float = 60.0) -> dict[str, Any]:
    """What a decode engine with ``keep_turns_s`` answers a finished request with."""
    return make_turn_params(engine_id="decode", request_id=request_id, host="127.0.0.1", port=5700,
                            block_ids=[1, 2, 3], tp_size=1, num_tokens=40, expiry_time=time.time() + expiry_s,
                            prompt_digest="0" * 32, secret=SECRET)


def _prefill_params() -> dict[str, Any]:
    """What a prefill engine answers a prefill leg with."""
    params = make_turn_params(engine_id="prefill", request_id="p", host="127.0.0.1", port=5600, block_ids=[4],
                              tp_size=1, num_tokens=10, expiry_time=time.time() + 60, secret=SECRET)
    params.update(do_remote_decode=False, do_remote_prefill=True)
    return params


def _engines(prefills: list[dict[str, Any]], fails: Callable[[dict[str, Any]], bool]
             ) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
    """A mock transport's handler: prefill legs recorded in ``prefills`` and answered (500 where ``fails``), every
    decode leg answered with a kept turn's params."""
    async def engines(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if str(request.url).startswith(PREFILL):
            prefills.append(body)
            if fails(body):
                return httpx.Response(500, json={"error": {"message": "KV load failed"}})
            return httpx.Response(200, json=_text_answer("x", _prefill_params()))
        return httpx.Response(200, json=_text_answer(" answer", _kept(f"kept-{len(prefills)}")))

    return engines


def _text_answer(text: str, params: dict[str, Any] | None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text}], **({"kv_transfer_params": params} if params else {})}


def test_a_completions_turn_is_found_by_a_prompt_that_extends_it_once() -> None:
    memory = TurnMemory()
    body = {"model": "m", "prompt": "Hello, who are you?"}
    assert memory.remember("/v1/completions", body, _text_answer(" I am a model.", _kept("t1")))
    nxt = {"model": "m", "prompt": "Hello, who are you? I am a model. And what do you do?"}
    assert memory.take("/v1/completions", {**nxt, "cache_salt": "other tenant"}) is None
    assert memory.take("/v1/completions", {**nxt, "model": "other"}) is None
    assert memory.has("/v1/completions", nxt) and memory.has("/v1/completions", nxt)  # looking forgets nothing
    found = memory.take("/v1/completions", nxt)
    assert found is not None and found["remote_request_id"] == "t1"
    assert memory.take("/v1/completions", nxt) is None  # used once: a capability serves one request
    assert not memory.has("/v1/completions", nxt)
    assert memory.remember("/v1/completions", body, _text_answer(" I am a model.", _kept("t1b")))
    assert memory.take("/v1/completions", {"model": "m", "prompt": "Hello, who are you? I was edited."}) is None
    assert memory.take("/v1/completions", {"model": "m", "prompt": "Hello, who are you? I am a model."}) is None


def test_the_longest_kept_turn_a_prompt_extends_wins_and_expired_ones_are_skipped() -> None:
    memory = TurnMemory()
    memory.remember("/v1/completions", {"prompt": "a"}, _text_answer("b", _kept("short")))
    memory.remember("/v1/completions", {"prompt": "ab"}, _text_answer("cd", _kept("long")))
    memory.remember("/v1/completions", {"prompt": "abcd"}, _text_answer("ef", _kept("gone", expiry_s=-1)))
    expired = TurnMemory()
    expired.remember("/v1/completions", {"prompt": "abcd"}, _text_answer("ef", _kept("gone", expiry_s=-1)))
    assert not expired.has("/v1/completions", {"prompt": "abcdefg"})  # an expired turn is not found
    assert memory.take("/v1/completions", {"prompt": "abcdefg"})["remote_request_id"] == "long"  # type: ignore[index]
    assert memory.take("/v1/completions", {"prompt": "abz"})["remote_request_id"] == "short"  # type: ignore[index]


def test_token_id_prompts_and_chat_histories_are_keyed_too() -> None:
    memory = TurnMemory()
    ids = {"prompt": [5, 6, 7]}
    assert memory.remember("/v1/completions", ids, {"choices": [{"text": "x", "token_ids": [8, 9]}],
                                                    "kv_transfer_params": _kept("ids")})
    assert memory.take("/v1/completions", {"prompt": [5, 6, 7, 8, 9, 10]})["remote_request_id"] == "ids"  # type: ignore[index]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    answer = {"choices": [{"message": {"role": "assistant", "content": "hello"}}], "kv_transfer_params": _kept("c")}
    assert memory.remember("/v1/chat/completions", chat, answer)
    edited = {"messages": [{"role": "user", "content": "hi!"}, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "how are you"}]}
    assert memory.take("/v1/chat/completions", edited) is None
    nxt = {"messages": [*edited["messages"][:0], {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"}]}
    assert memory.take("/v1/chat/completions", nxt)["remote_request_id"] == "c"  # type: ignore[index]


def test_only_kept_turns_are_remembered_and_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = TurnMemory()
    prefill_answer = make_turn_params(engine_id="p", request_id="r", host="h", port=1, block_ids=[1], tp_size=1,
                                      num_tokens=1, expiry_time=None)
    prefill_answer.update(do_remote_decode=False, do_remote_prefill=True)  # a prefill engine's: not a kept turn
    assert not memory.remember("/v1/completions", {"prompt": "a"}, _text_answer("b", prefill_answer))
    assert not memory.remember("/v1/completions", {"prompt": "a"}, _text_answer("b", None))
    assert not memory.remember_body("/v1/completions", {"prompt": "a"}, b"kv_transfer_params: not JSON")
    assert memory.remember_body("/v1/completions", {"prompt": "a"},
                                json.dumps(_text_answer("b", _kept("whole"))).encode())
    assert memory.take("/v1/completions", {"prompt": "abc"})["remote_request_id"] == "whole"  # type: ignore[index]
    monkeypatch.setattr(turns_module, "MAX_TURNS", 3)
    for i in range(5):
        memory.remember("/v1/completions", {"prompt": f"p{i}"}, _text_answer("x" * i, _kept(f"t{i}")))
    assert len(memory) == 3 and sum(memory._lengths["text"].values()) == 3  # the oldest two forgotten
    assert memory.take("/v1/completions", {"prompt": "p0!"}) is None
    assert memory.take("/v1/completions", {"prompt": "p4xxxx!"})["remote_request_id"] == "t4"  # type: ignore[index]


def test_the_proxy_sends_a_kept_turns_params_with_the_next_turns_prefill_leg() -> None:
    """Through the proxy: turn 1's decode answer carries a kept turn's params; turn 2's prefill leg carries them
    (with the prefill leg's own flags), turn 3 of another conversation does not; ``p2pkv_proxy_turns_total`` counts
    the three kept turns remembered and the one sent."""
    prefills: list[dict[str, Any]] = []
    engines = _engines(prefills, lambda body: False)

    proxy = Proxy([PREFILL], [DECODE], 30.0, SECRET)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as client:
            for prompt in ("Turn one.", "Turn one. answer Turn two.", "Another talk."):
                resp = await proxy.serve(client, "/v1/completions", {"model": "m", "prompt": prompt,
                                                                     "max_tokens": 4}, {}, {}, [0.0])
                assert resp.status_code == 200

    asyncio.run(run())
    counted = {event: proxy.metrics.turns.labels(event)._value.get() for event in ("kept", "sent")}
    assert counted == {"kept": 3, "sent": 1}
    first, second, third = (p["kv_transfer_params"] for p in prefills)
    assert "remote_block_ids" not in first or not first["remote_block_ids"]
    assert second["remote_request_id"] == "kept-1" and second["remote_block_ids"] == [[1, 2, 3]]
    assert second["do_remote_decode"] is True and second["do_remote_prefill"] is False
    assert not third.get("remote_block_ids")


def test_a_prefill_leg_that_fails_with_a_kept_turn_is_sent_again_without_it() -> None:
    """Turn 2's prefill engine fails the leg carrying turn 1's params (the decode engine that kept them is gone, or
    their hold ended: vLLM fails the request under ``kv_load_failure_policy`` fail): the proxy sends the leg once
    more without them, the client gets its answer, and ``p2pkv_proxy_turns_total{event="failed"}`` counts it. A leg
    without a turn that fails is not sent again."""
    prefills: list[dict[str, Any]] = []
    engines = _engines(prefills, lambda body: bool(body["kv_transfer_params"].get("remote_block_ids"))
                       or body["prompt"] == "Fails alone.")

    proxy = Proxy([PREFILL], [DECODE], 30.0, SECRET)
    statuses: list[int] = []

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as client:
            for prompt in ("Turn one.", "Turn one. answer Turn two.", "Fails alone."):
                try:
                    resp = await proxy.serve(client, "/v1/completions", {"model": "m", "prompt": prompt,
                                                                         "max_tokens": 4}, {}, {}, [0.0])
                    statuses.append(resp.status_code)
                except Exception as exc:  # UpstreamError: the client's 5xx
                    statuses.append(getattr(exc, "status", 0))

    asyncio.run(run())
    assert statuses[:2] == [200, 200] and statuses[2] >= 500
    with_turn, again = (p["kv_transfer_params"] for p in prefills[1:3])
    assert with_turn["remote_request_id"] == "kept-1" and not again.get("remote_block_ids")
    assert len(prefills) == 4  # turn 1, turn 2 twice, the failing prompt once
    counted = {event: proxy.metrics.turns.labels(event)._value.get() for event in ("kept", "sent", "failed")}
    assert counted == {"kept": 2, "sent": 1, "failed": 1}
