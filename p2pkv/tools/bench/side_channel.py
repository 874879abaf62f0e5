"""``p2pkv bench side-channel``: fence questions against a busy prefill engine's side channel.

Starts a local pair with an aggregated engine (:class:`p2pkv.tools.deploy.local.LocalPair`), holds one
request on the prefill engine (a prefill leg with ``do_remote_decode``), then, while a steady stream of long
prompts keeps all three engines prefilling, ``--clients`` processes each ask the prefill rank the fence's
question about that hold (:func:`handshake.query_holds` over one :class:`handshake.HoldLink`, asked
again once after ``--timeout-s`` without a reply, as a decode worker's fence does after a READ) every
``--interval-ms``. Reports the reply latency (p50, p99, max), the count, how many needed longer than one
timeout, and the questions without a reply after both (``lost``: none may be).
With ``--timing-log DIR`` both sides log each question's times (``p2pkv.handshake.timing`` at DEBUG): the
engines into their logs, each client into ``DIR/client-<n>.log``; a question's nonce prefix joins them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import string
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HOLD_PROMPT_CHARS = 300
ATTEMPTS = 2
"""Times a question is asked before it counts as lost: the fence's (``p2pkv.decode.fence.FENCE_ATTEMPTS``, not
imported here: the clients load only :mod:`handshake`, so they start in a second on a busy host)."""


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _prompt(chars: int, rng: random.Random) -> str:
    """Random lowercase words (the tiny model's tokenizer is byte-level: one token per character)."""
    return "".join(rng.choice(string.ascii_lowercase + "    ") for _ in range(chars))


def _hold(prefill_url: str) -> dict[str, Any]:
    """Hold one request on the prefill engine (its prefill leg); the ``kv_transfer_params`` it answers."""
    from p2pkv.tools.proxy.upstream import PREFILL_PARAMS

    answer = _post(f"{prefill_url}/v1/completions", {
        "model": "model", "prompt": _prompt(HOLD_PROMPT_CHARS, random.Random(0)), "max_tokens": 1,
        "kv_transfer_params": PREFILL_PARAMS})
    return answer["kv_transfer_params"]


def _logging_config(path: Path) -> None:
    """Write a vLLM logging config (``VLLM_LOGGING_CONFIG_PATH``) that also logs p2pkv, its side-channel
    timings at DEBUG, to the engines' logs."""
    handler = {"handlers": ["stderr"], "level": "INFO", "propagate": False}
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(process)d %(name)s %(message)s"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": handler, "p2pkv": handler, "p2pkv.handshake.timing": {"level": "DEBUG"}}}))


