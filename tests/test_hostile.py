"""Every request shape a client may send, and hostile kv_transfer_params, against real engines.

Each shape through the proxy must give the aggregated engine's answer (or a
clear 400); each bad input sent straight to the decode engine must end with
an error or a correct answer within seconds, never garbage, and a good
request right after it must still equal the aggregated engine's answer.
The prefill engine must hold no blocks once a request is over, also when
its decode leg failed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from p2pkv.params import CAPABILITY_KEY, RemotePrefill, parse_remote_prefill, sign_params
from p2pkv.tools.demo import complete, kv_cache_usage, wait_blocks_released
from tests.conftest import BLOCK, Route, free_ports

pytestmark = pytest.mark.engines

PROMPTS = ["Hello there", "z" * (2 * BLOCK + 3), "Prefill and decode run apart. " * 3]


def _post(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    return client.post(f"{url}/v1/completions", json={"model": "model", "temperature": 0.0, **body})


def _texts(answer: dict) -> list[str]:
    return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def _still_serving(p, client: httpx.Client) -> None:
    prompt = "a good request after a bad one"
    assert complete(client, p.url("proxy"), prompt, 6).token_ids == complete(client, p.url("aggregated"),
                                                                             prompt, 6).token_ids


def test_prompt_lists_are_split_and_merged(route, client) -> None:
    p, _ = route
    token_ids = {"pull": [[5, 6, 7, 8], [9, 10, 11]], "push": [[15, 16, 17, 18], [19, 20, 21]],
                 "stream": [[25, 26, 27, 28], [29, 30, 31]]}
    for prompt in ([p.fresh(t) for t in PROMPTS], token_ids[p.mode]):
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
        pd, ref = _post(client, p.url("proxy"), body).json(), _post(client, p.url("aggregated"), body).json()
        assert _texts(pd) == _texts(ref) and len(set(_texts(pd))) == len(prompt)
        assert [c["index"] for c in pd["choices"]] == list(range(len(prompt)))
        assert pd["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert pd["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 6 * len(prompt)
        for a, b in zip(pd["choices"], sorted(ref["choices"], key=lambda c: c["index"]), strict=True):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=10) == 0.0


def test_streamed_prompt_list_with_usage(route, client) -> None:
    p, _ = route
    body = {"model": "model", "prompt": [p.fresh(t) for t in PROMPTS], "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    texts, usages, done = ["", "", ""], [], 0
    with client.stream("POST", f"{p.url('proxy')}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts[c["index"]] += c["text"]
                if chunk.get("usage") and not chunk["choices"]:
                    usages.append(chunk["usage"])
    ref = _post(client, p.url("aggregated"), {**body, "stream": False, "stream_options": None}).json()
    assert texts == _texts(ref) and done == 1
    assert len(usages) == 1 and usages[0]["completion_tokens"] == 15
    assert usages[0]["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_echo_stop_min_tokens_and_chat_pass_through(route, client) -> None:
    p, _ = route
    prompt = p.fresh(PROMPTS[2])
    for body in ({"prompt": prompt, "max_tokens": 8, "echo": True, "logprobs": 2},
                 {"prompt": prompt, "max_tokens": 12, "stop": [" "], "ignore_eos": True},
                 {"prompt": prompt, "max_tokens": 6, "min_tokens": 4}):  # min_tokens > the prefill's 1
        pd, ref = _post(client, p.url("proxy"), body).json(), _post(client, p.url("aggregated"), body).json()
        assert _texts(pd) == _texts(ref)
        assert pd["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    chat = {"model": "model", "messages": [{"role": "user", "content": p.fresh("hi")}], "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    pd = client.post(f"{p.url('proxy')}/v1/chat/completions", json=chat).json()
    ref = client.post(f"{p.url('aggregated')}/v1/chat/completions", json=chat).json()
    assert pd["choices"][0]["message"] == ref["choices"][0]["message"]
    assert pd["usage"] == ref["usage"]


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_several_sequences_per_prompt_are_refused(pair, client, field) -> None:
    p, _ = pair
    resp = _post(client, p.url("proxy"), {"prompt": "x", "max_tokens": 2, field: 2})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


def test_decode_refusal_frees_the_prefill_hold_at_once(pair, client) -> None:
    """max_tokens beyond the context: the prefill (1 token) succeeds, the decode engine answers 400;
    the proxy passes the 400 on and the prefill engine's blocks are free within 2 s, not after the lease."""
    p, _ = pair
    resp = _post(client, p.url("proxy"), {"prompt": "y" * 300, "max_tokens": 5000})
    assert resp.status_code == 400
    deadline = time.monotonic() + 2.0
    while kv_cache_usage(client, p.url("prefill")) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_cache_usage(client, p.url("prefill")) == 0.0
    _still_serving(p, client)


