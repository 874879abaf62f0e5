"""``p2pkv bench transfer``: KV block pulls over NIXL between two processes vs memcpy.

A spawned *prefill* process owns two synthetic KV caches of one model shape,
cross-layer (``BLHNC``) and layer-compact (``LBHNC``), each registered and
served by its own :class:`p2pkv.worker.WorkerSide` (NIXL agent + side
channel). This *decode* process holds two destination caches on one
:class:`p2pkv.transfer.NixlTransferAgent`, fetches both peers' AgentInfo over
the side channel (timed), and pulls the same requests (same block ids, same
bytes) four ways:

* ``memcpy``: torch ``copy_`` of the same byte ranges between two tensors in
  this process, one copy per coalesced run: the limit.
* ``cross_layer``: p2pkv: ``BLHNC`` + :func:`p2pkv.plan.coalesce_runs`, one
  descriptor per run of consecutive blocks (all layers at once).
* ``per_layer``: vLLM NixlConnector's scheme: ``LBHNC``, one descriptor per
  block per layer (run lengths all 1, nothing coalesced).
* ``layer_coalesced``: ``LBHNC`` + coalescing: one descriptor per run per layer.

Requests are pulled one at a time; a pull is timed from
:meth:`~p2pkv.transfer.NixlTransferAgent.start_read` (NIXL descriptor lists,
``initialize_xfer``, post) to the poll that sees it DONE. Descriptor planning
(coalesce_runs + build_descriptors) is timed apart. Before the timed requests
each method pulls request 0 once into scrubbed destination blocks and the
bytes are compared exactly with the source (warm-up and correctness check).

Units: bytes; GB/s are 1e9 bytes per second; times in ms or µs as named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pkv.bench import report
from p2pkv.bench.synth import (
    LLAMA3_8B,
    GiB,
    KVShape,
    make_placements,
    make_shaped_kv_caches,
    ranges_equal,
    run_ranges,
    size_cache,
)
from p2pkv.plan import build_descriptors, coalesce_runs

if TYPE_CHECKING:
    import torch

METHODS: dict[str, str] = {
    "memcpy": "in-process memcpy of the same byte ranges (torch copy_ per run; the limit)",
    "cross_layer": "p2pkv: cross-layer blocks (BLHNC) + run coalescing",
    "per_layer": "NixlConnector scheme: layer-compact (LBHNC), 1 descriptor per block per layer",
    "layer_coalesced": "layer-compact (LBHNC) + run coalescing, 1 descriptor per run per layer",
}
"""Method key → what it measures."""

PROCESS_OVERHEAD_BYTES = 768 << 20
"""Bytes one benchmark process needs besides its two caches (torch, NIXL, UCX)."""

_LAYOUTS = ("BLHNC", "LBHNC")
_PEER = {"cross_layer": "BLHNC", "per_layer": "LBHNC", "layer_coalesced": "LBHNC"}  # method → layout pulled
_NOTIF = b"p2pkv:done:bench"


@dataclass
class TransferBenchOptions:
    """Settings of one benchmark run.

    Attributes:
        shape: model KV geometry (default Llama-3-8B).
        tokens: request sizes to measure (tokens per request).
        requests: timed requests per size and method.
        num_blocks: blocks per cache (0: room for all requests of the largest size, within ``max_mem_gib``).
        seed: seeds block placement.
        fragmentation: longest run of consecutive block ids the synthetic
            allocator hands out (1: every block alone; 0: one run per request).
        progress_thread: NIXL progress threads on every agent.
        num_threads: UCX backend worker threads (0: NIXL default).
        ucx_error_handling_mode: ``"peer"``, ``"none"`` or ``""`` (NIXL default), as in P2pKvConfig.
        ucx_num_workers: UCX workers per agent (0: NIXL default).
        memcpy_threads: torch threads for the memcpy method (0: torch default).
        max_mem_gib: memory per process (GiB), two caches plus overhead.
        verify: compare one pulled request per method with its source, byte for byte.
        host: side-channel address (loopback by default).
        prefill_poll_ms: how often the prefill process progresses NIXL (drains
            notifications) without a progress thread. Pulls are READs without
            a notification (sent after completion, as the worker does), so
            their completion does not wait for the prefill side.
        quiet: no progress lines on stderr.
        argv: command line to record in the results.
    """

    shape: KVShape = LLAMA3_8B
    tokens: tuple[int, ...] = (1024, 4096, 16384)
    requests: int = 8
    num_blocks: int = 0
    seed: int = 0
    fragmentation: int = 32
    progress_thread: bool = False
    num_threads: int = 0
    ucx_error_handling_mode: str = ""
    ucx_num_workers: int = 0
    memcpy_threads: int = 0
    max_mem_gib: float = 6.0
    verify: bool = True
    host: str = "127.0.0.1"
    prefill_poll_ms: float = 0.5
    quiet: bool = False
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    def nixl_settings(self) -> dict[str, Any]:
        """:class:`p2pkv.config.P2pKvConfig` keywords for both sides' NIXL agents."""
        return {"nixl_progress_thread": self.progress_thread, "nixl_num_threads": self.num_threads,
                "ucx_error_handling_mode": self.ucx_error_handling_mode, "ucx_num_workers": self.ucx_num_workers}


