"""End to end: real vLLM prefill and decode engines with p2pkv, the bundled proxy,
and one aggregated engine, all on 127.0.0.1 with the tiny model.

Greedy tokens and their logprobs through the proxy must equal the aggregated
engine's; the prefill engine must hold no blocks afterwards; and a negative
control shows the check fails when the decode engine gets the wrong KV.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from p2pkv.params import CAPABILITY_KEY, sign_params
from p2pkv.telemetry.stats import PULL_PHASES
from p2pkv.tools.demo import (
    LOGPROB_TOLERANCE,
    Answer,
    complete,
    max_logprob_diff,
    read_pull_stats,
    wait_blocks_released,
)
from tests.conftest import BLOCK, FAULT_MARK, MODES, free_ports
from tests.legs import metric_sum, moved_to, wait_metric_above

pytestmark = pytest.mark.engines

PROMPTS = {
    "shorter than one block": "Hi there",
    "exactly two blocks": "y" * (2 * BLOCK),  # byte-level tokenizer: one token per byte
    "several blocks": "Prefill and decode run apart; the KV cache moves between them. " * 3,
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_tokens_and_logprobs_equal_aggregated(route, client, name) -> None:
    p, stats = route
    pulls_before = len(read_pull_stats(stats))
    prompt = p.fresh(PROMPTS[name])
    pd = complete(client, p.url("proxy"), prompt, max_tokens=12)
    ref = complete(client, p.url("aggregated"), prompt, max_tokens=12)
    assert len(pd.token_ids) == 12
    assert pd.token_ids == ref.token_ids
    assert max_logprob_diff(pd, ref) <= LOGPROB_TOLERANCE
    pulls = read_pull_stats(stats)[pulls_before:]
    assert len(pulls) == 1, "the decode engine must pull this prompt's KV exactly once"
    tokens = len(prompt.encode()) - (p.mode == "stream")  # a stream leaves the last token to the decode engine
    assert pulls[0]["blocks"] == -(-tokens // BLOCK)
    assert pulls[0]["bytes"] > 0
    assert pulls[0]["direction"] == p.mode, "the decode engine must move the KV the way the proxy asked"


def test_streaming_through_proxy_matches(route, client) -> None:
    p, _ = route
    body = {"model": "model", "prompt": p.fresh(PROMPTS["several blocks"]), "max_tokens": 10,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    text = ""
    with client.stream("POST", f"{p.url('proxy')}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    ref = client.post(f"{p.url('aggregated')}/v1/completions", json={**body, "stream": False}).json()
    assert text == ref["choices"][0]["text"]


def test_chat_completions_through_proxy(route, client) -> None:
    p, _ = route
    body = {"model": "model", "messages": [{"role": "user", "content": p.fresh("Say something")}],
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    pd = client.post(f"{p.url('proxy')}/v1/chat/completions", json=body).json()
    ref = client.post(f"{p.url('aggregated')}/v1/chat/completions", json=body).json()
    assert pd["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def _prefill(client: httpx.Client, url: str, prompt: str) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{url}/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def _decode(client: httpx.Client, url: str, prompt: str, params: dict) -> Answer:
    body = {"model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params}
    choice = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    return Answer(choice["text"], choice["token_ids"], choice["logprobs"]["token_logprobs"])


def test_negative_control_wrong_kv_changes_output(route, client) -> None:
    """Give the decode engine another prompt's KV (its params signed again for ``c``, as only a holder of the
    secret can: the digest of the prompt would refuse them otherwise): the comparison must catch it.

    ``c`` is decoded with ``b``'s pulled KV; ``c`` is used nowhere else, so the
    wrong blocks the decode engine caches under ``c``'s prefix hash harm no
    other test.
    """
    p, _ = route
    a, b, c = (p.fresh(t) for t in ("a" * 40 + " first prompt", "b" * 40 + " other prompt", "c" * 40 + " third prompt"))
    assert len(a) == len(b) == len(c)
    params_a = _prefill(client, p.url("prefill"), a)
    params_b = _prefill(client, p.url("prefill"), b)
    right = _decode(client, p.url("decode"), a, p.params(params_a))
    wrong = _decode(client, p.url("decode"), c, p.params(moved_to(client, p.url("decode"), params_b, c, p.secret)))
    ref_a = complete(client, p.url("aggregated"), a, max_tokens=8)
    ref_c = complete(client, p.url("aggregated"), c, max_tokens=8)
    assert right.token_ids == ref_a.token_ids and max_logprob_diff(right, ref_a) <= LOGPROB_TOLERANCE
    assert wrong.token_ids != ref_c.token_ids or max_logprob_diff(wrong, ref_c) > 100 * LOGPROB_TOLERANCE


def test_failed_pull_is_reported_not_hung(route, client) -> None:
    """Params (signed with the secret) pointing at a side channel where nothing listens: the pull fails, vLLM is
    told (kv_load_failure_policy=fail by default), the request ends with an error instead
    of garbage or a hang, and the decode engine keeps serving."""
    p, _ = route
    prompt = p.fresh("z" * 50)
    params = _prefill(client, p.url("prefill"), prompt)
    (dead_port,) = free_ports(1)
    bad = {k: v for k, v in params.items() if k != CAPABILITY_KEY}  # a secret holder's params: they pass the check
    bad = sign_params(p.params({**bad, "remote_port": dead_port, "remote_engine_id": "no-such-engine"}),
                      p.secret.encode(), time.time() + 60)
    body = {"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "kv_transfer_params": bad}
    resp = client.post(f"{p.url('decode')}/v1/completions", json=body)
    assert resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] not in ("length", "stop")
    ok = complete(client, p.url("proxy"), "still serving?", max_tokens=4)
    assert ok.token_ids == complete(client, p.url("aggregated"), "still serving?", max_tokens=4).token_ids
    # The real params still work; pulling with them also releases the prefill's held blocks.
    assert _decode(client, p.url("decode"), prompt, p.params(params)).token_ids == \
        complete(client, p.url("aggregated"), prompt, max_tokens=8).token_ids


@pytest.mark.parametrize("route", MODES, indirect=True)
def test_a_corrupted_load_is_never_served(route, client) -> None:
    """The decode engine verifies every load (``verify_kv``): a decode leg whose KV the fault knob overwrites as it
    lands (its ``X-Request-Id`` carries :data:`FAULT_MARK`) fails its digest check; with vLLM's
    ``kv_load_failure_policy`` fail (this pair's) the request ends with an error, never with tokens decoded from
    that KV; the mismatch is counted by direction, the prefill hold is freed, and the next request is verified and
    equals the aggregated engine's."""
    p, _ = route
    mismatch = ("p2pkv:kv_checks_total{", f'direction="{p.mode}"', 'outcome="mismatch"')
    before = metric_sum(client, p.url("decode"), *mismatch)
    prompt = p.fresh("c" * 70)
    params = _prefill(client, p.url("prefill"), prompt)
    body = {"model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "kv_transfer_params": p.params(params)}
    resp = client.post(f"{p.url('decode')}/v1/completions", json=body,
                       headers={"X-Request-Id": f"{FAULT_MARK}-{p.mode}-{time.monotonic_ns()}"})
    assert resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] not in ("length", "stop")
    assert wait_metric_above(client, p.url("decode"), before, *mismatch) == before + 1
    assert metric_sum(client, p.url("decode"), "p2pkv:pull_failures_total{", 'kind="digest_mismatch"') >= 1
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=30) == 0.0
    again = p.fresh("d" * 70)
    assert complete(client, p.url("proxy"), again, max_tokens=8).token_ids == \
        complete(client, p.url("aggregated"), again, max_tokens=8).token_ids
    assert metric_sum(client, p.url("decode"), "p2pkv:kv_checks_total{", 'outcome="verified"') >= 1