def _asker(params: dict[str, Any], secret: bytes, seconds: float, interval_s: float, timeout_s: float,
           out: Any, timing_log: str = "") -> None:
    """One client process: the fence's question every ``interval_s`` for ``seconds``; puts its results (and
    with ``timing_log`` logs each question's times there)."""
    import logging

    from handshake import Destination, HandshakeTimeoutError, HoldLink, query_holds

    if timing_log:
        handler = logging.FileHandler(timing_log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(message)s"))
        logging.getLogger("p2pkv.handshake.timing").addHandler(handler)
        logging.getLogger("p2pkv.handshake.timing").setLevel(logging.DEBUG)

    host, port, rid = params["remote_host"], int(params["remote_port"]), params["remote_request_id"]
    blocks = [b for group in params["remote_block_ids"] for b in group]
    link = HoldLink(host, port, secret)
    latencies, lost, errors, not_held = [], 0, [], 0
    end = time.monotonic() + seconds
    while (start := time.monotonic()) < end:
        try:
            reply = query_holds(Destination(host, port, params["remote_engine_id"], 0), [rid], [blocks],
                                "bench-side-channel", 10.0, secret=secret, timeout_s=timeout_s, link=link,
                                attempts=ATTEMPTS)
            latencies.append(time.monotonic() - start)
            not_held += bool(reply.expired or reply.not_held or reply.unknown)
        except HandshakeTimeoutError:
            lost += 1
        except Exception as exc:  # reported, not fatal
            errors.append(repr(exc)[:200])
        time.sleep(max(0.0, interval_s - (time.monotonic() - start)))
    link.close()
    out.put({"latencies": latencies, "lost": lost, "errors": errors, "not_held": not_held})


def _load(urls: list[str], chars: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """One stream of long prompts, round robin over ``urls``, until ``stop``."""
    rng, i = random.Random(), 0
    while not stop.is_set():
        try:
            _post(f"{urls[i % len(urls)]}/v1/completions",
                  {"model": "model", "prompt": _prompt(chars, rng), "max_tokens": 8})
            counts["completed"] += 1
        except Exception:
            counts["failed"] += 1
        i += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engines, measure for ``args.seconds``, stop everything; the results."""
    from p2pkv.tools.deploy.local import LocalPair

    b = args.port_base
    if not args.model:
        from p2pkv.tools.tiny_model import make_tiny_model

        args.model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="p2pkv-bench-sc-")) / "tiny"))
    if args.timing_log:
        Path(args.timing_log).mkdir(parents=True, exist_ok=True)
        _logging_config(Path(args.timing_log) / "logging.json")
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(Path(args.timing_log) / "logging.json")
    pair = LocalPair(model=args.model, prefill_port=b + 100, decode_port=b + 200, proxy_port=b,
                     aggregated_port=b + 300, side_channel_port=b + 500,
                     log_dir=Path(args.log_dir or tempfile.mkdtemp(prefix="p2pkv-bench-sc-")))
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engines (finally) when terminated
    pair.start()
    started_s = time.monotonic() - t0
    try:
        params = _hold(pair.url("prefill"))
        stop, counts = threading.Event(), {"completed": 0, "failed": 0}
        loads = [threading.Thread(target=_load, args=([pair.url("proxy"), pair.url("aggregated")], args.prompt_chars,
                                                       stop, counts), daemon=True) for _ in range(args.streams)]
        for t in loads:
            t.start()
        time.sleep(args.warmup_s)  # the engines are busy before the first question
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        logs = [str(Path(args.timing_log) / f"client-{n}.log") if args.timing_log else "" for n in range(args.clients)]
        askers = [ctx.Process(target=_asker, args=(params, pair.secret.encode(), args.seconds, args.interval_ms / 1e3,
                                                   args.timeout_s, out, log)) for log in logs]
        for p in askers:
            p.start()
        results = [out.get(timeout=args.seconds + 600) for _ in askers]
        for p in askers:
            p.join(timeout=10)
        stop.set()
        for t in loads:
            t.join(timeout=130)
    finally:
        pair.stop()
    lat = sorted(x for r in results for x in r["latencies"])

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 2) if lat else float("nan")

    return {"bench": "side-channel", "clients": args.clients, "seconds": args.seconds, "interval_ms": args.interval_ms,
            "timeout_s": args.timeout_s, "streams": args.streams, "prompt_chars": args.prompt_chars,
            "count": len(lat), "lost": sum(r["lost"] for r in results),
            "over_one_timeout": sum(x > args.timeout_s for x in lat),
            "errors": [e for r in results for e in r["errors"]],
            "answers_not_held": sum(r["not_held"] for r in results),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(lat[-1] * 1e3, 2) if lat else None,
            "prompts_completed": counts["completed"], "prompts_failed": counts["failed"],
            "engines_started_s": round(started_s, 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2pkv bench side-channel``."""
    p.add_argument("--model", default="", help="model directory (default: p2pkv's tiny model, made in a temporary "
                                               "folder)")
    p.add_argument("--clients", type=int, default=8, help="client processes asking the fence's question")
    p.add_argument("--seconds", type=float, default=90.0, help="how long each client asks")
    p.add_argument("--interval-ms", type=float, default=20.0, help="pause between one client's questions")
    p.add_argument("--timeout-s", type=float, default=3.0, help="wait for each reply (the fence's timeout)")
    p.add_argument("--streams", type=int, default=3, help="concurrent streams of long prompts")
    p.add_argument("--prompt-chars", type=int, default=1500, help="prompt length (tokens: the tiny model is bytes)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the first question")
    p.add_argument("--port-base", type=int, default=18000, help="proxy port; engines +100/+200/+300, side channel +500")
    p.add_argument("--log-dir", default="", help="engine logs (default: a temporary folder)")
    p.add_argument("--timing-log", metavar="DIR", default="", help="log every question's times on both sides")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")


def cli_main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench side-channel``, print the figures; exit 1 when a reply was lost."""
    from p2pkv.tools.bench.machine import command_line, machine_info
    from p2pkv.tools.bench.report import write_json

    result = run(args)
    print(f"{result['count']} replies ({result['over_one_timeout']} after one timeout), lost {result['lost']}, "
          f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms; "
          f"{result['prompts_completed']} prompts served meanwhile")
    if args.json:
        result["command"] = command_line(sys.argv)
        result["machine"] = machine_info()
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if result["lost"] or result["errors"] else 0
