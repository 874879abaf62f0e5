"""A decode worker with NIXL's UCX thread pool: each READ is cut into pieces the pool's threads share.

A real prefill worker in its own process, a real decode worker here with
``transfer_cpus`` of two cores (a pool of 2 threads, :func:`p2pkv.transfer_threads.nixl_threads`) and
pieces (:data:`p2pkv.worker.READ_SPLIT_MIB`) far smaller than a block run, so every
READ is split across both threads (``docs/benchmarks/transfer-cpu.md``
measures what that buys).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import p2pkv.worker as worker_module
from p2pkv.transfer_threads import nixl_threads, pinned
from tests.p2p_harness import DecodeSide, PrefillProc, free_port, pull_task

CORES = sorted(os.sched_getaffinity(0))


def cpu_list(cores: list[int]) -> str:
    """``transfer_cpus`` naming ``cores``."""
    return ",".join(map(str, cores))


def thread_cores() -> dict[int, frozenset[int]]:
    """This process's threads (kernel thread id) → the cores each may run on (``/proc``, Linux)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        line = next(x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list"))
        out[int(task.name)] = frozenset(_cores(line.split(":", 1)[1].strip()))
    return out


def _cores(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores

PIECE_MIB = 8 / 1024  # 8 KiB: a block of the harness cache is 32 KiB, a run of three 96 KiB


@pytest.mark.skipif(len(CORES) < 2, reason="a thread pool needs two transfer_cpus cores")
def test_split_reads_on_two_threads_move_exact_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    pf = PrefillProc(free_port(), seed=9, num_blocks=64)
    pf.start()
    monkeypatch.setattr(worker_module, "READ_SPLIT_MIB", PIECE_MIB)
    d = DecodeSide(64, transfer_cpus=cpu_list(CORES[:2]), transfer_timeout_s=15.0)
    assert d.worker.agent is not None and d.worker.agent._split_bytes == int(PIECE_MIB * 2**20)
    try:
        local, remote = [3, 4, 5, 20, 40, 39], [10, 11, 12, 7, 63, 0]
        for i in range(3):
            pf.lease([f"p-{i}"])
            d.start(pull_task(f"d-{i}", f"p-{i}", pf.port, local, remote))
            assert d.pump({f"d-{i}"}, 20.0) == set()
            assert d.take_errors() == set()
        expected = pf.expected()
        assert all(d.block_ok(lb, rb, expected) for lb, rb in zip(local, remote, strict=True))
        untouched = set(range(64)) - set(local)
        assert all(not d.base[b].any() for b in untouched)
        stats = d.worker.take_stats()
        (report,) = d.worker.agent.transports.values()
    finally:
        d.close()
        pf.stop()
    assert stats is not None and stats["pull_descriptors"] == [4, 4, 4]  # as planned: runs, not pieces
    assert report.transport == "cma"



def test_a_pool_takes_one_thread_per_transfer_core_from_two() -> None:
    """No cores named, or one: no pool (one thread READs as fast without one); two or more: a thread each."""
    assert [nixl_threads(frozenset(c)) for c in ((), (3,), (2, 3), (0, 1, 2, 3))] == [0, 0, 2, 4]


@pytest.mark.skipif(len(CORES) < 2, reason="pinning one thread needs a core to leave out")
def test_threads_started_while_pinned_keep_the_cores_and_the_caller_gets_its_own_back() -> None:
    """What NIXL's pool threads get: a thread started inside :func:`pinned` runs on those cores only; the calling
    thread (the engine's) runs on all of its cores again afterwards."""
    seen: list[frozenset[int]] = []
    with pinned(frozenset(CORES[-1:])):
        thread = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        thread.start()
        thread.join()
    assert seen == [frozenset(CORES[-1:])]
    assert sorted(os.sched_getaffinity(0)) == CORES


@pytest.mark.skipif(len(CORES) < 3, reason="two transfer cores and one left for the engine's thread")
def test_a_workers_nixl_pool_threads_run_on_its_transfer_cpus() -> None:
    """A decode worker with ``transfer_cpus`` of two of this process's cores: the threads its NIXL agent starts
    (the UCX pool among them) run there, the registering (engine) thread on all of its cores still."""
    before = thread_cores()
    d = DecodeSide(64, transfer_cpus=cpu_list(CORES[-2:]))
    try:
        started = {tid: cores for tid, cores in thread_cores().items() if tid not in before}
        pinned_threads = [tid for tid, cores in started.items() if cores == frozenset(CORES[-2:])]
        assert len(pinned_threads) >= 2, started  # the pool's two threads at least
        assert sorted(os.sched_getaffinity(0)) == CORES
    finally:
        d.close()