def _metric(client: httpx.Client, url: str, name: str) -> float:
    text = client.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_pull_metrics_on_the_engines_metrics_endpoint(pair, client) -> None:
    """Pull statistics travel through vLLM's connector stats to each engine's /metrics."""
    p, stats = pair
    complete(client, p.url("proxy"), "metrics please", max_tokens=2)
    pulled = sum(r["bytes"] for r in read_pull_stats(stats))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(client, p.url("decode"), "p2pkv:pull_bytes_total") < pulled:
        time.sleep(0.5)
    assert _metric(client, p.url("decode"), "p2pkv:pull_bytes_total") == pulled
    assert _metric(client, p.url("decode"), "p2pkv:pulls_total") == len(read_pull_stats(stats))
    assert _metric(client, p.url("decode"), "p2pkv:handshake_seconds_count") >= 1
    assert _metric(client, p.url("decode"), "p2pkv:pull_failures_total") >= 1  # the unreachable-peer test
    pushed = sum(r.get("direction") == "push" for r in read_pull_stats(stats))
    assert pushed >= 1  # the tests above ran in both modes
    text = client.get(f"{p.url('decode')}/metrics").text
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("p2pkv:pulls_by_direction_total{") and 'direction="push"' in line) == pushed
    # The prefill engine reports the notification with its next step's stats: step it until they arrive.
    deadline = time.monotonic() + 30
    while (time.monotonic() < deadline and
           _metric(client, p.url("prefill"), "p2pkv:leases_notified_total") < len(read_pull_stats(stats))):
        complete(client, p.url("prefill"), "step", max_tokens=1)
        time.sleep(0.2)
    assert _metric(client, p.url("prefill"), "p2pkv:leases_notified_total") >= len(read_pull_stats(stats))
    # The prefill engine's own push work: at least one WRITE (and its bytes) per pushed pull, each asked for.
    pushed_bytes = sum(r["bytes"] for r in read_pull_stats(stats) if r.get("direction") == "push")
    written = 'p2pkv:push_writes_total{'
    text = client.get(f"{p.url('prefill')}/metrics").text
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(written) and 'outcome="written"' in line) >= pushed
    assert _metric(client, p.url("prefill"), "p2pkv:push_bytes_total") >= pushed_bytes > 0
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("p2pkv:push_requests_total{") and 'status="accepted"' in line) >= pushed
    for phase in PULL_PHASES:  # every pull's handover phases, each once per pull
        text = client.get(f"{p.url('decode')}/metrics").text
        counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("p2pkv:pull_phase_seconds_count{") and f'phase="{phase}"' in line]
        assert sum(counts) == len(read_pull_stats(stats)), phase
    marks = read_pull_stats(stats)[-1]["marks"]
    assert marks["arrival"] <= marks["scheduled"] <= marks["taken"] <= marks["posted"] <= marks["read"] \
        <= marks["confirmed"]


def test_prefill_holds_no_blocks_after_requests(route, client) -> None:
    p, _ = route
    complete(client, p.url("proxy"), p.fresh("one more request"), max_tokens=4)
    time.sleep(0.5)
    assert wait_blocks_released(client, p.url("prefill"), timeout_s=30) == 0.0
    assert wait_blocks_released(client, p.url("decode"), timeout_s=30) == 0.0
