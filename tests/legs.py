"""The two legs of a disaggregated request, sent straight to two engines (no proxy)."""

from __future__ import annotations

import httpx

from p2pkv.params import TRANSFER_MODE_KEY
from p2pkv.tools.demo import Answer


def prefill_then_decode(client: httpx.Client, prefill: str, decode: str, prompt: str, max_tokens: int = 8,
                        prefilled: str | None = None, mode: str = "") -> Answer:
    """Prefill ``prefilled`` (default: ``prompt``) on one engine, then decode ``prompt`` on the other with its KV.

    Greedy, ``max_tokens`` tokens, with token ids and logprobs. ``mode``
    (``"pull"``/``"push"``): the decode leg asks for that direction
    (``kv_transfer_params.p2pkv_transfer_mode``); ``""``: the engine's setting.

    Raises:
        httpx.HTTPStatusError: the decode engine answered an error.
    """
    body = {"model": "model", "prompt": prefilled if prefilled is not None else prompt, "max_tokens": 1,
            "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}}
    params = client.post(f"{prefill}/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    if mode:
        params = {**params, TRANSFER_MODE_KEY: mode}
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params}
    resp = client.post(f"{decode}/v1/completions", json=body)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return Answer(choice["text"], choice["token_ids"], choice["logprobs"]["token_logprobs"])
