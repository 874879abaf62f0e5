"""What p2pkv's connector costs a prefill: one engine with it (``role: prefill``) against one without, same prompts.

Starts both engines on this host (the tiny model by default is whatever ``--model`` names: make one with
``p2pkv make-tiny-model``), warms each with three prompts, then sends ``--prompts`` prompts of ``--length``
random characters to each in turn (interleaved: the host's drift falls on both alike), one at a time,
``max_tokens=1``, and reports each engine's latency (ms: p50, p90, mean; the prefill dominates it). No request
asks to hold or load KV: what is measured is the connector being there (its hooks, its threads, the
process settings it makes). Then both engines idle for ``--idle-s`` seconds and each one's CPU over that time
is reported (cores: CPU seconds of its API server and every child process, over wall seconds). ``--json``
writes the run.

    python scripts/bench_prefill_overhead.py --model /tmp/tiny --prompts 20 --length 2000 \\
        --json docs/benchmarks/prefill-overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil
from stream_wait_cpu import cpu_s  # this folder's (a script's folder is on its path)

from p2pkv.tools.deploy.engines import EngineSpec, start_engine
from p2pkv.tools.deploy.processes import stop_children, wait_healthy


def _engines(model: str, base_port: int) -> dict[str, EngineSpec]:
    common = {"model": model, "block_size": 32, "max_model_len": 4096, "extra_args": ("--no-enable-prefix-caching",)}
    return {
        "plain": EngineSpec(name="plain", port=base_port, role=None, **common),  # type: ignore[arg-type]
        "p2pkv-prefill": EngineSpec(name="p2pkv-prefill", port=base_port + 1, role="prefill",
                                    side_channel_port=base_port + 2, side_channel_host="127.0.0.1",
                                    env={"UCX_NET_DEVICES": "lo", "P2PKV_SECRET": "bench-" * 6},
                                    **common),  # type: ignore[arg-type]
    }


def _summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"p50_ms": statistics.median(ordered), "p90_ms": ordered[max(0, int(0.9 * len(ordered)) - 1)],
            "mean_ms": statistics.mean(ordered), "n": len(ordered)}


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` and its children have used so far."""
    root = psutil.Process(pid)
    return cpu_s([root, *root.children(recursive=True)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--prompts", type=int, default=20, help="timed prompts per engine")
    ap.add_argument("--length", type=int, default=2000, help="characters per prompt (the tiny model: tokens)")
    ap.add_argument("--base-port", type=int, default=36100, help="plain engine; p2pkv engine +1, its side channel +2")
    ap.add_argument("--log-dir", default="/tmp/p2pkv-prefill-overhead", help="engine logs")
    ap.add_argument("--idle-s", type=float, default=20.0, help="seconds both engines idle while their CPU is read")
    ap.add_argument("--json", help="write the run here")
    args = ap.parse_args(argv)
    specs = _engines(args.model, args.base_port)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghij klmnop") for _ in range(args.length)) for _ in range(args.prompts)]
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    children = [start_engine(spec, logs) for spec in specs.values()]
    latencies: dict[str, list[float]] = {name: [] for name in specs}
    try:
        wait_healthy(children, 900)
        with httpx.Client(timeout=300) as client:
            def ask(spec: EngineSpec, prompt: str) -> float:
                start = time.perf_counter()
                resp = client.post(f"http://127.0.0.1:{spec.port}/v1/completions",
                                   json={"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
                resp.raise_for_status()
                return (time.perf_counter() - start) * 1000

            for spec in specs.values():
                for prompt in prompts[:3]:
                    ask(spec, prompt[::-1])
            for prompt in prompts:
                for name, spec in specs.items():
                    latencies[name].append(ask(spec, prompt))
        time.sleep(2.0)  # the last answers' bookkeeping
        before = {name: _tree_cpu_s(child.proc.pid) for name, child in zip(specs, children, strict=True)}
        time.sleep(args.idle_s)
        idle_cores = {name: (_tree_cpu_s(child.proc.pid) - before[name]) / args.idle_s
                      for name, child in zip(specs, children, strict=True)}
    finally:
        stop_children(children)
    result = {"benchmark": "prefill-overhead", "command": " ".join(["python", *sys.argv]),
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
              "length": args.length, "engines": {name: _summary(ms) for name, ms in latencies.items()},
              "idle_cores": idle_cores, "idle_s": args.idle_s, "latencies_ms": latencies}
    plain, p2pkv = (result["engines"][k]["p50_ms"] for k in ("plain", "p2pkv-prefill"))
    result["p2pkv_over_plain_p50"] = p2pkv / plain
    for name, row in result["engines"].items():
        print(f"{name:>14}: p50 {row['p50_ms']:.1f} ms, p90 {row['p90_ms']:.1f} ms, mean {row['mean_ms']:.1f} ms")
    print(f"p2pkv / plain (p50): {p2pkv / plain:.3f}")
    print("idle: " + ", ".join(f"{name} {cores:.3f} cores" for name, cores in idle_cores.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
