"""A decode worker with NIXL's UCX thread pool: each READ is cut into pieces the pool's threads share.

A real prefill worker in its own process, a real decode worker here with
``nixl_num_threads`` 2 and pieces (:data:`p2pkv.worker.READ_SPLIT_MIB`) far smaller than a block run, so every
READ is split across both threads (``docs/benchmarks/transfer-cpu.md``
measures what that buys).
"""

from __future__ import annotations

import pytest

import p2pkv.worker as worker_module
from tests.p2p_harness import DecodeSide, PrefillProc, free_port, pull_task

PIECE_MIB = 8 / 1024  # 8 KiB: a block of the harness cache is 32 KiB, a run of three 96 KiB


def test_split_reads_on_two_threads_move_exact_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    pf = PrefillProc(free_port(), seed=9, num_blocks=64)
    pf.start()
    monkeypatch.setattr(worker_module, "READ_SPLIT_MIB", PIECE_MIB)
    d = DecodeSide(64, nixl_num_threads=2, transfer_timeout_s=15.0)
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

