"""``p2pkv bench scheduler``: the cost per engine step of the connector's scheduler hooks.

Drives a real :class:`p2pkv.connector.P2pKvConnector` in vLLM's scheduler
role (built by vLLM's ``KVConnectorFactory`` from a ``VllmConfig``, as vLLM's
``Scheduler`` builds it; its calls go to :class:`p2pkv.scheduler.SchedulerSide`)
with real ``vllm.v1.request.Request`` objects and ``KVCacheBlocks`` of
``KVCacheBlock`` s, in the order vLLM's ``Scheduler`` makes the calls
(``vllm/v1/core/sched/scheduler.py``):

* ``add_request``: ``on_new_request`` for each arrival;
* ``schedule``: for a waiting request seen for the first time,
  ``get_num_new_matched_tokens`` then (on an asynchronous load)
  ``get_loaded_kv_cache_group_ids`` and, after allocation,
  ``update_state_after_alloc``; a request promoted out of
  ``WAITING_FOR_REMOTE_KVS`` gets ``update_state_after_alloc`` again (no
  external tokens); then ``build_connector_meta`` once per step;
* ``update_from_output``: ``request_finished`` for each finished request,
  ``update_connector_output`` with the workers' ``finished_recving`` /
  ``finished_sending``, ``get_kv_connector_stats``, ``take_events``.

Two sides, each held at a steady state of ``--running`` running requests and
``--waiting`` requests whose KV is elsewhere, with ``churn`` requests
arriving, moving on and finishing every step:

* ``decode``: ``--waiting`` requests in ``WAITING_FOR_REMOTE_KVS`` (pull
  scheduled, READ in flight); each step ``churn`` arrive with
  ``do_remote_prefill`` params and are admitted (one ``LoadSpec`` each),
  ``churn`` have their KV reported received and are promoted, ``churn``
  running ones finish.
* ``prefill``: ``--waiting`` finished requests whose blocks are held for a
  decode engine; each step ``churn`` arrive with ``do_remote_decode`` and are
  admitted, ``churn`` running ones finish and are held (a lease each), and
  ``churn`` holds are released by the workers (``finished_sending``).

A step's cost is the sum of the wall time (``time.perf_counter_ns``) of the
hook calls it makes; the simulation's own work (building requests and
blocks) is not counted. Reported: p50 / p99 / mean / max µs per step over
``--steps`` steps after ``--warmup`` ones, and each hook's mean µs per step
and per call. Figures are of the Python process as it is (garbage collector
on). The target (issue 13, item 4) is < 50 µs per step at 256 running and
256 waiting-for-KV requests.

Lease heartbeats (``send_heartbeats``, inside ``build_connector_meta``)
cover only requests that arrived and are not yet admitted; here every
arrival is admitted in its step, so no heartbeat is due and nothing goes to
the network.

Imports vLLM inside the functions only, so the ``p2pkv`` command's parser
stays cheap. Also runnable as ``python -m p2pkv.tools.bench.scheduler_hooks``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import plotting
from p2pkv.tools.bench.table import grid_lines, yes_no

SIDES = ("decode", "prefill")
TARGET_US = 50.0
"""Target: p99 µs per step of the hooks at the default state (issue 13, item 4)."""

HOOKS = ("on_new_request", "get_num_new_matched_tokens", "get_loaded_kv_cache_group_ids",
         "update_state_after_alloc", "build_connector_meta", "request_finished", "update_connector_output",
         "get_kv_connector_stats", "take_events")


BENCH_SECRET = secrets.token_hex(32)
"""The side-channel secret of the benchmark's connectors: the decode side checks each request's signed
``kv_transfer_params`` as a deployment with a secret does."""


def _secret_file() -> str:
    """A file holding :data:`BENCH_SECRET` (made once per process)."""
    global _SECRET_FILE
    if _SECRET_FILE is None:
        fd, _SECRET_FILE = tempfile.mkstemp(prefix="p2pkv-bench-secret-")
        os.write(fd, BENCH_SECRET.encode())
        os.close(fd)
        atexit.register(os.unlink, _SECRET_FILE)
    return _SECRET_FILE


_SECRET_FILE: str | None = None


def make_connector(side: str, block_size: int) -> Any:
    """A ``P2pKvConnector`` in the scheduler role, built by vLLM's ``KVConnectorFactory`` as vLLM's
    ``Scheduler`` builds it (``kv_role`` ``kv_both``, side channel advertised on 127.0.0.1, the
    secret :data:`BENCH_SECRET`).

    Raises:
        ValueError: vLLM refuses the configuration.
    """
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from p2pkv.plugin import register

    register()
    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role="kv_both", engine_id=f"bench-{side}",
                           kv_connector_extra_config={"side_channel_host": "127.0.0.1",
                                                      "secret_file": _secret_file()})
    config = VllmConfig(kv_transfer_config=ktc, cache_config=CacheConfig(block_size=block_size))
    kv_cache_config = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


class BlockPool:
    """Free ``KVCacheBlock`` s handed out as ``KVCacheBlocks`` (one KV cache group), returned on free."""

    def __init__(self) -> None:
        self._free: deque[Any] = deque()
        self._next_id = 1  # vLLM's block 0 is the null block

    def allocate(self, n: int) -> Any:
        """``n`` blocks without a hash (as vLLM allocates for an asynchronous load)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.popleft())
            else:
                out.append(KVCacheBlock(self._next_id))
                self._next_id += 1
        return KVCacheBlocks((out,))

    def free(self, blocks: Any) -> None:
        """Return a request's blocks."""
        self._free.extend(blocks.blocks[0])


