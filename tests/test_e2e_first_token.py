"""End to end: a streaming client's first token from the prefill engine, the rest from the decode engine.

Real engines behind the real proxy (the shared pair): every request shape is
streamed through the proxy and from the aggregated engine, and the streams
must read the same: text, token ids, ``finish_reason``, final ``usage``,
one id, ``[DONE]`` (not the chunking: a single engine already puts several
tokens in one chunk when its output processing falls behind). Shapes the proxy must not hand over
(stop strings, ``min_tokens``; seeded sampling in pull and push mode) take the plain path and match too;
in stream mode a seeded request's first token is handed over (both engines' first draw of its seed).
Logprob values must agree within the float tolerance of the other end-to-end tests.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from p2pkv.tools.demo import LOGPROB_TOLERANCE, read_pull_stats
from p2pkv.tools.proxy.first_token import Fallback
from tests.test_proxy import metric

pytestmark = pytest.mark.engines

PROMPTS = ("The KV cache moves between engines. " * 4, "Say something about disaggregation")

SHAPES: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 10},
    "token ids and usage": {"max_tokens": 8, "return_token_ids": True, "stream_options": {"include_usage": True}},
    "continuous usage": {"max_tokens": 6, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "one token": {"max_tokens": 1, "stream_options": {"include_usage": True}},
    "logprobs": {"max_tokens": 5, "logprobs": 2},
    "stop string (plain path)": {"max_tokens": 12, "stop": ["zzz"]},
    "min_tokens (plain path)": {"max_tokens": 6, "min_tokens": 3},
    "seeded sampling": {"max_tokens": 8, "temperature": 0.8, "seed": 7, "return_token_ids": True},
}


def _stream(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with client.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _read(events: list[Any], chat: bool) -> dict[str, Any]:
    """What a client takes from a stream (ids and timestamps aside)."""
    out: dict[str, Any] = {"text": "", "token_ids": [], "finish": [], "usage": None, "logprobs": [],
                           "text_offset": [], "values": []}
    for event in events[:-1]:
        assert "error" not in event, event
        if event.get("usage"):
            out["usage"] = {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for choice in event.get("choices") or []:
            out["text"] += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
            out["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                out["finish"].append(choice["finish_reason"])
            if logprobs := choice.get("logprobs"):
                out["logprobs"] += [c["token"] for c in logprobs["content"]] if chat else logprobs["tokens"]
                out["values"] += [c["logprob"] for c in logprobs["content"]] if chat else logprobs["token_logprobs"]
                out["text_offset"] += [] if chat else logprobs["text_offset"]
    assert events[-1] == "[DONE]"
    assert len({e.get("id") for e in events[:-1]}) == 1, "one id for the whole stream"
    return out


def _prefill_tokens(client: httpx.Client, proxy: str) -> float:
    return metric(client.get(f"{proxy}/metrics").text, "p2pkv_proxy_first_tokens_total", source="prefill")


def _fallbacks(client: httpx.Client, proxy: str) -> dict[str, float]:
    text = client.get(f"{proxy}/metrics").text
    return {r.value: metric(text, "p2pkv_proxy_first_token_fallbacks_total", reason=r.value) for r in Fallback}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_read_as_the_aggregated_engines(route, client, path) -> None:
    """Every proxy request but a one-token answer handed over whole pulls the prompt's KV once: the decode
    engine continues from the pulled KV (it would recompute, and still match, if it refused the params).

    Stream mode (both legs at once: :mod:`p2pkv.tools.proxy.stream_hand_over`): these greedy and seeded requests
    get the prefill engine's token first when its answer beats the decode engine's first event, the decode engine's own
    first token checked and removed; a one-token answer handed over closes a decode leg whose KV may have
    landed already."""
    p, stats = route
    chat = path.endswith("chat/completions")
    before, pulls_before = _prefill_tokens(client, p.url("proxy")), len(read_pull_stats(stats))
    fallbacks_before = _fallbacks(client, p.url("proxy"))
    decoded = 0
    closed = 0  # stream mode: one-token answers handed over, whose decode leg was closed (loaded or not)
    for prompt in map(p.fresh, PROMPTS):
        for name, shape in SHAPES.items():
            if chat and "logprobs" in shape:
                shape = {**shape, "logprobs": True, "top_logprobs": 2}
            body = {"model": "model", "temperature": 0.0, "ignore_eos": True, "stream": True, **shape}
            body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
            ref = _read(_stream(client, p.url("aggregated"), path, body), chat)
            handed = _prefill_tokens(client, p.url("proxy"))
            got = _read(_stream(client, p.url("proxy"), path, body), chat)
            values, ref_values = got.pop("values"), ref.pop("values")
            assert got == ref, f"{name!r}, prompt {prompt[:20]!r}"
            assert len(values) == len(ref_values)
            assert all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(values, ref_values, strict=True)), name
            handed = _prefill_tokens(client, p.url("proxy")) - handed
            one_token_handed = handed and shape["max_tokens"] == 1
            decoded += 0 if one_token_handed else 1
            closed += one_token_handed and p.mode == "stream"
    handed = _prefill_tokens(client, p.url("proxy")) - before
    # 5 shapes may hand over per prompt; a first token that is part of a character is not handed over
    assert handed >= len(PROMPTS), f"only {handed} first tokens came from the prefill engine"
    fell = {r: n - fallbacks_before[r] for r, n in _fallbacks(client, p.url("proxy")).items()}
    print(f"FIRST TOKENS {p.mode} {path}: {handed:g} of {len(SHAPES) * len(PROMPTS)} from the prefill engine; "
          f"the others' reasons {({r: n for r, n in fell.items() if n})}")
    assert handed + sum(fell.values()) == len(SHAPES) * len(PROMPTS), fell  # each request counted once
    n = len(PROMPTS)  # per prompt: 2 plain-path shapes; seeded sampling hands over in stream mode only
    assert fell["request"] == 2 * n and fell["sampling"] == (0 if p.mode == "stream" else n), fell
    assert fell["config"] == fell["parser"] == fell["finish_reason"] == fell["prefill_answer"] == 0, fell
    deadline = time.monotonic() + 20
    while len(read_pull_stats(stats)) - pulls_before < decoded and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5 if closed else 0)  # a closed stream that had landed is counted too
    pulls = read_pull_stats(stats)[pulls_before:]
    assert decoded <= len(pulls) <= decoded + closed
    assert all(pull["bytes"] > 0 and pull["direction"] == p.mode for pull in pulls)
