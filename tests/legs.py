"""The two legs of a disaggregated request, sent straight to two engines (no proxy)."""

from __future__ import annotations

import time

import httpx

from p2pkv.params import CAPABILITY_KEY, TRANSFER_MODE_KEY, sign_params
from p2pkv.prompt_digest import DIGEST_KEY, prompt_digest
from p2pkv.tools.demo import Answer


def moved_to(client: httpx.Client, engine: str, params: dict, prompt: str, secret: str) -> dict:
    """``params`` signed again with ``secret`` for ``prompt`` (its token ids as ``engine`` tokenizes them): what a
    holder of the secret can do, and the negative controls do on purpose, to load one prompt's KV into another."""
    ids = client.post(f"{engine}/tokenize", json={"model": "model", "prompt": prompt}).json()["tokens"]
    expiry = int(params[CAPABILITY_KEY].split(".")[1])
    moved = {k: v for k, v in params.items() if k != CAPABILITY_KEY}
    moved[DIGEST_KEY] = prompt_digest(ids[:moved["remote_num_tokens"]])
    return sign_params(moved, secret.encode(), expiry)


def prefill_then_decode(client: httpx.Client, prefill: str, decode: str, prompt: str, max_tokens: int = 8,
                        prefilled: str | None = None, mode: str = "", secret: str = "",
                        request_id: str = "") -> Answer:
    """Prefill ``prefilled`` (default: ``prompt``) on one engine, then decode ``prompt`` on the other with its KV.

    Greedy, ``max_tokens`` tokens, with token ids and logprobs. ``mode``
    (``"pull"``/``"push"``): the decode leg asks for that direction
    (``kv_transfer_params.p2pkv_transfer_mode``); ``""``: the engine's setting.
    With ``prefilled``, ``secret`` signs its params for ``prompt`` (:func:`moved_to`). ``request_id``: the
    decode leg's ``X-Request-Id`` (vLLM's request id holds it; ``""``: vLLM's own).

    Raises:
        httpx.HTTPStatusError: the decode engine answered an error.
    """
    body = {"model": "model", "prompt": prefilled if prefilled is not None else prompt, "max_tokens": 1,
            "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{prefill}/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    if prefilled is not None and prefilled != prompt:
        params = moved_to(client, decode, params, prompt, secret)
    if mode:
        params = {**params, TRANSFER_MODE_KEY: mode}
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params}
    resp = client.post(f"{decode}/v1/completions", json=body,
                       headers={"X-Request-Id": request_id} if request_id else None)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return Answer(choice["text"], choice["token_ids"], choice["logprobs"]["token_logprobs"])


def assert_decode_refused(client: httpx.Client, prefill: str, decode: str, prompt: str,
                          recomputed_like: str = "") -> None:
    """Prefill ``prompt`` on one engine, then send its decode leg (4 tokens, greedy) to the other, and check that
    the decode engine did not answer it as a finished completion: an HTTP error, or a finish reason other than
    ``length``/``stop`` (vLLM's answer to a load it refused, ``kv_load_failure_policy`` fail). With
    ``recomputed_like`` (a decode engine whose policy is recompute): it answered with that engine's tokens."""
    body = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{prefill}/v1/completions", json=body).json()["kv_transfer_params"]
    body = {"model": "model", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "kv_transfer_params": params}
    resp = client.post(f"{decode}/v1/completions", json=body)
    if recomputed_like:
        alone = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        ref = client.post(f"{recomputed_like}/v1/completions", json=alone).json()
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        return
    assert resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] not in ("length", "stop")


def metric_sum(client: httpx.Client, url: str, prefix: str, *labels: str) -> float:
    """The sum of the samples of ``url``'s ``/metrics`` whose line starts with ``prefix`` and holds every one of
    ``labels`` (``'outcome="mismatch"'``, ...)."""
    text = client.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and all(label in line for label in labels))


def wait_metric_above(client: httpx.Client, url: str, floor: float, prefix: str, *labels: str,
                      timeout_s: float = 30.0) -> float:
    """:func:`metric_sum` once it is above ``floor`` (connector stats reach ``/metrics`` with an engine step), or
    its value when ``timeout_s`` seconds have passed."""
    deadline = time.monotonic() + timeout_s
    value = metric_sum(client, url, prefix, *labels)
    while value <= floor and time.monotonic() < deadline:
        time.sleep(0.5)
        value = metric_sum(client, url, prefix, *labels)
    return value