def test_client_leaving_cancels_both_legs(route, client) -> None:
    """A non-streaming client that goes away mid-decode: the proxy cancels both legs; neither engine
    holds blocks for it a few seconds later."""
    p, _ = route
    body = {"model": "model", "prompt": p.fresh("q" * 100), "max_tokens": 800, "ignore_eos": True, "temperature": 0.0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{p.url('proxy')}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and (kv_cache_usage(client, p.url("prefill")) > 0
                                           or kv_cache_usage(client, p.url("decode")) > 0):
        time.sleep(0.1)
    assert kv_cache_usage(client, p.url("prefill")) == 0.0 and kv_cache_usage(client, p.url("decode")) == 0.0
    _still_serving(p, client)


def _prefill(client: httpx.Client, p, prompt: str) -> dict:
    resp = _post(client, p.url("prefill"), {"prompt": prompt, "max_tokens": 1,
                                            "kv_transfer_params": {"do_remote_decode": True}})
    return resp.json()["kv_transfer_params"]


def _decode(client: httpx.Client, p, prompt: str, params: dict) -> tuple[httpx.Response, float]:
    """Straight to the decode engine (a :class:`Route`'s mode asked for in the params)."""
    if isinstance(p, Route):
        params = p.params(params)
    t = time.monotonic()
    body = {"model": "model", "temperature": 0.0, "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
            "kv_transfer_params": params}
    resp = client.post(f"{p.url('decode')}/v1/completions", content=json.dumps(body),  # ASCII: any code point
                       headers={"content-type": "application/json"})
    return resp, time.monotonic() - t


def _failed(resp: httpx.Response) -> bool:
    """The request ended with an error, not with tokens served as if all was well."""
    return resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] not in ("length", "stop")


