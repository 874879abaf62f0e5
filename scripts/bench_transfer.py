#!/usr/bin/env python3
"""KV block pulls (and pushes) over NIXL between two processes vs memcpy (docs/benchmarks/transfer-*.md).

Both processes run on this host: this one is the *decode* side and spawns
the *prefill* process (side channels on ``--host``, ephemeral ports). For
runs across hosts, use NIXL's own ``nixlbench`` / ``kvbench``.

The *prefill* process serves two synthetic KV caches of one model shape,
cross-layer (``BLHNC``) and layer-compact (``LBHNC``)
(:mod:`transfer_bench.prefill`); the *decode* process holds two
destination caches on one NIXL agent (:mod:`transfer_bench.decode`),
fetches both peers' AgentInfo over the side channel (timed), and pulls the
same requests (same block ids, same bytes) four ways:

* ``memcpy``: torch ``copy_`` of the same byte ranges between two tensors in
  this process, one copy per coalesced run: the limit.
* ``cross_layer``: p2pkv: ``BLHNC`` + :func:`p2pkv.dataplane.plan.coalesce_runs`, one
  descriptor per run of consecutive blocks (all layers at once).
* ``per_layer``: vLLM NixlConnector's scheme: ``LBHNC``, one descriptor per
  block per layer (run lengths all 1, nothing coalesced).
* ``layer_coalesced``: ``LBHNC`` + coalescing: one descriptor per run per layer.
* ``cross_layer_pool`` (``--pool-threads`` > 0, default 2): ``cross_layer``
  on a second decode agent whose READs NIXL's UCX thread pool moves, each
  cut into ``--split-mib`` pieces (what p2pkv's ``transfer_cpus`` of two cores or more give
  with its ``p2pkv.worker.READ_SPLIT_MIB`` pieces).

Directions (``--mode``, a comma-separated list, default ``pull``):

* ``pull``: the methods above; the decode side posts NIXL READs.
* ``push``: ``cross_layer``, ``per_layer`` and ``layer_coalesced`` again,
  with the same descriptor rows, but the prefill side WRITEs the same blocks
  into the decode side's, each with a notification, when the decode side
  asks; timed from the ask to the notification
  (:mod:`transfer_bench.push`: the prefill's own post → DONE
  time and planning are reported apart).

``memcpy`` is measured once per run either way, and every mode's GB/s is
also given as a ratio to it.

With ``device="cuda"`` (``--device cuda``) every cache lives in GPU memory
(NIXL memory type ``VRAM``; both processes' on one GPU, and UCX moves the
READs between them with ``cuda_ipc``), and ``memcpy`` is a
device-to-device ``copy_`` of the same byte ranges on the decode side,
timed between ``torch.cuda.synchronize()`` calls.

Requests are moved one at a time; a pull is timed from
:meth:`~p2pkv.dataplane.agent.NixlTransferAgent.start_read` (NIXL descriptor lists,
``initialize_xfer``, post) to the poll that sees it DONE. Descriptor planning
(coalesce_runs + build_descriptors) is timed apart. Before the timed requests
each method pulls (and, in push mode, has the prefill push) request 0 once
into scrubbed destination blocks and the bytes are compared exactly with the
source (warm-up and correctness check). Timed requests interleave every
method of every mode in rotating order, so all see the same background load.

Units: bytes; GB/s are 1e9 bytes per second; times in ms or µs as named.

Run it as ``python scripts/bench_transfer.py [flags]`` from a checkout (it
needs only torch, numpy, msgspec, pyzmq and NIXL, not the proxy's web stack).
Before it was a script it was ``p2pkv bench transfer``, with the same flags:
the commands recorded in older results run it.
The modules it uses live in ``scripts/transfer_bench/``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # transfer_bench, here and in the spawned prefill

from p2pkv.dataplane.plan import coalesce_runs
from p2pkv.testing import GiB, make_placements, size_cache
from p2pkv.tools.bench import machine
from p2pkv.tools.bench.results import write_json

from transfer_bench import report
from transfer_bench.decode import Decode
from transfer_bench.options import (
    DEVICES,
    METHODS,
    PROCESS_OVERHEAD_BYTES,
    TransferBenchOptions,
    add_arguments,
    check_modes,
    log,
    options_from_args,
    peak_rss_bytes,
)
from transfer_bench.prefill import SpawnedPrefill
from transfer_bench.push import MODE_LABELS, PUSH_METHODS, PushError
from transfer_bench.stream import STREAM_METHODS, WAYS

__all__ = ["METHODS", "PUSH_METHODS", "add_arguments", "build_parser", "check_options", "cli_main", "main",
           "resolve_device", "run_transfer_bench"]

if TYPE_CHECKING:
    import argparse

    import torch


def resolve_device(name: str) -> torch.device:
    """The torch device ``--device name`` means (``"cuda"``: the current GPU, e.g. ``cuda:0``).

    Raises:
        ValueError: not ``cpu``/``cuda``/``cuda:N``, or no such CUDA device is
            usable (the message names ``--device``).
    """
    import torch

    kind, _, index = name.partition(":")
    if kind not in DEVICES or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"--device {name}: expected one of {', '.join(DEVICES)} (or cuda:N)")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                         "use --device cpu")
    count = torch.cuda.device_count()
    idx = int(index) if index else torch.cuda.current_device()
    if idx >= count:
        raise ValueError(f"--device {name}: only {count} CUDA device(s) visible")
    return torch.device("cuda", idx)


def check_options(opts: TransferBenchOptions) -> tuple[int, list[int], list[str]]:
    """``(num_blocks, token sizes that fit, warnings)``: two caches per process within ``max_mem_gib``.

    With ``device="cuda"`` the budget is GPU memory, and this GPU's free
    memory must hold both processes' caches (four) now.

    Raises:
        ValueError: bad options, no usable CUDA device for ``--device cuda``,
            or not even the smallest request fits.
    """
    if opts.requests < 1 or not opts.tokens or min(opts.tokens) < 1 or opts.fragmentation < 0:
        raise ValueError("need --requests >= 1, token sizes >= 1 and --fragmentation >= 0")
    check_modes(opts.modes)
    if "stream" in opts.modes and (opts.layer_ms < 0 or (opts.layer_ms == 0 and opts.device == "cpu")):
        raise ValueError(f"--layer-ms {opts.layer_ms:g}: expected > 0 (or 0 with --device cuda: a GEMM per layer)")
    if opts.shape.page_bytes % 8:
        raise ValueError(f"a block's page is {opts.shape.page_bytes} B; the benchmark needs a multiple of 8")
    device = resolve_device(opts.device)
    budget = int(opts.max_mem_gib * GiB) - PROCESS_OVERHEAD_BYTES
    num_blocks, tokens, warnings = size_cache(opts.shape, opts.tokens, opts.requests, opts.num_blocks, budget,
                                              caches=2)
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        need = 2 * (2 * num_blocks * opts.shape.block_bytes + PROCESS_OVERHEAD_BYTES)
        if need > free:
            raise ValueError(f"--device {opts.device}: 2 processes with two caches of {num_blocks} blocks each "
                             f"need {need / GiB:.2f} GiB of GPU memory but {device} has {free / GiB:.2f} GiB free; "
                             "lower --max-mem-gib or --num-blocks")
    return num_blocks, tokens, warnings


def _bench_tokens(dec: Decode, opts: TransferBenchOptions, tokens: int) -> dict[str, Any]:
    placements = make_placements(opts.seed, tokens, opts.shape, dec.num_blocks, opts.requests, opts.fragmentation)
    runs = [int(coalesce_runs(lo, re, dec.num_blocks, dec.num_blocks)[2].size) for lo, re in placements]
    blocks = int(placements[0][0].size)
    nbytes = blocks * opts.shape.block_bytes
    entry: dict[str, Any] = {"tokens": tokens, "blocks_per_request": blocks, "runs_per_request": report.counts(runs),
                             "bytes_per_request": nbytes, "methods": {}}
    pushes = list(PUSH_METHODS) if "push" in opts.modes else []
    streams = [f"{m}/{w}" for m in STREAM_METHODS for w in WAYS] if "stream" in opts.modes else []
    verified = {method: dec.verified_pull(method, *placements[0]) for method in dec.labels}
    verified_push = {method: dec.verified_push(method, *placements[0]) for method in pushes}
    verified_stream = {s: dec.verified_stream(*s.split("/"), *placements[0]) for s in streams}
    work = [("pull", m) for m in dec.labels] + [("push", m) for m in pushes] + [("stream", s) for s in streams]
    samples: dict[tuple[str, str], list[Any]] = {w: [] for w in work}
    for i, (loc, rem) in enumerate(placements):
        # Interleaved, in rotating order: every method of every mode sees the same background load.
        for mode, method in work[i % len(work):] + work[:i % len(work)]:
            if mode == "stream":
                samples[mode, method].append(dec.timed_stream(*method.split("/"), loc, rem))
                continue
            samples[mode, method].append(dec.timed(method, loc, rem) if mode == "pull"
                                         else dec.timed_push(method, loc, rem))
        log(opts.quiet, f"{tokens} tokens: request {i + 1}/{len(placements)} moved every way")
    for method in dec.labels:
        plan_s, pull_s, descs = zip(*samples["pull", method], strict=True)
        res = entry["methods"][method] = report.method_stats(nbytes, pull_s, plan_s, descs, verified[method])
        res["mode"] = None if method == "memcpy" else "pull"
        log(opts.quiet, f"{tokens} tokens  {method:<15} {res['gbps']:7.2f} GB/s  p50 {res['latency_ms']['p50']:8.2f} ms"
                   f"  {res['descriptors_per_request']['mean']:9.1f} desc/req  verified={res['verified']}")
    memcpy = entry["methods"]["memcpy"]["gbps"]
    for res in entry["methods"].values():
        res["ratio_to_memcpy"] = res["gbps"] / memcpy
    if pushes:
        entry["push"] = {}
        for method in pushes:
            plan_s, push_s, writer_s, descs = zip(*samples["push", method], strict=True)
            res = entry["push"][method] = report.push_stats(nbytes, push_s, writer_s, plan_s, descs,
                                                            verified_push[method])
            res["ratio_to_memcpy"] = res["gbps"] / memcpy
            log(opts.quiet, f"{tokens} tokens  {method + ' push':<20} {res['gbps']:7.2f} GB/s  p50 "
                       f"{res['latency_ms']['p50']:8.2f} ms (writer {res['writer_xfer_ms']['p50']:8.2f} ms)  "
                       f"verified={res['verified']}")
    if streams:
        entry["stream"] = report.stream_stats({s: samples["stream", s] for s in streams}, verified_stream,
                                              opts.shape.num_layers)
        for name, res in entry["stream"].items():
            log(opts.quiet, f"{tokens} tokens  {name:<22} wait after the last layer p50 "
                       f"{res['wait_after_last_layer_ms']['p50']:8.2f} ms  total p50 {res['total_ms']['p50']:8.2f} ms"
                       f"  verified={res['verified']}")
    return entry


def run_transfer_bench(opts: TransferBenchOptions) -> dict[str, Any]:
    """Run the whole benchmark: spawn the prefill process, measure as the decode side, end it.

    Returns:
        The results dict that :mod:`transfer_bench.report` prints, writes and checks.

    Raises:
        ValueError: bad options (see :func:`check_options`).
        RuntimeError: the prefill process failed or did not answer.
        PushError: in push mode, the prefill could not push a request.
    """
    import torch

    num_blocks, tokens, warnings = check_options(opts)
    device = resolve_device(opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for w in warnings:
        log(opts.quiet, f"warning: {w}")
    threads = torch.get_num_threads()
    started, t_wall = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    link: SpawnedPrefill | None = None
    dec: Decode | None = None
    try:
        torch.set_num_threads(opts.memcpy_threads or threads)  # restored below
        log(opts.quiet, f"{opts.shape.label()}; {num_blocks} blocks per cache "
                   f"({num_blocks * opts.shape.block_bytes / GiB:.2f} GiB), 2 caches per process on {device}")
        link = SpawnedPrefill(opts, num_blocks, device)
        dec = Decode(opts, num_blocks, device)  # while the prefill starts
        ready = link.ready()
        dec.connect(ready, opts.host)
        if {"push", "stream"} & set(opts.modes):
            dec.enable_push(link)
        log(opts.quiet, "handshakes: " + ", ".join(f"{k} {v['setup_ms']:.1f} ms" for k, v in dec.peers.items()))
        results = [_bench_tokens(dec, opts, t) for t in tokens]
        decode_rss = peak_rss_bytes()
        decode_gpu = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        dec.close()
        done = link.finish()
    finally:
        if dec is not None:
            dec.close()
        torch.set_num_threads(threads)
        if link is not None:
            link.close()
    result: dict[str, Any] = {
        "benchmark": "transfer", "command": machine.command_line(opts.argv), "argv": list(opts.argv),
        "timestamp": started, "wall_s": time.perf_counter() - t_wall, "machine": machine.machine_info(str(device)),
        "config": {**{k: v for k, v in asdict(opts).items() if k not in ("argv", "quiet")},
                   "device": str(device), "nixl_mem_type": dec.mem_type,
                   "tokens": tokens,
                   "shape_label": opts.shape.label(), "block_bytes": opts.shape.block_bytes,
                   "page_bytes": opts.shape.page_bytes, "num_blocks": num_blocks,
                   "cache_bytes": num_blocks * opts.shape.block_bytes, "torch_threads": opts.memcpy_threads or threads,
                   "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}},
        "methods": dict(dec.labels),
        "modes": {mode: {"mode": mode, "label": MODE_LABELS[mode],
                         "methods": ([m for m in dec.labels if m != "memcpy"] if mode == "pull"
                                     else list(PUSH_METHODS) if mode == "push" else list(STREAM_METHODS))}
                  for mode in opts.modes},
        "setup": {"decode_register_ms": dec.register_ms, "peers": dec.peers},
        "processes": {"decode_peak_rss_bytes": decode_rss, "prefill_peak_rss_bytes": done["peak_rss_bytes"],
                      "decode_peak_gpu_bytes": decode_gpu, "prefill_peak_gpu_bytes": done.get("peak_gpu_bytes"),
                      "prefill_notifications": done["notifs"]},
        "warnings": warnings, "results": results,
    }
    if dec.pusher is not None:
        result["setup"]["push_add_remote_agent_ms"] = dec.pusher.add_remote_agent_ms
    return result


def cli_main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags (:func:`transfer_bench.options.add_arguments`).

    Returns:
        0 ok; 1 a pull or push moved wrong bytes; 2 bad options; 3 the prefill could not push.
    """
    try:
        result = run_transfer_bench(options_from_args(args))
    except (ValueError, PushError) as exc:
        print(f"bench_transfer: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 3
    print(report.format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and report.plot(result, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    moved = [m for r in result["results"] for m in (*r["methods"].values(), *r.get("push", {}).values())]
    return 0 if all(m["verified"] is not False for m in moved) else 1


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python scripts/bench_transfer.py``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python scripts/bench_transfer.py",
                                     description="KV block pulls and pushes over NIXL between two processes "
                                                 "vs memcpy")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python scripts/bench_transfer.py [flags]``; exit codes as :func:`cli_main`.

    Imports only the benchmark's own dependencies, not the proxy.
    """
    return cli_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
