"""Layer streams into a decode engine of a larger TP size: each decode rank's slice of heads, or staging.

Starts a prefill engine (TP 1) and a decode engine (``--decode-tp``, default
2) of ``--model`` behind a stream proxy, sends ``--requests`` prompts of
``--length`` random tokens each, one at a time (after one warm-up prompt),
and records for each: its wall seconds (``max_tokens`` 2: the prefill, the
transfer's tail and one decode step), the prefill engine's own prefill
seconds, and the stream's wait after the prefill's last layer
(``p2pkv:stream_tail_seconds``, the mean of the request's streams, one per
decode rank); then every decode rank's bytes and seconds
per load (its pull stats). The engines run the p2pkv on ``PYTHONPATH``: a
checkout before protocol 14 (no ``head_slice``: each decode rank takes the
prefill rank's pages whole into its staging and fixes its heads up) gives
the staged baseline, ``--label`` names the system in the result.

Usage (one system and regime per invocation; ``RATE=700mbit bash scripts/limit_ucx_tcp.sh on`` for a
link-bound one)::

    PYTHONPATH=CHECKOUT python scripts/stream_tp_slice.py --model MODEL --length 2048 --requests 4 \\
        --ucx-tls tcp,self --label sliced --json docs/benchmarks/stream-tp-slice-tcp-sliced.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from p2pkv.tools.bench.results import write_json
from p2pkv.tools.bench.serve_metrics import ENGINE_PREFILL, delta, scrape
from p2pkv.tools.deploy.engines import EngineSpec, start_engine
from p2pkv.tools.deploy.processes import start_child, stop_children, wait_healthy

TAIL = "p2pkv:stream_tail_seconds"
"""The prefill engine's histogram of each stream's wait after its last layer (seconds)."""


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(length)]  # inside a tiny model's 259-token vocabulary


def _one(proxy: str, prefill: str, prompt: list[int]) -> dict[str, float]:
    """One prompt through the proxy: wall seconds, the prefill engine's prefill seconds for it, and the mean wait
    after its last layer over the request's streams (one per decode rank that reads the prefill rank)."""
    before = scrape(httpx, prefill)
    start = time.monotonic()
    resp = httpx.post(f"{proxy}/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": 2,
                                                      "temperature": 0}, timeout=900)
    resp.raise_for_status()
    wall = time.monotonic() - start
    deadline = time.monotonic() + 10
    while True:
        d = delta(before, scrape(httpx, prefill))
        if ((d.value(f"{TAIL}_count") or 0) >= 1 and (d.value(f"{ENGINE_PREFILL}_count") or 0) >= 1) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    streams = d.value(f"{TAIL}_count") or 0
    return {"wall_s": wall, "prefill_s": d.value(f"{ENGINE_PREFILL}_sum") or float("nan"),
            "tail_s": (d.value(f"{TAIL}_sum") or 0.0) / streams if streams else float("nan"), "streams": streams}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the system on ``PYTHONPATH``, print and write its result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--ucx-tls", default="cma,tcp,self", help="UCX_TLS of both engines")
    parser.add_argument("--label", default="sliced", help="the system's name in the result")
    parser.add_argument("--staging-mib", type=int, default=1024, help="the decode engine's staging_mib (a staged "
                        "stream takes the prefill rank's pages whole: 2 x the KV this rank keeps at TP 2)")
    parser.add_argument("--base-port", type=int, default=9400)
    parser.add_argument("--work", default=".p2pkv/stream-tp-slice")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    work = Path(args.work) / args.label
    work.mkdir(parents=True, exist_ok=True)
    secret = os.environ.get("P2PKV_SECRET") or "stream-tp-slice-secret-0123456789"
    env = {"UCX_NET_DEVICES": "lo", "UCX_TLS": args.ucx_tls, "P2PKV_SECRET": secret}
    port = args.base_port
    common = dict(model=args.model, block_size=32, max_model_len=args.length + 64, side_channel_host="127.0.0.1",
                  env=env, kv_cache_gib=4)
    prefill = EngineSpec(name="prefill", port=port, role="prefill", side_channel_port=port + 10,
                         extra_config={"stream_min_tokens": 0}, **common)
    stats = work / "pulls.jsonl"
    stats.unlink(missing_ok=True)
    decode = EngineSpec(name="decode", port=port + 1, role="decode", side_channel_port=port + 20,
                        tensor_parallel_size=args.decode_tp,
                        extra_config={"stats_file": str(stats), "staging_mib": args.staging_mib}, **common)
    children = [start_engine(prefill, work), start_engine(decode, work)]
    try:
        wait_healthy(children, 900)
        proxy_url = f"http://127.0.0.1:{port + 2}"
        children.append(start_child("proxy", [sys.executable, "-m", "p2pkv.tools.proxy", "--host", "127.0.0.1",
                                              "--port", str(port + 2), "--prefill", f"127.0.0.1:{port}",
                                              "--decode", f"127.0.0.1:{port + 1}", "--transfer-mode", "stream"],
                                    {**os.environ, **env}, work, f"{proxy_url}/health"))
        wait_healthy(children[-1:], 60)
        rng = random.Random(args.length)
        prefill_url = f"http://127.0.0.1:{port}"
        _one(proxy_url, prefill_url, _prompt(rng, 64))  # pushed: the proxy learns the prefill's address
        _one(proxy_url, prefill_url, _prompt(rng, args.length))  # warm-up
        skip = len(stats.read_text().splitlines()) if stats.exists() else 0
        rows = [_one(proxy_url, prefill_url, _prompt(rng, args.length)) for _ in range(args.requests)]
        time.sleep(1)
        pulls = [json.loads(line) for line in stats.read_text().splitlines()[skip:]]
    finally:
        stop_children(children)
    summary = {key: statistics.median(r[key] for r in rows) for key in ("wall_s", "prefill_s", "tail_s")}
    result = {"command": "python scripts/stream_tp_slice.py " + " ".join(argv or sys.argv[1:]),
              "system": args.label, "length": args.length, "decode_tp": args.decode_tp,
              "ucx_tls": args.ucx_tls, "requests": rows, "medians": summary,
              "pulls": [{k: p.get(k) for k in ("direction", "bytes", "seconds", "descriptors")} for p in pulls]}
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
