"""Settings of ``scripts/bench_transfer.py``: the options, their command-line flags, the names both processes share."""

from __future__ import annotations

import argparse
import os
import resource
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from p2pkv.testing import ITEMSIZES, LLAMA3_8B, KVShape

DEVICES = ("cpu", "cuda")
"""``--device`` choices: host memory (NIXL ``DRAM``) or GPU memory (NIXL ``VRAM``)."""

PROCESS_OVERHEAD_BYTES = 768 << 20
"""Bytes one benchmark process needs besides its two caches (torch, NIXL, UCX; on a GPU: the
CUDA context and the verification temporaries, in GPU memory)."""

MODES = ("pull", "push", "stream")
"""``--mode`` choices: the decode side READs the blocks (pull), or the prefill side WRITEs them (push)."""

PREFILL_CACHE_LAYOUTS = ("BLHNC", "LBHNC")
"""The prefill side's caches (cross-layer, layer-compact), each served by its own side channel."""

METHODS: dict[str, str] = {
    "memcpy": "in-process memcpy of the same byte ranges (torch copy_ per run; the limit)",
    "cross_layer": "p2pkv: cross-layer blocks (BLHNC) + run coalescing",
    "per_layer": "NixlConnector scheme: layer-compact (LBHNC), 1 descriptor per block per layer",
    "layer_coalesced": "layer-compact (LBHNC) + run coalescing, 1 descriptor per run per layer",
}
"""Method key → what it measures (host memory; the decode side's ``labels`` say what it measured)."""

CUDA_MEMCPY_LABEL = ("in-process device-to-device copy of the same byte ranges (torch copy_ per run, "
                     "between torch.cuda.synchronize() calls; the limit)")
"""What ``memcpy`` measures with ``--device cuda``."""

PEER_LAYOUT = {"cross_layer": "BLHNC", "per_layer": "LBHNC", "layer_coalesced": "LBHNC", "cross_layer_pool": "BLHNC"}
"""NIXL method → the cache (layout, the same on both sides) it moves from and into."""


