"""The demo: a local P/D pair + proxy answering real prompts, checked against one engine.

Steps: make the tiny model, start prefill + decode (p2pkv) + proxy and one
aggregated engine on 127.0.0.1, send the prompts through the proxy and to the
aggregated engine (greedy, with logprobs), print the answers, the KV bytes
pulled and the pull times, and whether the disaggregated tokens equal the
aggregated ones. Exit code 0 only when they do and the prefill engine holds
no blocks afterwards.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from p2pkv.tools.deploy.local import LocalPair
from p2pkv.tools.tiny_model import make_tiny_model

DEFAULT_PROMPTS = (
    "Hi",  # shorter than one block
    "The quick brown fox jumps over the lazy dog. " * 3,
    "x" * 64,  # exactly two blocks of 32 tokens (byte-level tokenizer)
    "Prefill and decode run on different machines; the KV cache moves between them. " * 4,
)
LOGPROB_TOLERANCE = 1e-3
"""Largest |logprob difference| accepted between P/D and aggregated (float32 math)."""


@dataclass
class Answer:
    """One completion: text, token ids and each token's logprob."""

    text: str
    token_ids: list[int]
    logprobs: list[float]


def complete(client: httpx.Client, base_url: str, prompt: str | list[int], max_tokens: int) -> Answer:
    """Greedy ``/v1/completions`` (``prompt``: text or token ids) with token ids and logprobs.

    Raises:
        httpx.HTTPStatusError: the server answered an error.
    """
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    resp = client.post(f"{base_url}/v1/completions", json=body)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return Answer(choice["text"], list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]))


def max_logprob_diff(a: Answer, b: Answer) -> float:
    """Largest absolute logprob difference over the common tokens."""
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)), default=0.0)


def kv_cache_usage(client: httpx.Client, base_url: str) -> float:
    """``vllm:kv_cache_usage_perc`` of an engine (0.0 = no blocks held)."""
    text = client.get(f"{base_url}/metrics").text
    values = [float(m.group(1)) for m in re.finditer(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)]
    return sum(values)


def wait_blocks_released(client: httpx.Client, base_url: str, timeout_s: float = 30.0) -> float:
    """Poll until the engine holds no KV blocks; returns the last usage seen."""
    deadline = time.monotonic() + timeout_s
    usage = kv_cache_usage(client, base_url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = kv_cache_usage(client, base_url)
    return usage


def read_pull_stats(path: Path) -> list[dict]:
    """The JSON lines the decode engine wrote, one per finished pull."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_demo(workdir: Path = Path(".p2pkv"), prompts: tuple[str, ...] = DEFAULT_PROMPTS,
             max_tokens: int = 16, base_port: int = 8000) -> int:
    """Run the demo; returns the process exit code (0: tokens equal, no blocks held)."""
    model = make_tiny_model(workdir / "tiny-model")
    stats = (workdir / "pulls.jsonl").resolve()
    stats.unlink(missing_ok=True)
    pair = LocalPair(
        model=str(model), proxy_port=base_port, prefill_port=base_port + 100,
        decode_port=base_port + 200, aggregated_port=base_port + 300,
        log_dir=workdir / "logs", decode_extra_config={"stats_file": str(stats)},
    )
    print(f"starting prefill, decode, aggregated engines and the proxy (logs in {pair.log_dir}) ...",
          flush=True)
    ok = True
    with pair, httpx.Client(timeout=120.0) as client:
        print(f"proxy {pair.url('proxy')}  prefill {pair.url('prefill')}  decode {pair.url('decode')}"
              f"  aggregated {pair.url('aggregated')}\n")
        for prompt in prompts:
            pd = complete(client, pair.url("proxy"), prompt, max_tokens)
            ref = complete(client, pair.url("aggregated"), prompt, max_tokens)
            same = pd.token_ids == ref.token_ids
            diff = max_logprob_diff(pd, ref)
            ok &= same and diff <= LOGPROB_TOLERANCE
            print(f"prompt  {prompt[:60]!r}{'...' if len(prompt) > 60 else ''}")
            print(f"  P/D        {pd.token_ids}")
            print(f"  aggregated {ref.token_ids}")
            print(f"  tokens equal: {same}   max |logprob diff|: {diff:.2e}\n")
        usage = wait_blocks_released(client, pair.url("prefill"))
        pulls = read_pull_stats(stats)
    total_bytes = sum(p["bytes"] for p in pulls)
    total_s = sum(p["seconds"] for p in pulls)
    print(f"KV pulled by decode: {len(pulls)} pulls, {total_bytes} bytes, {total_s * 1e3:.2f} ms in total")
    for p in pulls:
        print(f"  {p['blocks']} blocks, {p['bytes']} B in {p['descriptors']} descriptors, "
              f"{p['seconds'] * 1e3:.2f} ms")
    print(f"prefill KV cache usage after the run: {usage:.4f} (0 = every held block released)")
    ok &= usage == 0 and len(pulls) == len(prompts)
    print("RESULT:", "disaggregated tokens equal the aggregated engine's" if ok else "MISMATCH")
    return 0 if ok else 1