def check_options(opts: TransferBenchOptions) -> tuple[int, list[int], list[str]]:
    """``(num_blocks, token sizes that fit, warnings)``: two caches per process within ``max_mem_gib``.

    Raises:
        ValueError: bad options, or not even the smallest request fits.
    """
    if opts.requests < 1 or not opts.tokens or min(opts.tokens) < 1 or opts.fragmentation < 0:
        raise ValueError("need --requests >= 1, token sizes >= 1 and --fragmentation >= 0")
    if opts.shape.page_bytes % 8:
        raise ValueError(f"a block's page is {opts.shape.page_bytes} B; the benchmark needs a multiple of 8")
    budget = int(opts.max_mem_gib * GiB) - PROCESS_OVERHEAD_BYTES
    return size_cache(opts.shape, opts.tokens, opts.requests, opts.num_blocks, budget, caches=2)


def remote_seed(seed: int, layout: str) -> int:
    """Pattern seed of the prefill process's ``layout`` cache."""
    return 2 * seed + 100 + _LAYOUTS.index(layout)


def _prefill_main(shape_d: dict[str, Any], num_blocks: int, seed: int, nixl: dict[str, Any], host: str,
                  poll_s: float, out: Any, stop: Any) -> None:
    """Prefill process: serve both caches until ``stop``, draining completion notifications."""
    from p2pkv.config import P2pKvConfig
    from p2pkv.worker import WorkerSide

    workers: list[WorkerSide] = []
    try:
        shape, config, ready, caches = KVShape(**shape_d), P2pKvConfig(**nixl), {}, []
        for layout in _LAYOUTS:
            base, views = make_shaped_kv_caches(layout, shape, num_blocks, seed=remote_seed(seed, layout))
            caches.append(base)
            worker = WorkerSide(f"bench-prefill-{layout}", config, 0, 1, host, 0, "p2pkv-bench:" + shape.key(),
                                shape.model_info(layout))
            workers.append(worker)
            t0 = time.perf_counter()
            worker.register_kv_caches(views, num_blocks)
            ready[layout] = {"register_ms": (time.perf_counter() - t0) * 1e3,
                             "port": worker.server.port if worker.server else 0}
        out.put(("ready", ready))
        notifs = 0
        while not stop.wait(poll_s):
            notifs += sum(len(w.agent.get_notifs()) for w in workers if w.agent is not None)
        out.put(("done", {"notifs": notifs, "peak_rss_bytes": report.peak_rss_bytes()}))
    except BaseException:
        out.put(("error", traceback.format_exc()))
    finally:
        for worker in workers:
            worker.shutdown()


