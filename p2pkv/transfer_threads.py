"""What p2pkv's transfer threads run on: the KV cache's GPU, and the CPU cores ``transfer_cpus`` names.

A rank's bytes are moved by threads of its own: the prefill rank's WRITE
thread (``p2pkv-write``: pushes and layer streams), the decode rank's pulls
thread (``p2pkv-pulls-tp<rank>``). Each binds the KV
cache's GPU first (NIXL and CUDA calls made on a thread otherwise go to GPU 0).
Threads these start later (the side-channel pools' threads, started on
demand by the pulls thread) inherit their cores.

On CPU engines over TCP those threads do the sending and receiving work
(UCX progress, the kernel's socket copies), about 0.5 CPU-s per 512 MiB
sent (``docs/benchmarks/stream-wait-cpu-threads-tcp-after.json``). A thread
inherits the CPU affinity of the thread that starts it, here the engine
thread: when the engine is limited to its forward's cores (pinned, a
container's cpuset), a layer stream's sending runs there during the forward.
``transfer_cpus`` (a ``taskset``-style list, e.g. ``"6,7"`` or ``"6-7"``)
moves these threads to other cores, such as those a CPU deployment leaves to
the serving framework (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` /
``VLLM_CPU_NUM_OF_RESERVED_CPU``). Measured in
``docs/benchmarks/stream-prefill-ab.md``. Linux only (``os.sched_setaffinity``
of the calling thread).

The same cores host NIXL's UCX thread pool (:func:`nixl_threads`): one READ
from one thread runs at the host's single-thread ``process_vm_readv``
ceiling; two threads sharing it, each READ cut into 4 MiB pieces
(:data:`p2pkv.worker.READ_SPLIT_MIB`), read about 1.3x faster on one host
(``docs/benchmarks/transfer-cpu.md``). The pool's threads spin while a
READ is in flight, so they go only where a core is free for them: the
cores ``transfer_cpus`` names, one thread per core, two at least.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from p2pkv.config import parse_cpus

__all__ = ["bind_device", "nixl_threads", "parse_cpus", "pin_thread", "pinned", "start_transfer_thread"]

MIN_POOL_THREADS = 2
"""Fewest ``transfer_cpus`` cores that get NIXL a thread pool: one pool thread moves a READ no faster than the
calling thread does without a pool (``docs/benchmarks/transfer-cpu.md``)."""

logger = logging.getLogger(__name__)


def bind_device(mem_type: str, device_id: int) -> None:
    """Make the KV cache's GPU the current device of the calling thread; nothing for host memory."""
    if mem_type == "VRAM":
        import torch

        torch.cuda.set_device(device_id)


def pin_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread on ``cpus`` only (none: unchanged). Cores this process may not use (not on this
    machine, or outside a container's cpuset) are left out by the kernel; with none left the thread stays
    where it was, with a warning."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("p2pkv: transfer_cpus %s: none of these cores can run this thread (%s); it runs on %s",
                       sorted(cpus), exc, sorted(os.sched_getaffinity(0)))


def start_transfer_thread(mem_type: str, device_id: int, cpus: frozenset[int]) -> None:
    """Run first on each transfer thread: bind the KV cache's GPU, then pin the thread to ``cpus``."""
    bind_device(mem_type, device_id)
    pin_thread(cpus)


def nixl_threads(cpus: frozenset[int]) -> int:
    """Threads of NIXL's UCX thread pool for a rank whose ``transfer_cpus`` are ``cpus``: one per core when they
    are at least :data:`MIN_POOL_THREADS`, else 0 (no pool: NIXL's default)."""
    return len(cpus) if len(cpus) >= MIN_POOL_THREADS else 0


@contextmanager
def pinned(cpus: frozenset[int]) -> Iterator[None]:
    """Run the calling thread on ``cpus`` inside the block (threads it starts there keep them, as NIXL's thread
    pool does), then on the cores it had before; none: unchanged."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_thread(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