class HookClock:
    """Times hook calls: per step (ns, all hooks together) and per hook (ns and calls, all steps)."""

    def __init__(self) -> None:
        self.on = False
        self.step_ns = 0
        self.hook_ns = dict.fromkeys(HOOKS, 0)
        self.hook_calls = dict.fromkeys(HOOKS, 0)

    def call(self, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; its wall time counts for this step and hook while the clock is on."""
        t0 = time.perf_counter_ns()
        out = fn(*args)
        dt = time.perf_counter_ns() - t0
        if self.on:
            self.step_ns += dt
            self.hook_ns[name] += dt
            self.hook_calls[name] += 1
        return out


class _Sim:
    """One side's engine state and its per-step hook calls (see the module docstring)."""

    def __init__(self, side: str, connector: Any, clock: HookClock, prompt_tokens: int, block_size: int,
                 running: int, waiting: int) -> None:
        self.side, self.conn, self.clock = side, connector, clock
        self.prompt_tokens, self.block_size = prompt_tokens, block_size
        self.target_running, self.target_waiting = running, waiting
        self.pool = BlockPool()
        self.blocks: dict[str, Any] = {}
        self.running: deque[Any] = deque()
        self.waiting: deque[Any] = deque()  # decode: waiting for remote KV; prefill: held
        self.ready: list[Any] = []  # decode: KV received, promoted next step
        self.count = {"arrived": 0, "admitted": 0, "pulls": 0, "pull_blocks": 0, "finished": 0, "holds": 0,
                      "hold_params": 0, "leases_sent": 0, "released": 0, "promoted": 0, "metas": 0}
        self._n = 0
        self._prompt = [(7 * i) % 32000 for i in range(prompt_tokens)]

    def new_request(self) -> Any:
        """A vLLM ``Request`` with this side's ``kv_transfer_params`` (as the proxy sends them)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from p2pkv.params import make_prefill_response_params, sign_params

        self._n += 1
        rid = f"{self.side}-{self._n}"
        if self.side == "decode":
            nblocks = -(-self.prompt_tokens // self.block_size)
            params = make_prefill_response_params(
                engine_id="bench-prefill", request_id=f"prefill-{self._n}", host="127.0.0.1", port=5600,
                block_ids=list(range(1 + self._n % 1000, 1 + self._n % 1000 + nblocks)), tp_size=1,
                num_tokens=self.prompt_tokens, expiry_time=time.time() + 120.0)
            sign_params(params, BENCH_SECRET.encode(), time.time() + 120.0)
            sp = SamplingParams(max_tokens=64, extra_args={"kv_transfer_params": params})
        else:
            params = {"do_remote_decode": True, "do_remote_prefill": False}
            sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        return Request(rid, list(self._prompt), sp, None)

    def step(self, arrive: int) -> None:
        """One engine step with ``arrive`` arrivals; promotions, finishes and releases keep the state."""
        new = [self.new_request() for _ in range(arrive)]
        c = self.clock
        for req in new:
            c.call("on_new_request", self.conn.on_new_request, req)
        for req in new:
            self._admit(req)
        self._promote()
        from vllm.v1.core.sched.output import SchedulerOutput

        meta = c.call("build_connector_meta", self.conn.build_connector_meta, SchedulerOutput.make_empty())
        self._count_meta(meta)
        self._update_from_output(arrive)

    def _admit(self, req: Any) -> None:
        from vllm.v1.request import RequestStatus

        c = self.clock
        self.count["arrived"] += 1
        ext, load_async = c.call("get_num_new_matched_tokens", self.conn.get_num_new_matched_tokens, req, 0)
        if load_async:
            c.call("get_loaded_kv_cache_group_ids", self.conn.get_loaded_kv_cache_group_ids, req)
        blocks = self.pool.allocate(-(-self.prompt_tokens // self.block_size))
        self.blocks[req.request_id] = blocks
        c.call("update_state_after_alloc", self.conn.update_state_after_alloc, req, blocks, ext or 0)
        self.count["admitted"] += 1
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting.append(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _promote(self) -> None:
        """Decode: requests whose KV arrived last step are scheduled (no external tokens this time)."""
        from vllm.v1.request import RequestStatus

        for req in self.ready:
            req.num_computed_tokens = self.prompt_tokens - 1
            self.clock.call("update_state_after_alloc", self.conn.update_state_after_alloc, req,
                            self.blocks[req.request_id], 0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.count["promoted"] += 1
        self.ready = []

    def _count_meta(self, meta: Any) -> None:
        self.count["metas"] += 1
        for pull in meta.loads:
            if pull.report and pull.local_block_ids == tuple(self.blocks[pull.request_id].get_block_ids()[0]):
                self.count["pulls"] += 1
                self.count["pull_blocks"] += len(pull.local_block_ids)
        self.count["leases_sent"] += sum(1 for rid in meta.send_leases if rid in meta.send_blocks)

    def _update_from_output(self, arrive: int) -> None:
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        c = self.clock
        n_finish = max(0, len(self.running) - self.target_running)
        for _ in range(n_finish):
            req = self.running.popleft()
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            req.num_computed_tokens = self.prompt_tokens
            blocks = self.blocks[req.request_id]
            hold, params = c.call("request_finished", self.conn.request_finished, req, blocks.get_block_ids()[0])
            self.count["finished"] += 1
            if hold:
                self.count["holds"] += 1
                self.count["hold_params"] += bool(params and params.get("do_remote_prefill"))
                self.waiting.append(req)
            else:
                self.pool.free(self.blocks.pop(req.request_id))
        n_out = max(0, len(self.waiting) - self.target_waiting)
        out = [self.waiting.popleft() for _ in range(n_out)]
        ids = {r.request_id for r in out}
        if self.side == "decode":
            self.ready = out
            output = KVConnectorOutput(finished_recving=ids)
        else:
            for req in out:
                self.pool.free(self.blocks.pop(req.request_id))
            self.count["released"] += len(out)
            output = KVConnectorOutput(finished_sending=ids)
        c.call("update_connector_output", self.conn.update_connector_output, output)
        c.call("get_kv_connector_stats", self.conn.get_kv_connector_stats)
        c.call("take_events", self.conn.take_events)


def _fill(sim: _Sim, chunk: int = 64, max_steps: int = 10_000) -> None:
    """Untimed steps until the side holds its running and waiting requests."""
    for _ in range(max_steps):
        if len(sim.running) >= sim.target_running and len(sim.waiting) >= sim.target_waiting:
            return
        sim.step(chunk)
    raise RuntimeError(f"state not reached: {len(sim.running)} running, {len(sim.waiting)} waiting")


def timer_overhead_ns(n: int = 20_000) -> float:
    """Median ns :meth:`HookClock.call` adds around a call that does nothing (part of every figure)."""
    import statistics

    clock, samples = HookClock(), []
    for _ in range(n):
        clock.step_ns = 0
        clock.on = True
        clock.call("take_events", int)
        samples.append(clock.step_ns)
    return float(statistics.median(samples))


def run_case(side: str, churn: int, *, running: int = 256, waiting: int = 256, steps: int = 2000,
             warmup: int = 200, prompt_tokens: int = 2048, block_size: int = 16,
             profile: str | None = None) -> dict[str, Any]:
    """One side at one churn: per-step µs (``step_us``: p50, p99, mean, min, max), each hook's mean µs per
    step and per call, and what the hooks produced (``counts``: pulls, holds, leases, ...).

    ``profile``: also write a cProfile of the timed steps to this path (pstats format).

    Raises:
        ValueError: unknown side, or a churn above the running or waiting count.
    """
    from p2pkv.tools.bench.report import summarize

    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if not 0 < churn <= min(running, waiting):
        raise ValueError(f"churn {churn} must be in 1..min(running, waiting) = {min(running, waiting)}")
    conn = make_connector(side, block_size)
    clock = HookClock()
    sim = _Sim(side, conn, clock, prompt_tokens, block_size, running, waiting)
    try:
        _fill(sim)
        for _ in range(warmup):
            sim.step(churn)
        base = dict(sim.count)
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        per_step = []
        clock.on = True
        for _ in range(steps):
            clock.step_ns = 0
            sim.step(churn)
            per_step.append(clock.step_ns)
        clock.on = False
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        state = {"running": len(sim.running), "waiting": len(sim.waiting)}
    finally:
        conn.shutdown()
    counts = {k: v - base[k] for k, v in sim.count.items()}
    hooks = {h: {"calls": clock.hook_calls[h], "us_per_step": clock.hook_ns[h] / steps / 1e3,
                 "us_per_call": clock.hook_ns[h] / clock.hook_calls[h] / 1e3}
             for h in HOOKS if clock.hook_calls[h]}
    return {"side": side, "churn": churn, "running": running, "waiting": waiting, "steps": steps,
            "warmup": warmup, "state_after": state, "step_us": summarize(per_step, 1e-3), "hooks": hooks,
            "counts": counts}


def run_scheduler_bench(*, sides: tuple[str, ...] = SIDES, churns: tuple[int, ...] = (1, 4, 16, 64),
                        running: int = 256, waiting: int = 256, steps: int = 2000, warmup: int = 200,
                        prompt_tokens: int = 2048, block_size: int = 16, quiet: bool = True,
                        profile_dir: str | None = None) -> dict[str, Any]:
    """Every side at every churn; returns a JSON-able dict (``cases``, ``machine``, ``target``, ...).

    ``profile_dir``: write one cProfile per case there (``<side>-churn<k>.prof``).

    Raises:
        ValueError: see :func:`run_case`.
    """
    import gc

    import vllm

    from p2pkv.tools.bench.machine import command_line, machine_info

    cases = []
    for side in sides:
        for churn in churns:
            if not quiet:
                print(f"[scheduler bench] {side} churn {churn} ...", file=sys.stderr, flush=True)
            prof = str(Path(profile_dir) / f"{side}-churn{churn}.prof") if profile_dir else None
            if prof:
                Path(profile_dir).mkdir(parents=True, exist_ok=True)
            cases.append(run_case(side, churn, running=running, waiting=waiting, steps=steps, warmup=warmup,
                                  prompt_tokens=prompt_tokens, block_size=block_size, profile=prof))
    machine = machine_info()
    machine["versions"]["vllm"] = vllm.__version__
    machine["loadavg"] = list(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() \
        else None
    return {"bench": "scheduler", "command": command_line(sys.argv), "machine": machine,
            "config": {"running": running, "waiting": waiting, "steps": steps, "warmup": warmup,
                       "prompt_tokens": prompt_tokens, "block_size": block_size, "gc_enabled": gc.isenabled(),
                       "connector": "P2pKvConnector (scheduler role, from vLLM's KVConnectorFactory)"},
            "timer_overhead_ns_per_call": timer_overhead_ns(),
            "target": {"p99_us_per_step_below": TARGET_US, "met": _target_met(cases)}, "cases": cases}


def _target_met(cases: list[dict[str, Any]]) -> dict[str, bool]:
    """Per case (``<side>/churn<k>``): p99 µs per step below :data:`TARGET_US`."""
    return {f"{c['side']}/churn{c['churn']}": c["step_us"]["p99"] < TARGET_US for c in cases}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable tables of a :func:`run_scheduler_bench` result (µs per step, per hook)."""
    cfg = result["config"]
    header = ["side", "churn", "p50 us", "p99 us", "mean us", "max us", f"p99<{TARGET_US:g}", "pulls", "holds"]
    rows = [[c["side"], str(c["churn"]), f"{c['step_us']['p50']:.1f}", f"{c['step_us']['p99']:.1f}",
             f"{c['step_us']['mean']:.1f}", f"{c['step_us']['max']:.0f}",
             yes_no(c["step_us"]["p99"] < TARGET_US), str(c["counts"]["pulls"]),
             str(c["counts"]["holds"])] for c in result["cases"]]
    lines = grid_lines(header, rows)
    used = [h for h in HOOKS if any(h in c["hooks"] for c in result["cases"])]
    lines += ["", "mean us per step by hook (us per call in brackets):"]
    header = ["side", "churn", *used]
    rows = [[c["side"], str(c["churn"])] + [
        f"{c['hooks'][h]['us_per_step']:.1f} ({c['hooks'][h]['us_per_call']:.2f})" if h in c["hooks"] else "-"
        for h in used] for c in result["cases"]]
    lines += grid_lines(header, rows)
    m = result["machine"]
    lines.append(f"{cfg['running']} running + {cfg['waiting']} waiting for KV (decode: pulls in flight; prefill: "
                 f"holds), {cfg['prompt_tokens']}-token prompts, block size {cfg['block_size']}; {cfg['steps']} "
                 f"steps after {cfg['warmup']}; churn = requests arriving, moving on and finishing per step. "
                 f"{m.get('cpu_model')}, {m.get('usable_cpus')} cores, load {m.get('loadavg')}; timer "
                 f"{result['timer_overhead_ns_per_call']:.0f} ns per call included.")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> bool:
    """p50/p99 µs per step against churn per side, and each hook's mean share; False without matplotlib."""
    plt = plotting.pyplot("p2pkv bench")
    if plt is None:
        return False
    cases = result["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for side in SIDES:
        cs = [c for c in cases if c["side"] == side]
        if cs:
            ks = [c["churn"] for c in cs]
            axes[0].plot(ks, [c["step_us"]["p50"] for c in cs], "o-", label=f"{side} p50")
            axes[0].plot(ks, [c["step_us"]["p99"] for c in cs], "s--", label=f"{side} p99")
    axes[0].axhline(TARGET_US, color="red", lw=1, label=f"target {TARGET_US:g} us")
    axes[0].set(xscale="log", yscale="log", xlabel="churn (requests per step)", ylabel="us per step",
                title="scheduler hooks per engine step")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    labels = [f"{c['side'][0]}/{c['churn']}" for c in cases]
    bottom = [0.0] * len(cases)
    for hook in HOOKS:
        vals = [c["hooks"].get(hook, {}).get("us_per_step", 0.0) for c in cases]
        if any(vals):
            axes[1].bar(labels, vals, bottom=bottom, label=hook)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[1].set(yscale="log", ylabel="mean us per step", title="by hook (d: decode, p: prefill / churn)")
    axes[1].legend(fontsize=7)
    cfg, m = result["config"], result["machine"]
    fig.suptitle(f"p2pkv bench scheduler: {cfg['running']} running + {cfg['waiting']} waiting for KV "
                 f"({m.get('cpu_model')}, {m.get('usable_cpus')} cores)", fontsize=10)
    fig.tight_layout()
    plotting.save(fig, path)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``p2pkv bench scheduler``."""
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated among decode, prefill")
    p.add_argument("--churn", default="1,4,16,64",
                   help="comma-separated requests arriving, moving on and finishing per step")
    p.add_argument("--running", type=int, default=256, help="running requests held")
    p.add_argument("--waiting", type=int, default=256,
                   help="requests waiting for KV held (decode: pulls in flight; prefill: held blocks)")
    p.add_argument("--steps", type=int, default=2000, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps per case after the state is reached")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--profile-dir", metavar="DIR", help="write a cProfile (pstats) of each case's timed steps here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def cli_main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench scheduler`` from parsed arguments; exit code 2 on a bad option."""
    from p2pkv.tools.bench.report import write_json

    try:
        result = run_scheduler_bench(
            sides=tuple(s.strip() for s in args.sides.split(",") if s.strip()),
            churns=tuple(int(k) for k in args.churn.split(",") if k.strip()), running=args.running,
            waiting=args.waiting, steps=args.steps, warmup=args.warmup, prompt_tokens=args.prompt_tokens,
            block_size=args.block_size, quiet=args.quiet, profile_dir=args.profile_dir)
    except ValueError as exc:
        print(f"p2pkv bench scheduler: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and plot(result, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m p2pkv.tools.bench.scheduler_hooks [options]``: the same as ``p2pkv bench scheduler``."""
    parser = argparse.ArgumentParser(prog="p2pkv bench scheduler", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return cli_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