@pytest.mark.parametrize("prompt_blocks", [4, 12], ids=["one_chunk", "chunked_prefill"])
def test_a_client_gone_right_after_its_first_token_frees_the_prefill_blocks_at_once(route, client,
                                                                                   prompt_blocks) -> None:
    """A streaming client that reads its first token (handed over from the prefill engine's answer) and leaves,
    with the prefill run in one step or in chunks (a prompt past ``--max-num-batched-tokens``): the prefill's
    blocks are freed within seconds. Before, the proxy counted the decode leg as asked as soon as it began to
    send it, and skipped the release: a leg that never reached the decode engine's scheduler left the hold to
    its 120 s lease (34 of 46 tries)."""
    p, _ = route
    for attempt in range(3):
        baseline = kv_cache_usage(client, p.url("prefill"))
        body = {"model": "model", "prompt": p.fresh(f"{attempt} leaves early " + "w" * (prompt_blocks * BLOCK)),
                "max_tokens": 200, "ignore_eos": True, "temperature": 0.0, "stream": True}
        with httpx.Client(timeout=60.0) as fresh, fresh.stream("POST", f"{p.url('proxy')}/v1/completions",
                                                               json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # the first token: the client goes
        assert _usage_back_to(client, p.url("prefill"), baseline, timeout_s=5.0), (
            f"try {attempt}: the prefill's blocks stayed held after the client left")
    _still_serving(p, client)


def test_repeated_params_are_refused_as_a_replay_and_the_prompt_computed_here(route, client) -> None:
    """Params sent to the decode engine a second time (a replay: whoever saw them can): a capability serves one
    request per engine, so the second is refused before anything is allocated, logged as a replay, and the
    decode engine computes the prompt itself (it used to pull again: a failure once the hold had ended, or,
    while it lasted, a second READ of another request's hold)."""
    p, _ = route
    prompt = p.fresh("w" * 100)
    params = _prefill(client, p, prompt)
    first, _ = _decode(client, p, prompt, params)
    ref = _post(client, p.url("aggregated"), {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    assert _texts(first.json()) == _texts(ref)
    # the prefill frees the hold at the decode's "done", a NIXL notification after the answer: wait for it
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=5) == 0.0
    log = p.log_dir / "decode.log"
    before = log.read_text().count("already serves request")
    again, seconds = _decode(client, p, prompt, params)
    assert again.status_code == 200 and _texts(again.json()) == _texts(ref) and seconds < 10.0
    assert log.read_text().count("already serves request") > before, "the replay was not refused as one"
    _still_serving(p, client)


def test_retry_of_a_decode_leg_succeeds_until_the_decode_engine_gives_the_hold_up(route, client) -> None:
    """A decode leg that never reached the decode engine can be retried with the same params and pulls.
    One the decode engine refused (max_tokens beyond the context) frees the prefill's hold there and
    then: a retry then fails at once instead of reading freed blocks."""
    p, _ = route
    prompt = p.fresh("v" * 90)
    params = _prefill(client, p, prompt)
    (nobody,) = free_ports(1)
    with pytest.raises(httpx.ConnectError):
        client.post(f"http://127.0.0.1:{nobody}/v1/completions", json={"prompt": prompt})
    retry, _ = _decode(client, p, prompt, params)
    ref = _post(client, p.url("aggregated"), {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    assert _texts(retry.json()) == _texts(ref)
    params = _prefill(client, p, prompt)
    refused = _post(client, p.url("decode"), {"prompt": prompt, "max_tokens": 5000,
                                              "kv_transfer_params": p.params(params)})
    assert refused.status_code == 400
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=5) == 0.0
    again, seconds = _decode(client, p, prompt, params)
    assert _failed(again) and seconds < 10.0


def test_params_sent_back_to_the_prefill_engine_are_computed_there(pair, client) -> None:
    """Both legs on the prefill engine (``role: prefill``: it holds, and loads nothing): the decode leg is computed
    there, answered as one engine answers it, and said in its log naming the fix; the hold is still the decode
    engine's to pull, and is freed when pulled. (A ``both`` engine sent params naming itself refuses them by
    name: tests/test_worker_roles.py.)"""
    p, _ = pair
    prompt = "s" * 70
    params = _prefill(client, p, prompt)
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    back = _post(client, p.url("prefill"), {**body, "kv_transfer_params": params})
    ref = _post(client, p.url("aggregated"), body)
    assert back.status_code == 200 and _texts(back.json()) == _texts(ref.json())
    assert "asks this prefill engine (role prefill) to load KV" in (p.log_dir / "prefill.log").read_text()
    resp, _ = _decode(client, p, prompt, params)
    assert resp.status_code == 200 and _texts(resp.json()) == _texts(_post(client, p.url("aggregated"), {
        **body, "max_tokens": 6}).json())
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=30) == 0.0
    _still_serving(p, client)


def test_no_http_caller_can_make_the_decode_engine_hold_blocks(pair, client) -> None:
    """``do_remote_decode`` sent to the decode engine (``role: decode``, as ``p2pkv launch`` starts it): answered
    at once without a hold, the params saying why and naming the setting; nothing of its KV cache stays in use,
    however many such requests come, and it keeps serving."""
    p, _ = pair
    for i in range(4):
        resp = _post(client, p.url("decode"), {"prompt": f"pin the decode cache {i} " * 40, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})
        assert resp.status_code == 200, resp.text
        params = resp.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is False and "role is decode" in params["p2pkv_no_hold"]
        assert CAPABILITY_KEY not in params and "remote_block_ids" not in params
    assert wait_blocks_released(client, p.url("decode"), timeout_s=5) == 0.0  # held by nobody, not for the lease
    assert "answered without a hold: this engine's role is decode" in (p.log_dir / "decode.log").read_text()
    _still_serving(p, client)


def test_params_moved_to_another_prompt_are_prefilled_locally(pair, client) -> None:
    """A's signed params sent with prompt B: of the same length (the prompt digest differs), or with more tokens
    claimed as appended (appended_tokens is signed: altered, the capability fails). B is prefilled on the decode
    engine and answered as one engine answers it; A's own pull then still works and frees its hold."""
    p, _ = pair
    a = "moved params " * 8
    params = _prefill(client, p, a)
    body = {"max_tokens": 6, "ignore_eos": True}
    for other, extra in ((a.upper(), {}), (a + "x", {"appended_tokens": 1}), ("B" * 300 + a, {"appended_tokens": 300})):
        resp, _ = _decode(client, p, other, {**params, **extra})
        ref = _post(client, p.url("aggregated"), {"prompt": other, **body})
        assert resp.status_code == 200 and _texts(resp.json()) == _texts(ref.json()), other[:20]
    log = (p.log_dir / "decode.log").read_text()
    assert "remote_prompt_digest does not match this request's first" in log
    assert "p2pkv_capability does not match the params" in log
    resp, _ = _decode(client, p, a, params)
    assert resp.status_code == 200 and _texts(resp.json()) == _texts(_post(client, p.url("aggregated"),
                                                                           {"prompt": a, **body}).json())
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=30) == 0.0


HOSTILE = {
    "tp_size as text": lambda q: {**q, "tp_size": "two"},
    "huge tp_size": lambda q: {**q, "tp_size": 10**9},
    "tp_size 2 against a TP-1 prefill": lambda q: {**q, "tp_size": 2},
    "negative block id": lambda q: {**q, "remote_block_ids": [[-1]]},
    "too few block ids": lambda q: {**q, "remote_block_ids": [q["remote_block_ids"][0][:1]]},
    "another request's id": lambda q: {**q, "remote_request_id": "made-up-request"},
    "unknown engine id at the real prefill": lambda q: {**q, "remote_engine_id": "made-up-engine"},
    "unreachable peer": lambda q: {**q, "remote_host": "127.0.0.2"},
    "port out of range": lambda q: {**q, "remote_port": 70000},
    "params of a shorter prompt": lambda q: {**q, "remote_num_tokens": 3},
    "request id with a lone surrogate": lambda q: {**q, "remote_request_id": "x\ud800"},
    "block id beyond 2**63": lambda q: {**q, "remote_block_ids": [[2**64 + 1, *q["remote_block_ids"][0][1:]]]},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_params_fail_cleanly_and_harm_nothing(pair, client, case) -> None:
    """Straight to the decode engine: a clear failure within seconds, or (params refused up front)
    the prompt prefilled locally with the right tokens; then the engines still serve correctly.
    (Pull only: every case is refused by the capability check, before the direction matters.)"""
    p, _ = pair
    prompt = "h" * (3 * BLOCK + 5)
    params = HOSTILE[case](_prefill(client, p, prompt))
    resp, seconds = _decode(client, p, prompt, params)
    ref = _post(client, p.url("aggregated"), {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    assert _failed(resp) or _texts(resp.json()) == _texts(ref), "served wrong tokens with HTTP 200"
    assert seconds < 10.0, f"took {seconds:.1f} s"
    _still_serving(p, client)


@contextmanager
def _listener() -> Iterator[tuple[int, list[bytes]]]:
    """A TCP listener on 127.0.0.1 standing in for an attacker's host: its port, and what each connection sent."""
    received: list[bytes] = []
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.settimeout(1.0)
            try:
                received.append(conn.recv(65536))
            except OSError:
                received.append(b"")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], received
    finally:
        stop.set()
        thread.join(timeout=2)
        srv.close()


def _resign(params: dict, secret: str, expiry: float, **change: object) -> dict:
    """``params`` changed by ``change`` and signed again with ``secret`` (as only a secret holder could)."""
    out = {k: v for k, v in params.items() if k != CAPABILITY_KEY}
    out.update(change)
    return sign_params(out, secret.encode(), expiry)


FORGED: dict[str, Callable[[dict, int, str], dict]] = {
    "unsigned": lambda q, port, _: {**{k: v for k, v in q.items() if k != CAPABILITY_KEY}, "remote_port": port},
    "redirected (signature of the original)": lambda q, port, _: {**q, "remote_port": port},
    "another request's blocks": lambda q, port, _: {**q, "remote_port": port, "remote_block_ids": [[1, 2, 3, 4]]},
    "signed with another secret": lambda q, port, _: _resign(q, "another-secret-0123456789", time.time() + 60,
                                                             remote_port=port),
    "expired": lambda q, port, secret: _resign(q, secret, time.time() - 60, remote_port=port),
    "malformed capability": lambda q, port, _: {**q, "remote_port": port, CAPABILITY_KEY: "v1.x." + "0" * 64},
}


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_params_are_prefilled_locally_contact_nobody_and_free_nothing(pair, client, case) -> None:
    """Params a caller of the decode API made or changed without the secret (here all pointing at a
    listener of the caller's): the decode engine checks the capability before it contacts anyone, so
    the listener gets no connection (no signed request to capture and replay), the prompt is
    prefilled locally with the right tokens, the log names the field, and the genuine params' hold is
    untouched: their pull afterwards still gives the aggregated engine's tokens."""
    p, _ = pair
    prompt = "f" * (2 * BLOCK + 9)
    held_before = kv_cache_usage(client, p.url("prefill"))  # earlier cases' refused params wait for their lease
    genuine = _prefill(client, p, prompt)
    assert parse_remote_prefill(genuine, secret=p.secret.encode()) == parse_remote_prefill(genuine, secret=None)
    ref = _post(client, p.url("aggregated"), {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    log = p.log_dir / "decode.log"
    before = log.read_text().count(f"kv_transfer_params.{CAPABILITY_KEY}")
    with _listener() as (port, received):
        resp, seconds = _decode(client, p, prompt, FORGED[case](genuine, port, p.secret))
        time.sleep(0.5)  # a connection the decode worker started would have arrived by now
    assert received == [], "the decode engine contacted the host named by forged params"
    assert resp.status_code == 200 and _texts(resp.json()) == _texts(ref) and seconds < 10.0
    assert log.read_text().count(f"kv_transfer_params.{CAPABILITY_KEY}") > before
    again, _ = _decode(client, p, prompt, genuine)
    assert _texts(again.json()) == _texts(ref), "the forged params freed the genuine request's hold"
    assert _usage_back_to(client, p.url("prefill"), held_before, timeout_s=10.0)


def test_a_forged_capability_dated_far_ahead_is_refused_by_its_expiry_first(pair, client) -> None:
    """A forged capability whose expiry lies in year 2286 used to pass the expiry check, have every id of 64 KV
    cache groups checked and the MAC computed over them all (20-153 ms of EngineCore time) before the group
    count refused it. Now its expiry, beyond the decode engine's max_lifetime_s, refuses it before anything else
    is read (scripts/bench_refusal.py measures the cost); the prompt is prefilled locally and right."""
    p, _ = pair
    prompt = "g" * (2 * BLOCK + 7)
    genuine = _prefill(client, p, prompt)
    ids = genuine["remote_block_ids"][0]
    forged = {**genuine, CAPABILITY_KEY: "v1.9999999999." + "0" * 64, "remote_block_ids": [ids] * 64}
    log = p.log_dir / "decode.log"
    before = log.read_text().count("this engine accepts (max_lifetime_s")
    resp, seconds = _decode(client, p, prompt, forged)
    ref = _post(client, p.url("aggregated"), {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
    assert resp.status_code == 200 and _texts(resp.json()) == _texts(ref) and seconds < 10.0
    assert log.read_text().count("this engine accepts (max_lifetime_s") > before, "not refused by its expiry"
    again, _ = _decode(client, p, prompt, genuine)
    assert _texts(again.json()) == _texts(ref), "the forged params harmed the genuine request's hold"


def test_capability_covers_what_a_pull_uses(pair, client) -> None:
    """The prefill engine's params carry a capability over every field a pull uses: changing any of
    them (even to a value that would work) makes it fail the check."""
    p, _ = pair
    params = _prefill(client, p, "c" * 40)
    secret = p.secret.encode()
    parse_remote_prefill(params, secret=secret)
    changes = {"remote_engine_id": "other", "remote_request_id": "other", "remote_host": "localhost",
               "remote_port": params["remote_port"] + 1, "tp_size": 2,
               "remote_num_tokens": params["remote_num_tokens"] + 1,
               "remote_block_ids": [[*params["remote_block_ids"][0][:-1], 7]], "appended_tokens": 1,
               "remote_prompt_digest": "0" * 32}
    assert len(params["remote_prompt_digest"]) == 32
    for key, value in changes.items():
        with pytest.raises(ValueError, match=CAPABILITY_KEY):
            parse_remote_prefill({**params, key: value}, secret=secret)
    assert isinstance(parse_remote_prefill(params, secret=None), RemotePrefill)
    pulled, _ = _decode(client, p, "c" * 40, params)  # the genuine params still pull (and free the hold)
    assert pulled.status_code == 200


def _usage_back_to(client: httpx.Client, url: str, usage: float, timeout_s: float) -> bool:
    """The engine's KV cache usage falls to ``usage`` (or below) within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while kv_cache_usage(client, url) > usage and time.monotonic() < deadline:
        time.sleep(0.2)
    return kv_cache_usage(client, url) <= usage


def test_the_secret_is_on_no_command_line_and_in_no_log(launched, client) -> None:
    """vLLM logs its non-default arguments (the connector's extra config among them) and ``ps`` shows
    every command line: the secret reaches the engines and the proxy only through their environment."""
    import psutil

    p = launched.pair
    complete(client, p.url("proxy"), "one more request, so every process has logged something", 2)
    processes = [psutil.Process(launched.proc.pid), *psutil.Process(launched.proc.pid).children(recursive=True)]
    assert len(processes) >= 4, "the launcher, its engines and its proxy"
    for proc in processes:
        assert p.secret not in " ".join(proc.cmdline()), f"the secret is on {proc.name()}'s command line"
    logs = sorted(p.log_dir.glob("*.log"))
    assert {"prefill.log", "decode.log", "aggregated.log", "proxy.log"} <= {log.name for log in logs}
    for log in logs:
        assert p.secret not in log.read_text(errors="replace"), f"the secret is in {log}"
    assert p.secret not in "".join(launched.lines), "the secret is in what the launcher printed"


def test_nothing_left_held(route, client) -> None:
    p, _ = route
    complete(client, p.url("proxy"), "last one", 2)
    assert wait_blocks_released(client, p.url("decode"), timeout_s=30) == 0.0
