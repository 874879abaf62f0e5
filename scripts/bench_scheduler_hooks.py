#!/usr/bin/env python3
"""The cost per engine step of p2pkv's scheduler hooks (docs/benchmarks/scheduler-hooks.md).

Drives a real ``P2pKvConnector`` in vLLM's scheduler role (built by vLLM's
``KVConnectorFactory``, as vLLM's ``Scheduler`` builds it) with real
``vllm.v1.request.Request`` objects and ``KVCacheBlocks``, calling the hooks
in the order vLLM's scheduler does: ``on_new_request`` on arrival;
``get_num_new_matched_tokens``, ``get_loaded_kv_cache_group_ids`` (on an
asynchronous load) and ``update_state_after_alloc`` on admission (again when a
request leaves ``WAITING_FOR_REMOTE_KVS``); ``build_connector_meta`` once per
step; ``request_finished``, ``update_connector_output``,
``get_kv_connector_stats`` and ``take_events`` per output.

Each side is held at ``--running`` running and ``--waiting`` waiting-for-KV
requests while ``churn`` requests arrive, move on and finish every step:

* ``decode``: arrivals carry signed ``do_remote_prefill`` params and get a
  ``LoadSpec``; ``churn`` waiting requests are reported received and promoted.
* ``prefill``: arrivals carry ``do_remote_decode``; finished requests are held
  (a lease each) and ``churn`` holds are released by ``finished_sending``.

A step's cost is the summed wall time (``time.perf_counter_ns``) of its hook
calls, timer included, simulation excluded; reported as p50 / p99 / mean /
max µs per step and each hook's µs per step and per call. Target: p99 below
50 µs per step at 256 running + 256 waiting.

    PYTHONPATH=. python scripts/bench_scheduler_hooks.py --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

SIDES = ("decode", "prefill")
TARGET_US = 50.0
"""Target: p99 µs per step at the default state."""
HOOKS = ("on_new_request", "get_num_new_matched_tokens", "get_loaded_kv_cache_group_ids",
         "update_state_after_alloc", "build_connector_meta", "request_finished", "update_connector_output",
         "get_kv_connector_stats", "take_events")
SECRET = secrets.token_hex(32)
"""Side-channel secret: the decode side checks each request's signed ``kv_transfer_params``."""


def make_connector(side: str, block_size: int) -> Any:
    """A ``P2pKvConnector`` in the scheduler role from vLLM's ``KVConnectorFactory`` (``kv_both``,
    side channel on 127.0.0.1, secret :data:`SECRET`).

    Raises:
        ValueError: vLLM refuses the configuration.
    """
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from p2pkv.plugin import register

    register()
    fd, secret_file = tempfile.mkstemp(prefix="p2pkv-bench-secret-")
    os.write(fd, SECRET.encode())
    os.close(fd)
    atexit.register(os.unlink, secret_file)
    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role="kv_both", engine_id=f"bench-{side}",
                           kv_connector_extra_config={"side_channel_host": "127.0.0.1", "secret_file": secret_file})
    config = VllmConfig(kv_transfer_config=ktc, cache_config=CacheConfig(block_size=block_size))
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                               KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[]))