def _expect(out: Any, proc: Any, tag: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (proc.is_alive() or not out.empty()):
        try:
            got, payload = out.get(timeout=0.5)
        except queue.Empty:
            continue
        if got == "error":
            raise RuntimeError(f"prefill process failed:\n{payload}")
        if got == tag:
            return payload
    raise RuntimeError(f"prefill process sent no {tag!r} within {timeout_s:g} s (exit code {proc.exitcode})")


@dataclass
class _Side:
    """One layout as seen from the decode process."""

    raw: torch.Tensor
    segs: list[tuple[int, int, int]]
    local_segments: list[Any]
    remote_segments: list[Any]
    peer: str
    seed: int


class _Decode:
    """The decode side: destination caches, one NIXL agent, both peers."""

    def __init__(self, opts: TransferBenchOptions, num_blocks: int) -> None:
        from p2pkv.config import P2pKvConfig
        from p2pkv.layout import describe_torch_kv_caches
        from p2pkv.transfer import NixlTransferAgent, unique_agent_name

        self.opts, self.num_blocks = opts, num_blocks
        shape = opts.shape
        self.agent = NixlTransferAgent(
            unique_agent_name("bench-decode", 0), ("UCX",), opts.progress_thread, opts.num_threads,
            P2pKvConfig(**opts.nixl_settings()).backend_params())
        made = {lay: make_shaped_kv_caches(lay, shape, num_blocks, seed=2 * opts.seed + 200 + i)
                for i, lay in enumerate(_LAYOUTS)}
        self.caches = {lay: base for lay, (base, _) in made.items()}
        self.layouts = {lay: describe_torch_kv_caches(views, num_blocks) for lay, (_, views) in made.items()}
        t0 = time.perf_counter()
        self.agent.register([r for lay in self.layouts.values() for r in lay.regions], "DRAM")
        self.register_ms = (time.perf_counter() - t0) * 1e3
        self.peers: dict[str, dict[str, float]] = {}
        self.sides: dict[str, _Side] = {}

    def connect(self, ready: dict[str, Any]) -> None:
        """Handshake with both prefill peers and load their metadata (timed)."""
        import torch

        from handshake import fetch_agent_info
        from p2pkv.worker import check_compatible, layout_desc, remote_segments

        opts, shape = self.opts, self.opts.shape
        for lay in _LAYOUTS:
            local, base = self.layouts[lay], self.caches[lay]
            t0 = time.perf_counter()
            info = fetch_agent_info(opts.host, ready[lay]["port"], 0, "bench-decode", "p2pkv-bench:" + shape.key())
            t1 = time.perf_counter()
            check_compatible(layout_desc(local, mem_type="DRAM", **shape.model_info(lay)), info.layout)
            name = self.agent.add_peer(info)
            t2 = time.perf_counter()
            self.peers[lay] = {"handshake_ms": (t1 - t0) * 1e3, "add_remote_agent_ms": (t2 - t1) * 1e3,
                               "setup_ms": (t2 - t0) * 1e3, "prefill_register_ms": ready[lay]["register_ms"]}
            origin = local.regions[0].addr
            self.sides[lay] = _Side(
                raw=base.view(-1).view(torch.uint8),
                segs=[(s.addr - origin, s.block_stride, s.length) for s in local.segments],
                local_segments=list(local.segments), remote_segments=remote_segments(info.layout),
                peer=name, seed=remote_seed(opts.seed, lay))

    def plan(self, method: str, loc: np.ndarray, rem: np.ndarray) -> dict[str, Any]:
        """Descriptors (or memcpy runs) of one request; keys ``runs``, ``local``, ``remote``, ``descs``."""
        if method == "per_layer":
            ones, side = np.ones(loc.size, dtype=np.int64), self.sides["LBHNC"]
            ld = build_descriptors(side.local_segments, np.asarray(loc, dtype=np.int64), ones)
            rd = build_descriptors(side.remote_segments, np.asarray(rem, dtype=np.int64), ones)
            return {"local": ld, "remote": rd, "descs": int(ld.shape[0])}
        runs = coalesce_runs(loc, rem, self.num_blocks, self.num_blocks)
        if method == "memcpy":
            return {"runs": runs, "descs": int(runs[0].size)}
        side = self.sides[_PEER[method]]
        ld, rd = (build_descriptors(segs, runs[i], runs[2]) for i, segs in
                  enumerate((side.local_segments, side.remote_segments)))
        return {"local": ld, "remote": rd, "descs": int(ld.shape[0])}

    def execute(self, method: str, plan: dict[str, Any]) -> float:
        """Run one planned request; seconds."""
        if method == "memcpy":
            src, dst, bb = self.sides["BLHNC"].raw, self.sides["LBHNC"].raw, self.opts.shape.block_bytes
            ls, rs, lens = (a.tolist() for a in plan["runs"])
            t0 = time.perf_counter()
            for a, b, n in zip(ls, rs, lens, strict=True):
                dst[a * bb:(a + n) * bb].copy_(src[b * bb:(b + n) * bb])
            return time.perf_counter() - t0
        side = self.sides[_PEER[method]]
        t0 = time.perf_counter()
        handle = self.agent.start_read(side.peer, plan["local"], plan["remote"], b"")
        while not self.agent.poll(handle):
            pass
        seconds = time.perf_counter() - t0
        self.agent.send_notif(side.peer, _NOTIF)  # as WorkerSide does: after the READ, off the timed path
        return seconds

    def verified_pull(self, method: str, loc: np.ndarray, rem: np.ndarray) -> tuple[float, bool | None]:
        """Scrub a request's destination, pull it, compare with the source: ``(seconds, equal)``."""
        runs = coalesce_runs(loc, rem, self.num_blocks, self.num_blocks)
        if method == "memcpy":
            bb = self.opts.shape.block_bytes
            dst, src, seed = self.sides["LBHNC"].raw, self.sides["BLHNC"].raw, 0
            ranges = run_ranges([(0, bb, bb)], *runs)
        else:
            side = self.sides[_PEER[method]]
            dst, src, seed = side.raw, None, side.seed
            ranges = run_ranges(side.segs, *runs)
        for d, _, n in ranges:
            dst[d:d + n].zero_()
        seconds = self.execute(method, self.plan(method, loc, rem))
        if method in _PEER:
            self.peers[_PEER[method]].setdefault("first_pull_ms", seconds * 1e3)
        return seconds, (ranges_equal(dst, ranges, src, seed) if self.opts.verify else None)

    def timed(self, method: str, loc: np.ndarray, rem: np.ndarray) -> tuple[float, float, int]:
        """``(planning seconds, pull seconds, descriptors)`` of one request."""
        t0 = time.perf_counter()
        plan = self.plan(method, loc, rem)
        t1 = time.perf_counter()
        return t1 - t0, self.execute(method, plan), plan["descs"]


def _log(opts: TransferBenchOptions, msg: str) -> None:
    if not opts.quiet:
        print(f"[p2pkv bench transfer] {msg}", file=sys.stderr, flush=True)


def _bench_tokens(dec: _Decode, opts: TransferBenchOptions, tokens: int) -> dict[str, Any]:
    placements = make_placements(opts.seed, tokens, opts.shape, dec.num_blocks, opts.requests, opts.fragmentation)
    runs = [int(coalesce_runs(lo, re, dec.num_blocks, dec.num_blocks)[2].size) for lo, re in placements]
    blocks = int(placements[0][0].size)
    entry: dict[str, Any] = {"tokens": tokens, "blocks_per_request": blocks, "runs_per_request": report.counts(runs),
                             "bytes_per_request": blocks * opts.shape.block_bytes, "methods": {}}
    warm = {method: dec.verified_pull(method, *placements[0]) for method in METHODS}
    names, samples = list(METHODS), {method: [] for method in METHODS}
    for i, (loc, rem) in enumerate(placements):
        # Interleaved, in rotating order: every method sees the same background load.
        for method in names[i % len(names):] + names[:i % len(names)]:
            samples[method].append(dec.timed(method, loc, rem))
        _log(opts, f"{tokens} tokens: request {i + 1}/{len(placements)} pulled every way")
    for method in METHODS:
        plan_s, pull_s, descs = zip(*samples[method], strict=True)
        res = entry["methods"][method] = report.method_stats(
            METHODS[method], entry["bytes_per_request"], pull_s, plan_s, descs, *warm[method])
        _log(opts, f"{tokens} tokens  {method:<15} {res['gbps']:7.2f} GB/s  p50 {res['latency_ms']['p50']:8.2f} ms"
                   f"  {res['descriptors_per_request']['mean']:9.1f} desc/req  verified={res['verified']}")
    for res in entry["methods"].values():
        res["ratio_to_memcpy"] = res["gbps"] / entry["methods"]["memcpy"]["gbps"]
    return entry


def run_transfer_bench(opts: TransferBenchOptions) -> dict[str, Any]:
    """Run the whole benchmark (spawns the prefill process; ends it before returning).

    Returns:
        The results dict that :mod:`p2pkv.bench.report` prints, writes and checks.

    Raises:
        ValueError: bad options. RuntimeError: the prefill process failed or did not answer.
    """
    import torch

    num_blocks, tokens, warnings = check_options(opts)
    for w in warnings:
        _log(opts, f"warning: {w}")
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.memcpy_threads or threads)  # restored below
    _log(opts, f"{opts.shape.label()}; {num_blocks} blocks per cache "
               f"({num_blocks * opts.shape.block_bytes / GiB:.2f} GiB), 2 caches per process")
    started, t_wall = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_prefill_main, name="p2pkv-bench-prefill", daemon=True,
                       args=(asdict(opts.shape), num_blocks, opts.seed, opts.nixl_settings(), opts.host,
                             opts.prefill_poll_ms / 1e3, out, stop))
    proc.start()
    dec: _Decode | None = None
    try:
        dec = _Decode(opts, num_blocks)  # while the prefill process starts
        dec.connect(_expect(out, proc, "ready", 300))
        _log(opts, "handshakes: " + ", ".join(f"{k} {v['setup_ms']:.1f} ms" for k, v in dec.peers.items()))
        results = [_bench_tokens(dec, opts, t) for t in tokens]
        decode_rss = report.peak_rss_bytes()
        dec.agent.close()
        stop.set()
        done = _expect(out, proc, "done", 60)
    finally:
        if dec is not None:
            dec.agent.close()
        torch.set_num_threads(threads)
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    result: dict[str, Any] = {
        "benchmark": "p2pkv bench transfer", "command": report.command_line(opts.argv), "argv": list(opts.argv),
        "timestamp": started, "wall_s": time.perf_counter() - t_wall, "machine": report.machine_info(),
        "config": {**{k: v for k, v in asdict(opts).items() if k not in ("argv", "quiet")},
                   "tokens": tokens, "skipped_tokens": sorted(set(opts.tokens) - set(tokens)),
                   "shape_label": opts.shape.label(), "block_bytes": opts.shape.block_bytes,
                   "page_bytes": opts.shape.page_bytes, "num_blocks": num_blocks,
                   "cache_bytes": num_blocks * opts.shape.block_bytes, "torch_threads": opts.memcpy_threads or threads,
                   "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}},
        "methods": dict(METHODS),
        "setup": {"decode_register_ms": dec.register_ms, "peers": dec.peers},
        "processes": {"decode_peak_rss_bytes": decode_rss, "prefill_peak_rss_bytes": done["peak_rss_bytes"],
                      "prefill_notifications": done["notifs"]},
        "warnings": warnings, "results": results,
    }
    result["targets"] = report.evaluate_targets(result)
    return result
