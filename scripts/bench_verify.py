#!/usr/bin/env python3
"""What verified KV (``verify_kv``) costs on the transfer path: loads with and without it, paired in one run.

Two processes on this host, each a real :class:`p2pkv.worker.WorkerSide` with a synthetic KV cache
(:func:`p2pkv.testing.make_kv_caches`, ``LBHNC``, bfloat16, ``--layers`` x ``--heads`` x ``--head-dim`` K and V,
blocks of ``--block-size`` tokens: 32 KiB per token by default): a prefill rank holding the requests, and in this
process two decode ranks, one with ``verify_kv`` and one without, loading the same blocks of the same held requests
in alternating order (so both see the same background load). A load is timed from ``start_load_kv`` to the
``get_finished`` that reports it (vLLM's view: handshake done once before, fence questions, the READ or the push's
WRITE, and with ``verify_kv`` both digests and the check). Per length (``--tokens``) and way (``--mode``), the
median and p90 of ``--requests`` loads each, and the verified/unverified ratio of the medians.

``--tls`` sets ``UCX_TLS`` for both processes (unset: UCX's choice, ``cma`` between processes of one host;
``tcp,self``: the network stack over loopback). ``--rate-mbit`` limits loopback with ``tc`` (token bucket, as
root; removed at the end) so ``tcp`` stands for a network link of that speed; the side channel shares it.

    python scripts/bench_verify.py --tokens 1024,4096,16384 --mode pull,push --json docs/benchmarks/verify-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import ModelInfo
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide

ENGINE = "bench-prefill"
COMPAT = "bench"


def _free_port(run: int = 1) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + run < 65535:
            return port


def _model(args: argparse.Namespace) -> ModelInfo:
    return ModelInfo(kv_layout="LBHNC", attn_layout="HND", dtype="bfloat16", num_kv_heads=args.heads,
                     head_dim=args.head_dim, block_size=args.block_size, total_num_kv_heads=args.heads)


def _caches(args: argparse.Namespace, blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    fill: Any = "pattern" if seed is not None else 0.0
    _, views = make_kv_caches("LBHNC", num_layers=args.layers, num_blocks=blocks, num_heads=args.heads,
                              block_size=args.block_size, head_dim=args.head_dim, dtype=torch.bfloat16,
                              fill=fill, seed=seed or 0)
    return views


def _worker(engine: str, port: int, args: argparse.Namespace, **settings: Any) -> WorkerSide:

    config = P2pKvConfig(side_channel_host="127.0.0.1", side_channel_port=port, insecure=True, **settings)
    return WorkerSide(engine, config, 0, 1, "127.0.0.1", port, COMPAT, _model(args))


def _prefill(args: argparse.Namespace, port: int, blocks: int, ids: list[str], ready: Any, stop: Any) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    worker = _worker(ENGINE, port, args, role="prefill", lease_s=3600.0)
    worker.register_kv_caches(_caches(args, blocks, seed=1), blocks)
    worker.start_load_kv(P2pKvMetadata(send_leases={r: time.monotonic() + 3600.0 for r in ids}))
    ready.set()
    while not stop.is_set():
        worker.get_finished()
        time.sleep(0.001)
    worker.shutdown()


def _load(worker: Any, request: str, remote_id: str, port: int, blocks: list[int], mode: str) -> float:
    remote = RemotePrefill(ENGINE, remote_id, "127.0.0.1", port, tuple(blocks), 1, transfer_mode=mode)
    spec = LoadSpec(request, tuple(blocks), tuple(blocks), remote)
    start = time.perf_counter()
    worker.start_load_kv(P2pKvMetadata(loads=[spec]))
    while True:
        _, recving = worker.get_finished()
        if request in recving:
            elapsed = time.perf_counter() - start
            errors = worker.get_block_ids_with_load_errors()
            if errors:
                raise RuntimeError(f"load {request} failed ({len(errors)} blocks): see the log")
            return elapsed
        time.sleep(0.0002)


def _limit(rate_mbit: int) -> None:
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit", "burst",
                    "8mbit", "latency", "1s"], check=True)  # a queue deep enough that TCP is paced, not dropped


def _unlimit() -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (tokens, mode) pair's loads with and without ``verify_kv``; the figures as a JSON-able dict."""
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    lengths = [int(t) for t in args.tokens.split(",")]
    modes = args.mode.split(",")
    blocks = -(-max(lengths) // args.block_size)
    ids = [f"held-{i}" for i in range(len(lengths) * len(modes) * (args.requests + 1) * 2)]
    port = _free_port()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_prefill, args=(args, port, blocks, ids, ready, stop), daemon=True)
    if args.rate_mbit:
        _limit(args.rate_mbit)
    proc.start()
    results: list[dict[str, Any]] = []
    decoders: dict[bool, Any] = {}
    try:
        if not ready.wait(120):
            raise RuntimeError("the prefill process did not start")
        for verify in (False, True):
            worker = decoders[verify] = _worker(f"bench-decode-{int(verify)}", _free_port(), args, verify_kv=verify)
            worker.register_kv_caches(_caches(args, blocks, seed=None), blocks)
        held = iter(ids)
        for tokens in lengths:
            use = list(range(-(-tokens // args.block_size)))
            for mode in modes:
                times: dict[bool, list[float]] = {False: [], True: []}
                for i in range(args.requests + 1):  # the first of each: warm-up (handshake, agents loaded)
                    for verify in ((False, True) if i % 2 else (True, False)):
                        seconds = _load(decoders[verify], f"{mode}-{tokens}-{i}-{int(verify)}", next(held), port,
                                        use, mode)
                        if i:
                            times[verify].append(seconds)
                row: dict[str, Any] = {"tokens": tokens, "mode": mode,  # K and V, 2 bytes each
                                       "bytes": len(use) * args.layers * args.block_size * args.heads
                                       * 2 * args.head_dim * 2}
                for verify, label in ((False, "off"), (True, "on")):
                    ms = sorted(t * 1e3 for t in times[verify])
                    row[label] = {"p50_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                                  "all_ms": ms}
                row["ratio_p50"] = row["on"]["p50_ms"] / row["off"]["p50_ms"]
                row["share_of_on_p50"] = 1 - 1 / row["ratio_p50"]
                results.append(row)
                print(f"{tokens:>6} tokens {mode:>4}: off p50 {row['off']['p50_ms']:.2f} ms, on p50 "
                      f"{row['on']['p50_ms']:.2f} ms: x{row['ratio_p50']:.2f}", flush=True)
        checks = {str(v): (decoders[v].take_stats() or {}).get("kv_checks", {}) for v in decoders}
    finally:
        for worker in decoders.values():
            worker.shutdown()
        stop.set()
        proc.join(30)
        if args.rate_mbit:
            _unlimit()
    return {"command": " ".join(sys.argv), "machine": {"cpu": platform.processor() or platform.machine(),
                                                       "cores": os.cpu_count()},
            "tls": args.tls, "rate_mbit": args.rate_mbit, "requests": args.requests,
            "shape": {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
                      "block_size": args.block_size, "dtype": "bfloat16"},
            "kv_checks": checks, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--mode", default="pull,push")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tls", default="", help="UCX_TLS for both processes (empty: UCX's choice, cma on one "
                        "host; tcp,self: the network stack)")
    parser.add_argument("--rate-mbit", type=int, default=0, help="limit loopback to this rate with tc (root)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
