"""Multi-turn reuse through real engines and `p2pkv proxy` (docs/multi-turn.md), with and without it.

Starts `p2pkv launch local` (the tiny model; both engines role both, the decode engine keeping turns for
``--keep-turns-s``, 0: no reuse; an aggregated engine with prefix caching beside them), then runs
``--conversations`` conversations of ``--turns`` turns through the proxy: each turn's prompt is the last turn's
prompt, its answer and a new message (token ids: they round-trip exactly). Each answer is compared with the
aggregated engine's, token for token; counted: the turns the prefill engine loaded from the decode engine
(``p2pkv:pulls_total``), its prompt tokens by source (vLLM's ``vllm:prompt_tokens_by_source``: computed there,
its prefix cache, loaded), and the latency of turns 2 and later (whole answers of ``--answer-tokens`` tokens; the
aggregated engine's too). With ``--via legs`` the script is the router instead of the proxy: it sends each
turn's prefill leg itself, with the last decode answer's params, and times it (the turn's first token: the proxy
hands the client the prefill engine's token), then the decode leg; the aggregated engine's first token is timed on
a streamed request. With ``--trace`` the conversations are shaped like a trace's instead: Mooncake's public
conversation trace (``FAST25-release/traces/conversation_trace.jsonl`` in github.com/kvcache-ai/Mooncake: per
request its input and output lengths and the hashes of its 512-token prompt blocks); a request whose prompt blocks
start with an earlier request's full blocks is that conversation's next turn. The first ``--conversations`` of at
least ``--turns`` turns are taken, their lengths divided by ``--trace-scale`` (what the model's context holds), each
turn's new message the tokens its prompt adds to the last prompt and answer. Prints one JSON line; exits 1 when an
answer differs, or, reusing, no turn was loaded.

    python scripts/multi_turn_check.py [--conversations 3] [--turns 3] [--keep-turns-s 120] [--via proxy|legs]
        [--model DIR] [--trace conversation_trace.jsonl --trace-scale 16]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BASE = 18700


def _metric(client: httpx.Client, url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get(f"{url}/metrics").text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _complete(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """The answer's token ids and its latency (seconds)."""
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    start = time.perf_counter()
    resp = client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()["choices"][0]["token_ids"], time.perf_counter() - start


def _legs(client: httpx.Client, prefill: str, decode: str, ids: list[int], max_tokens: int,
          kept: dict | None) -> tuple[list[int], float, dict | None]:
    """One turn as a router sends it: the prefill leg (with the conversation's kept turn, if any), timed: the
    turn's first token; then the decode leg. ``(answer ids, first-token seconds, the decode answer's params)``."""
    body = {"model": "model", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True, **(kept or {})}}
    start = time.perf_counter()
    resp = client.post(f"{prefill}/v1/completions", json=body)
    resp.raise_for_status()
    first = time.perf_counter() - start
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": resp.json()["kv_transfer_params"]}
    resp = client.post(f"{decode}/v1/completions", json=body)
    resp.raise_for_status()
    answer = resp.json()
    return answer["choices"][0]["token_ids"], first, answer.get("kv_transfer_params")