class Sim:
    """One side's engine state; :meth:`step` makes one engine step's hook calls, timing them while ``timing``.

    Attributes:
        step_ns: summed hook time of the current step (ns). hook_ns / hook_calls: per hook, all timed steps.
        count: what the hooks produced (arrived, admitted, pulls, pull_blocks, holds, ...; counts).
    """

    def __init__(self, side: str, conn: Any, prompt_tokens: int, block_size: int, running: int,
                 waiting: int) -> None:
        self.side, self.conn, self.prompt_tokens = side, conn, prompt_tokens
        self.nblocks = -(-prompt_tokens // block_size)
        self.target_running, self.target_waiting = running, waiting
        self.running: deque[Any] = deque()
        self.waiting: deque[Any] = deque()  # decode: waiting for remote KV; prefill: held
        self.ready: list[Any] = []  # decode: KV received, promoted next step
        self.blocks: dict[str, Any] = {}
        self.free_blocks: deque[Any] = deque()
        self.next_block, self.n = 1, 0  # vLLM's block 0 is the null block
        self.timing, self.step_ns = False, 0
        self.hook_ns, self.hook_calls = dict.fromkeys(HOOKS, 0), dict.fromkeys(HOOKS, 0)
        self.count = dict.fromkeys(("arrived", "admitted", "pulls", "pull_blocks", "finished", "holds",
                                    "hold_params", "leases_sent", "released", "promoted", "metas"), 0)

    def call(self, hook: str, *args: Any) -> Any:
        """``self.conn.<hook>(*args)``, its wall time counted while timing."""
        t0 = time.perf_counter_ns()
        out = getattr(self.conn, hook)(*args)
        dt = time.perf_counter_ns() - t0
        if self.timing:
            self.step_ns += dt
            self.hook_ns[hook] += dt
            self.hook_calls[hook] += 1
        return out

    def allocate(self) -> Any:
        """A request's blocks (no hash, as vLLM allocates for an asynchronous load)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        out = []
        for _ in range(self.nblocks):
            if not self.free_blocks:
                self.free_blocks.append(KVCacheBlock(self.next_block))
                self.next_block += 1
            out.append(self.free_blocks.popleft())
        return KVCacheBlocks((out,))

    def new_request(self) -> Any:
        """A vLLM ``Request`` with this side's ``kv_transfer_params``, as the proxy sends them."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from p2pkv.params import make_prefill_response_params, sign_params

        self.n += 1
        if self.side == "decode":
            first = 1 + self.n % 1000
            params = make_prefill_response_params(
                engine_id="bench-prefill", request_id=f"prefill-{self.n}", host="127.0.0.1", port=5600,
                block_ids=list(range(first, first + self.nblocks)), tp_size=1, num_tokens=self.prompt_tokens,
                expiry_time=time.time() + 120.0)
            sign_params(params, SECRET.encode(), time.time() + 120.0)
            sp = SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": params})
        else:
            sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True,
                                                                                "do_remote_prefill": False}})
        return Request(f"{self.side}-{self.n}", [(7 * i) % 32000 for i in range(self.prompt_tokens)], sp, None)

    def step(self, arrive: int) -> None:
        """One engine step: ``arrive`` arrivals admitted, promotions, ``build_connector_meta``, finishes and
        releases that keep the running and waiting counts."""
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        new = [self.new_request() for _ in range(arrive)]
        for req in new:
            self.call("on_new_request", req)
        for req in new:  # admission
            self.count["arrived"] += 1
            ext, load_async = self.call("get_num_new_matched_tokens", req, 0)
            if load_async:
                self.call("get_loaded_kv_cache_group_ids", req)
            blocks = self.blocks[req.request_id] = self.allocate()
            self.call("update_state_after_alloc", req, blocks, ext or 0)
            self.count["admitted"] += 1
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS if load_async else RequestStatus.RUNNING
            (self.waiting if load_async else self.running).append(req)
        for req in self.ready:  # decode: KV arrived last step, scheduled now without external tokens
            req.num_computed_tokens = self.prompt_tokens - 1
            self.call("update_state_after_alloc", req, self.blocks[req.request_id], 0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.count["promoted"] += 1
        self.ready = []
        meta = self.call("build_connector_meta", SchedulerOutput.make_empty())
        self.count["metas"] += 1
        for load in meta.loads:
            if load.report and load.local_block_ids == tuple(self.blocks[load.request_id].get_block_ids()[0]):
                self.count["pulls"] += 1
                self.count["pull_blocks"] += len(load.local_block_ids)
        self.count["leases_sent"] += sum(1 for rid in meta.send_leases if rid in meta.send_blocks)
        for _ in range(max(0, len(self.running) - self.target_running)):  # finishes
            req = self.running.popleft()
            req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, self.prompt_tokens
            hold, params = self.call("request_finished", req, self.blocks[req.request_id].get_block_ids()[0])
            self.count["finished"] += 1
            if hold:
                self.count["holds"] += 1
                self.count["hold_params"] += bool(params and params.get("do_remote_prefill"))
                self.waiting.append(req)
            else:
                self.free_blocks.extend(self.blocks.pop(req.request_id).blocks[0])
        out = [self.waiting.popleft() for _ in range(max(0, len(self.waiting) - self.target_waiting))]
        ids = {r.request_id for r in out}
        if self.side == "decode":
            self.ready = out
            output = KVConnectorOutput(finished_recving=ids)
        else:
            for req in out:
                self.free_blocks.extend(self.blocks.pop(req.request_id).blocks[0])
            self.count["released"] += len(out)
            output = KVConnectorOutput(finished_sending=ids)
        self.call("update_connector_output", output)
        self.call("get_kv_connector_stats")
        self.call("take_events")


def run_case(side: str, churn: int, *, running: int = 256, waiting: int = 256, steps: int = 2000,
             warmup: int = 200, prompt_tokens: int = 2048, block_size: int = 16) -> dict[str, Any]:
    """One side at one churn (requests per step): ``step_us`` (p50/p99/mean/min/max µs per step),
    ``hooks`` (each hook's calls, µs per step and per call), ``counts`` (what the hooks produced in the
    timed steps) and ``state_after`` (running, waiting).

    Raises:
        ValueError: unknown side, or a churn above the running or waiting count.
        RuntimeError: the state was not reached.
    """
    from p2pkv.tools.bench.results import summarize

    if side not in SIDES or not 0 < churn <= min(running, waiting):
        raise ValueError(f"side must be one of {SIDES} and 0 < churn <= running, waiting; got {side!r}, {churn}")
    conn = make_connector(side, block_size)
    sim = Sim(side, conn, prompt_tokens, block_size, running, waiting)
    try:
        for _ in range(10_000):  # untimed fill
            if len(sim.running) >= running and len(sim.waiting) >= waiting:
                break
            sim.step(64)
        else:
            raise RuntimeError(f"state not reached: {len(sim.running)} running, {len(sim.waiting)} waiting")
        for _ in range(warmup):
            sim.step(churn)
        base, per_step, sim.timing = dict(sim.count), [], True
        for _ in range(steps):
            sim.step_ns = 0
            sim.step(churn)
            per_step.append(sim.step_ns)
        sim.timing = False
    finally:
        conn.shutdown()
    hooks = {h: {"calls": sim.hook_calls[h], "us_per_step": sim.hook_ns[h] / steps / 1e3,
                 "us_per_call": sim.hook_ns[h] / sim.hook_calls[h] / 1e3} for h in HOOKS if sim.hook_calls[h]}
    return {"side": side, "churn": churn, "running": running, "waiting": waiting, "steps": steps, "warmup": warmup,
            "state_after": {"running": len(sim.running), "waiting": len(sim.waiting)},
            "step_us": summarize(per_step, 1e-3), "hooks": hooks,
            "counts": {k: v - base[k] for k, v in sim.count.items()}}


def timer_overhead_ns(n: int = 20_000) -> float:
    """Median ns :meth:`Sim.call` adds around a call that does nothing (part of every figure)."""
    sim = Sim("decode", SimpleNamespace(take_events=int), 16, 16, 0, 0)
    sim.timing, samples = True, []
    for _ in range(n):
        sim.step_ns = 0
        sim.call("take_events")
        samples.append(sim.step_ns)
    return float(statistics.median(samples))


def run(sides: tuple[str, ...] = SIDES, churns: tuple[int, ...] = (1, 4, 16, 64), quiet: bool = True,
        **config: int) -> dict[str, Any]:
    """Every side at every churn (``config``: :func:`run_case`'s keywords); a JSON-able dict.

    Raises:
        ValueError: as :func:`run_case`.
    """
    import vllm

    from p2pkv.tools.bench.machine import command_line, machine_info

    config = {"running": 256, "waiting": 256, "steps": 2000, "warmup": 200, "prompt_tokens": 2048, "block_size": 16,
              **config}
    cases = []
    for side in sides:
        for churn in churns:
            if not quiet:
                print(f"[scheduler hooks] {side} churn {churn} ...", file=sys.stderr, flush=True)
            cases.append(run_case(side, churn, **config))
    machine = machine_info()
    machine["versions"]["vllm"] = vllm.__version__
    machine["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return {"bench": "scheduler", "command": command_line(sys.argv), "machine": machine,
            "config": {**config, "gc_enabled": gc.isenabled(),
                       "connector": "P2pKvConnector (scheduler role, from vLLM's KVConnectorFactory)"},
            "timer_overhead_ns_per_call": timer_overhead_ns(),
            "target": {"p99_us_per_step_below": TARGET_US,
                       "met": {f"{c['side']}/churn{c['churn']}": c["step_us"]["p99"] < TARGET_US for c in cases}},
            "cases": cases}


def format_table(result: dict[str, Any]) -> str:
    """µs per step per case, then each hook's µs per step (per call in brackets)."""
    from p2pkv.tools.bench.table import grid_lines, yes_no

    cases = result["cases"]
    lines = grid_lines(["side", "churn", "p50 us", "p99 us", "mean us", "max us", f"p99<{TARGET_US:g}", "pulls",
                        "holds"],
                       [[c["side"], str(c["churn"]), *(f"{c['step_us'][k]:.1f}" for k in ("p50", "p99", "mean")),
                         f"{c['step_us']['max']:.0f}", yes_no(c["step_us"]["p99"] < TARGET_US),
                         str(c["counts"]["pulls"]), str(c["counts"]["holds"])] for c in cases])
    used = [h for h in HOOKS if any(h in c["hooks"] for c in cases)]
    lines += ["", "mean us per step by hook (us per call in brackets):"]
    lines += grid_lines(["side", "churn", *used], [[c["side"], str(c["churn"])] + [
        f"{c['hooks'][h]['us_per_step']:.1f} ({c['hooks'][h]['us_per_call']:.2f})" if h in c["hooks"] else "-"
        for h in used] for c in cases])
    cfg, m = result["config"], result["machine"]
    lines.append(f"{cfg['running']} running + {cfg['waiting']} waiting for KV, {cfg['steps']} steps after "
                 f"{cfg['warmup']}; {m.get('cpu_model')}, {m.get('usable_cpus')} cores, load {m.get('loadavg')}; "
                 f"timer {result['timer_overhead_ns_per_call']:.0f} ns per call included.")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """p50/p99 µs per step against churn per side, and each hook's share; False without matplotlib."""
    from p2pkv.tools.bench import plotting

    plt = plotting.pyplot("bench_scheduler_hooks")
    if plt is None:
        return False
    cases = result["cases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for side in SIDES:
        cs = [c for c in cases if c["side"] == side]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            if cs:
                left.plot([c["churn"] for c in cs], [c["step_us"][q] for c in cs], style, label=f"{side} {q}")
    left.axhline(TARGET_US, color="red", lw=1, label=f"target {TARGET_US:g} us")
    left.set(xscale="log", yscale="log", xlabel="churn (requests per step)", ylabel="us per step",
             title="scheduler hooks per engine step")
    left.legend(fontsize=8)
    labels, bottom = [f"{c['side'][0]}/{c['churn']}" for c in cases], [0.0] * len(cases)
    for hook in HOOKS:
        vals = [c["hooks"].get(hook, {}).get("us_per_step", 0.0) for c in cases]
        if any(vals):
            right.bar(labels, vals, bottom=bottom, label=hook)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    right.set(yscale="log", ylabel="mean us per step", title="by hook (d: decode, p: prefill / churn)")
    right.legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"p2pkv scheduler hooks: {cfg['running']} running + {cfg['waiting']} waiting for KV", fontsize=10)
    fig.tight_layout()
    plotting.save(fig, path)
    return True


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run, print the tables; write ``--json`` / ``--plot``. Exit code 2 on a bad option."""
    from p2pkv.tools.bench.results import write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated among decode, prefill")
    p.add_argument("--churn", default="1,4,16,64", help="requests arriving, moving on and finishing per step")
    for flag, default, what in (("--running", 256, "running requests held"),
                                ("--waiting", 256, "waiting-for-KV requests held (decode: pulls; prefill: holds)"),
                                ("--steps", 2000, "timed steps per case"), ("--warmup", 200, "untimed steps first"),
                                ("--prompt-tokens", 2048, "tokens per prompt"),
                                ("--block-size", 16, "tokens per block")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="write a plot here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    try:
        result = run(tuple(s.strip() for s in a.sides.split(",") if s.strip()),
                     tuple(int(k) for k in a.churn.split(",") if k.strip()), a.quiet, running=a.running,
                     waiting=a.waiting, steps=a.steps, warmup=a.warmup, prompt_tokens=a.prompt_tokens,
                     block_size=a.block_size)
    except ValueError as exc:
        print(f"bench_scheduler_hooks: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if a.json:
        write_json(result, a.json)
    if a.plot:
        plot(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