def remote_seed(seed: int, layout: str) -> int:
    """Pattern seed of the prefill side's ``layout`` cache."""
    return 2 * seed + 100 + PREFILL_CACHE_LAYOUTS.index(layout)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes; Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log(quiet: bool, msg: str) -> None:
    """A progress line on stderr (none when ``quiet``)."""
    if not quiet:
        print(f"[bench_transfer] {msg}", file=sys.stderr, flush=True)


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
        pool_threads: also pull ``cross_layer`` through a second decode agent
            with NIXL's UCX thread pool of this many threads
            (``cross_layer_pool``); 0: not measured.
        split_mib: with ``num_threads`` > 0, cut the decode side's READ
            descriptors into pieces of at most this many MiB (0: never), as
            p2pkv does (``p2pkv.worker.READ_SPLIT_MIB``), so NIXL's thread pool shares a READ.
        memcpy_threads: torch threads for the memcpy method (0: torch default; host memory only).
        max_mem_gib: memory per process (GiB), two caches plus overhead: host
            memory for ``device="cpu"``, GPU memory for ``"cuda"`` (both
            processes use the same GPU, so it must hold twice this).
        device: where every cache lives: ``"cpu"`` (host memory, NIXL
            ``DRAM``), ``"cuda"`` (the current GPU) or ``"cuda:N"`` (NIXL
            ``VRAM``; the prefill process uses the same GPU).
        verify: compare one pulled request per method with its source, byte for byte.
        host: the prefill process's side-channel bind address (loopback by default; an RDMA
            interface's address makes UCX go through the HCA).
        prefill_poll_ms: how often the prefill process progresses NIXL (drains
            notifications) without a progress thread. Pulls are READs without
            a notification (sent after completion, as the worker does), so
            their completion does not wait for the prefill side.
        quiet: no progress lines on stderr.
        modes: directions to measure, in order (:data:`MODES`): ``"pull"``
            (the decode side posts NIXL READs) and/or ``"push"`` (the prefill
            side posts NIXL WRITEs into the decode side's blocks, each with a
            notification the decode waits for) and/or ``"stream"`` (the prefill
            side WRITEs each layer while a stand-in forward computes the next,
            :mod:`transfer_bench.stream`).
        layer_ms: stream mode: how long the stand-in forward takes per layer (milliseconds; 0 on a GPU: one
            GEMM of a Llama-3-8B layer's FLOPs for the request's tokens).
        poster: stream mode: ``"thread"`` (a :class:`p2pkv.prefill.poster.StreamPoster` pumps the stream on its
            own thread) or ``"inline"`` (the forward's thread pumps it between layers).
        forward_stream: stream mode on a GPU: the CUDA stream of the stand-in forward, ``"current"`` (torch's
            current stream) or ``"side"`` (a non-blocking stream of torch's pool).
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
    pool_threads: int = 2
    split_mib: float = 4.0
    memcpy_threads: int = 0
    max_mem_gib: float = 6.0
    device: str = "cpu"
    verify: bool = True
    host: str = "127.0.0.1"
    prefill_poll_ms: float = 0.5
    quiet: bool = False
    modes: tuple[str, ...] = ("pull",)
    layer_ms: float = 2.0
    poster: str = "thread"
    forward_stream: str = "current"
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    def nixl_settings(self) -> dict[str, Any]:
        """How both sides' NIXL agents are made: ``progress_thread`` (p2pkv's is a constant,
        ``p2pkv.worker.NIXL_PROGRESS_THREAD``, set in the prefill process) and the
        prefill side's ``transfer_cpus``: ``num_threads`` of this process's cores, which give the prefill rank a
        thread pool of that size (:func:`p2pkv.transfer_threads.nixl_threads`; none: ``""``)."""
        cores = sorted(os.sched_getaffinity(0))[:self.num_threads] if self.num_threads >= 2 else []
        return {"progress_thread": self.progress_thread, "transfer_cpus": ",".join(map(str, cores))}


def _token_list(text: str) -> tuple[int, ...]:
    """``"1024,4k,16k"`` → ``(1024, 4096, 16384)``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return tuple(out)


def check_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    """``modes`` if it is a non-empty list of :data:`MODES`, each at most once.

    Raises:
        ValueError: an unknown or repeated mode, or none (the message names ``--mode``).
    """
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        raise ValueError(f"--mode {','.join(modes)}: expected a comma-separated list of {', '.join(MODES)}, "
                         "each at most once")
    return modes


def _mode_list(text: str) -> tuple[str, ...]:
    """``"pull,push"`` → ``("pull", "push")`` (:func:`check_modes`; argparse turns its ValueError into exit 2)."""
    return check_modes(tuple(part.strip().lower() for part in text.split(",") if part.strip()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``scripts/bench_transfer.py`` (defaults from :class:`TransferBenchOptions`)."""
    d = TransferBenchOptions()
    p.add_argument("--layers", type=int, default=d.shape.num_layers, help="attention layers")
    p.add_argument("--kv-heads", type=int, default=d.shape.num_kv_heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.shape.head_dim, help="elements per head")
    p.add_argument("--dtype", default=d.shape.dtype, choices=list(ITEMSIZES), help="KV cache dtype")
    p.add_argument("--block-size", type=int, default=d.shape.block_size, help="tokens per block")
    p.add_argument("--num-blocks", type=int, default=0, help="blocks per cache (0: auto within --max-mem-gib)")
    p.add_argument("--requests", type=int, default=d.requests, help="timed requests per size and method")
    p.add_argument("--tokens", type=_token_list, default=d.tokens,
                   help="tokens per request, a comma-separated list (1024,4k,16k)")
    p.add_argument("--mode", type=_mode_list, default=d.modes, metavar="MODES",
                   help="directions to measure, comma-separated: pull (the decode side posts NIXL READs), push "
                        "(the prefill side posts NIXL WRITEs into the decode's blocks, timed from the decode's ask "
                        "to the WRITE's notification), stream (the prefill side WRITEs each layer as a stand-in "
                        "forward computes it, against one WRITE after the last layer); e.g. pull,push")
    stream = p.add_argument_group("--mode stream")
    stream.add_argument("--layer-ms", type=float, default=d.layer_ms,
                        help="the stand-in forward's time per layer (ms; a torch.cuda._sleep kernel on a GPU, the "
                             "host asleep on the CPU; 0 on a GPU: a GEMM of a Llama-3-8B layer's FLOPs)")
    stream.add_argument("--poster", choices=("thread", "inline"), default=d.poster,
                        help="which thread posts the WRITEs: the prefill's StreamPoster thread, or the forward's "
                             "own between layers")
    stream.add_argument("--forward-stream", choices=("current", "side"), default=d.forward_stream,
                        help="the CUDA stream the stand-in forward runs on: torch's current one, or a side stream "
                             "(non-blocking: copies UCX queues on the legacy default stream do not wait for it)")
    p.add_argument("--seed", type=int, default=d.seed, help="block placement seed")
    p.add_argument("--fragmentation", type=int, default=d.fragmentation, metavar="MAX_RUN",
                   help="longest run of consecutive block ids per allocation (1: all scattered, 0: contiguous)")
    p.add_argument("--progress-thread", action="store_true", help="NIXL progress thread on every agent")
    p.add_argument("--num-threads", type=int, default=0, help="UCX backend threads (0: NIXL default)")
    p.add_argument("--pool-threads", type=int, default=d.pool_threads,
                   help="also measure cross_layer_pool: cross-layer READs on NIXL's UCX thread pool of this many "
                        "threads (0: not measured)")
    p.add_argument("--split-mib", type=float, default=d.split_mib,
                   help="with --num-threads / --pool-threads: cut READ descriptors into pieces of at most this "
                        "many MiB (0: never)")
    p.add_argument("--memcpy-threads", type=int, default=0, help="torch threads for memcpy (0: torch default)")
    p.add_argument("--max-mem-gib", type=float, default=d.max_mem_gib,
                   help="memory per process (GiB; GPU memory with --device cuda): two KV caches plus about 0.75 GiB")
    p.add_argument("--device", choices=list(DEVICES), default=d.device,
                   help="where the KV caches live: cpu (host memory, NIXL DRAM) or cuda (the current GPU, NIXL "
                        "VRAM; both processes on it, UCX cuda_ipc between them; memcpy is a "
                        "device-to-device copy)")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-exact check of one pull per method")
    p.add_argument("--host", default=d.host, help="the prefill process's side-channel address (ephemeral ports)")
    p.add_argument("--prefill-poll-ms", type=float, default=d.prefill_poll_ms,
                   help="how often the prefill process progresses NIXL without a progress thread (ms)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PNG", help="write a plot here (needs matplotlib: p2pkv[bench])")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def options_from_args(args: argparse.Namespace) -> TransferBenchOptions:
    """:class:`TransferBenchOptions` from the flags of :func:`add_arguments` (each flag named as its field)."""
    shape = KVShape(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_size)
    named = {f.name: getattr(args, f.name) for f in fields(TransferBenchOptions) if f.name in vars(args)}
    return TransferBenchOptions(**named, shape=shape, verify=not args.no_verify, modes=tuple(args.mode))