def _first_token_s(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> float:
    """Seconds to the first streamed token of a greedy completion of ``ids``."""
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    return time.perf_counter() - start


Plan = list[tuple[int, int]]
"""A conversation: per turn, the tokens its new message adds and the tokens of its answer."""


def synthetic_plans(conversations: int, turns: int, answer: int, opening: int) -> list[Plan]:
    """Conversations that open with ``opening`` tokens, each later turn adding 12, every answer ``answer`` long."""
    return [[(opening if t == 0 else 12, answer) for t in range(turns)] for _ in range(conversations)]


def trace_plans(path: Path, conversations: int, turns: int, scale: float, max_tokens: int) -> list[Plan]:
    """The first ``conversations`` conversations of at least ``turns`` turns of a Mooncake-format trace (see the
    module docstring), lengths divided by ``scale``, each cut before a turn that would pass ``max_tokens``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_blocks: dict[tuple[int, ...], int] = {}
    parent: dict[int, int] = {}
    for i, row in enumerate(rows):
        blocks = tuple(row["hash_ids"])
        for n in range(len(blocks), 2, -1):  # the longest earlier prompt (its full blocks) this one extends
            if blocks[:n] in by_blocks:
                parent[i] = by_blocks[blocks[:n]]
                break
        if len(blocks) > 2:
            by_blocks.setdefault(blocks[:-1], i)
    child: dict[int, int] = {}
    for i, p in sorted(parent.items()):
        child.setdefault(p, i)  # a conversation follows its first continuation
    plans: list[Plan] = []
    for root in (i for i in range(len(rows)) if i not in parent):
        chain, at = [root], root
        while at in child:
            at = child[at]
            chain.append(at)
        plan, total = [], 0
        for k, i in enumerate(chain):
            row = rows[i]
            added = row["input_length"] - (0 if k == 0 else rows[chain[k - 1]]["input_length"]
                                          + rows[chain[k - 1]]["output_length"])
            new, answer = max(4, round(added / scale)), max(1, round(row["output_length"] / scale))
            if total + new + answer > max_tokens:
                break
            plan.append((new, answer))
            total += new + answer
        if len(plan) >= turns:
            plans.append(plan)
        if len(plans) == conversations:
            break
    return plans


def _sources(client: httpx.Client, url: str) -> dict[str, float]:
    return {source: _metric(client, url, f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="model",'
                                         f'source="{source}"}}')
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--keep-turns-s", type=float, default=120.0)
    ap.add_argument("--via", choices=("proxy", "legs"), default="proxy")
    ap.add_argument("--model", default=str(ROOT / ".p2pkv" / "tiny-model"),
                    help="model directory (default: the tiny model, made on first use)")
    ap.add_argument("--trace", type=Path, help="a Mooncake-format conversation trace (JSON lines)")
    ap.add_argument("--trace-scale", type=float, default=16.0,
                    help="the trace's lengths are divided by this (default 16: a 512-token block is 32 tokens)")
    ap.add_argument("--max-tokens", type=int, default=1900, help="longest conversation (tokens; the context)")
    ap.add_argument("--log-dir", default="/tmp/p2pkv-multi-turn")
    ap.add_argument("--block-size", type=int, default=32, help="tokens per block")
    ap.add_argument("--extra-vllm-args", default="", help="more `vllm serve` flags for every engine")
    args = ap.parse_args()
    model = Path(args.model)
    p2pkv = str(ROOT / ".venv" / "bin" / "p2pkv")
    if not model.exists():
        subprocess.run([p2pkv, "make-tiny-model", str(model)], check=True)
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
           "P2PKV_SECRET": secrets.token_hex(32)}
    proxy, prefill, decode, aggregated = (f"http://127.0.0.1:{BASE + i}" for i in range(4))
    launch = subprocess.Popen(
        [p2pkv, "launch", "local", "--model", str(model), "--proxy-port", str(BASE), "--prefill-port",
         str(BASE + 1), "--decode-port", str(BASE + 2), "--aggregated-port", str(BASE + 3),
         "--side-channel-port", str(BASE + 10), "--log-dir", args.log_dir, "--block-size", str(args.block_size),
         *((f"--extra-vllm-args={args.extra_vllm_args}",) if args.extra_vllm_args else ()),
         "--kv-connector-extra-config", json.dumps({"role": "both"}),
         "--decode-extra-config", json.dumps({"keep_turns_s": args.keep_turns_s})],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=120) as client:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if all(client.get(f"{u}/health").status_code == 200 for u in (proxy, aggregated)):
                        break
                except httpx.HTTPError:
                    pass
                if launch.poll() is not None or time.monotonic() > deadline:
                    print(f"the pair did not start: see {args.log_dir}", file=sys.stderr)
                    return 1
                time.sleep(2)
            text = {"model": "model", "prompt": "Tell me about KV caches and the turns of a conversation. " * 40}
            pool = client.post(f"{prefill}/tokenize", json=text).json()["tokens"]
            if args.trace is not None:
                plans = trace_plans(args.trace, args.conversations, args.turns, args.trace_scale, args.max_tokens)
            else:
                plans = synthetic_plans(args.conversations, args.turns, args.answer_tokens, 38)
            pulls0, sources0 = _metric(client, prefill, "p2pkv:pulls_total"), _sources(client, prefill)
            turns = differ = 0
            later: list[float] = []
            alone: list[float] = []
            for c, plan in enumerate(plans):
                ids: list[int] = [10 + c]  # the conversation's own first token: no two share a prefix
                kept = None
                for turn, (new, answer) in enumerate(plan):
                    ids = [*ids, *(pool[(c * 31 + turn * 7 + j) % len(pool)] for j in range(new))]
                    if args.via == "legs":
                        got, seconds, kept = _legs(client, prefill, decode, ids, answer, kept)
                        ref_seconds = _first_token_s(client, aggregated, ids, answer)  # its cache first
                        ref, _ = _complete(client, aggregated, ids, answer)
                    else:
                        got, seconds = _complete(client, proxy, ids, answer)
                        ref, ref_seconds = _complete(client, aggregated, ids, answer)
                    turns += 1
                    differ += got != ref
                    if turn:
                        later.append(seconds)
                        alone.append(ref_seconds)
                    ids = [*ids, *got]
            pulls = _metric(client, prefill, "p2pkv:pulls_total") - pulls0
            sources = {k: v - sources0[k] for k, v in _sources(client, prefill).items()}
        timed = "first_token" if args.via == "legs" else "latency"
        print(json.dumps({"keep_turns_s": args.keep_turns_s, "via": args.via, "conversations": len(plans),
                          "trace": str(args.trace or ""), "turns": turns,
                          "answers_differing": differ, "later_turns": len(later), "turns_loaded_from_decode": pulls,
                          "prefill_prompt_tokens": sources,
                          f"later_turn_{timed}_ms": {"p50": _p(later, 0.5), "p90": _p(later, 0.9)},
                          f"aggregated_later_turn_{timed}_ms": {"p50": _p(alone, 0.5), "p90": _p(alone, 0.9)}}))
        return 1 if differ or (args.keep_turns_s and pulls < 1) else 0
    finally:
        launch.terminate()
        launch.wait(60)


if __name__ == "__main__":
    sys.exit(main())
