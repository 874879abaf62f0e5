"""Two OS processes with real NIXL agents (UCX over loopback) pull KV blocks.

The prefill process owns a synthetic KV cache shaped like vLLM's and serves
its metadata on the side channel; this process pulls chosen blocks through
:class:`p2pkv.worker.WorkerSide` exactly as a decode worker does. Bytes are
compared exactly; blocks not pulled stay untouched; the prefill side releases
the request when the completion notification arrives.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import pytest
import torch

from handshake.fingerprints import fingerprint
from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import block_bytes, make_kv_caches
from p2pkv.worker import WorkerSide
from tests.fault_injection.support import released_once_not_expired
from tests.p2p_harness import PrefillProc
from tests.workers import (
    COMPAT_FIELDS,
    NUM_BLOCKS,
    SHAPE,
    free_port,
    idle_cpu_s,
    make_worker,
    model_info,
    run_until_received,
    task,
)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("prefill", ["LBHNC", "BLHNC", "KV_SPLIT"], indirect=True)
def test_pull_moves_exactly_the_requested_blocks(prefill: PrefillProc, mode: str) -> None:
    """Pull (READs) and push (the prefill rank WRITEs) move the same bytes into the same blocks."""
    layout, port = prefill.layout, prefill.port
    first, second = f"{mode}-1", f"{mode}-2"
    prefill.lease([first, second])
    _, expected = make_kv_caches(layout, seed=1, **SHAPE)
    base, views = make_kv_caches(layout, fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port(), transfer_mode=mode)
    worker.model = model_info(layout)
    worker.register_kv_caches(views, NUM_BLOCKS)
    assert worker.layout is not None
    assert worker.layout.cross_layer == (layout == "BLHNC")
    try:
        # Runs that coalesce (3,4,5 -> 10,11,12), a lone block, a reversed pair.
        local = [3, 4, 5, 20, 40, 39]
        remote = [10, 11, 12, 7, 63, 0]
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", first, port, local, remote)]))
        assert run_until_received(worker, "d-1") == set()
        for lb, rb in zip(local, remote, strict=True):
            assert block_bytes(views, layout, lb) == block_bytes(expected, layout, rb)
        zero = bytes(len(block_bytes(views, layout, 0)))
        for b in set(range(NUM_BLOCKS)) - set(local):
            assert block_bytes(views, layout, b) == zero, f"block {b} was touched"
        # The prefill side is told and releases exactly that request.
        released_once_not_expired(prefill, first, timeout_s=30)
        assert second not in prefill.released()
        # Second pull reuses the peer: no new handshake.
        served_before = len(worker.receiver.peers.peers)
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-2", second, port, [50], [51])]))
        assert run_until_received(worker, "d-2") == set()
        assert len(worker.receiver.peers.peers) == served_before == 1
        assert block_bytes(views, layout, 50) == block_bytes(expected, layout, 51)
        released_once_not_expired(prefill, second, timeout_s=30)
        assert worker.stats.data["directions"] == {mode: 2}
        # Nothing left to do: the pulls' thread and the WRITE thread wait, they do not poll.
        assert idle_cpu_s([worker.receiver.progress._thread, worker.writes.thread]) < 0.1
    finally:
        worker.shutdown()
    assert base.abs().sum() > 0


def refused_at_handshake(prefill: PrefillProc, request_id: str, change: Callable[[WorkerSide], object]) -> None:
    """A decode worker (an ``LBHNC`` cache) that ``change`` made incompatible pulls ``request_id`` from ``prefill``:
    the pull ends at the handshake, its blocks as load errors, no byte written, no peer kept."""
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port())
    change(worker)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", request_id, prefill.port, [1, 2], [1, 2])]))
        assert run_until_received(worker, "d-1") == {1, 2}
        assert torch.count_nonzero(next(iter(views.values()))) == 0
        assert worker.receiver.peers.peers == {}
        released_once_not_expired(prefill, request_id)  # before the worker closes: closing cancels the release
    finally:
        worker.shutdown()


@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_incompatible_model_shape_is_refused_and_reported(prefill: PrefillProc,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A peer whose model shape differs (here head_dim) is refused at handshake, before any READ; the prefill
    engine is told to free the request at once (the side channel's ``ReleaseHolds``)."""
    prefill.lease(["shape-1"], 60.0)

    def other_head_dim(worker: WorkerSide) -> None:
        worker.model = dataclasses.replace(model_info("LBHNC"), head_dim=8)

    refused_at_handshake(prefill, "shape-1", other_head_dim)
    assert "kind=refused" in caplog.text and "head_dim: prefill has 16, decode has 8" in caplog.text
    released_once_not_expired(prefill, "shape-1")  # the hold is freed now, not when its 60 s lease ends


@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_incompatible_engine_is_refused_before_any_read(prefill: PrefillProc,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A prefill rank whose compatibility fields differ (here its KV cache dtype) is refused at handshake."""
    prefill.lease(["engine-1"])

    def other_kv_cache_dtype(worker: WorkerSide) -> None:
        worker.compat_hash = fingerprint({**COMPAT_FIELDS, "kv_cache_dtype": "fp8_e5m2"})

    refused_at_handshake(prefill, "engine-1", other_kv_cache_dtype)
    assert "kind=refused" in caplog.text
    assert "kv_cache_dtype: the peer has 'auto', this side has 'fp8_e5m2'" in caplog.text


def test_unreachable_prefill_marks_blocks_failed() -> None:
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port(), handshake_timeout_s=0.3, handshake_attempts=1)
    worker.model = model_info("LBHNC")
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "req-1", free_port(), [5, 6, 7], [1, 2, 3])]))
        assert run_until_received(worker, "d-1", timeout_s=20) == {5, 6, 7}
    finally:
        worker.shutdown()


def test_restarted_prefill_is_used_again_without_restarting_decode() -> None:
    """Kill the prefill process, start a new one (new NIXL agent, same engine_id and port):
    the decode worker notices the dead peer, re-handshakes and pulls from the new one."""
    _, views = make_kv_caches("BLHNC", fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port())
    worker.model = model_info("BLHNC")
    worker.register_kv_caches(views, NUM_BLOCKS)
    pf = PrefillProc(free_port())
    pf.start({"req-1": 60.0}, seed=1)
    try:
        port = pf.port
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "req-1", port, [1, 2], [3, 4])]))
        assert run_until_received(worker, "d-1") == set()
        released_once_not_expired(pf, "req-1", timeout_s=30)
        old_agent = next(iter(worker.receiver.peers.peers.values())).agent_name
        pf.kill()
        pf.start({"req-9": 60.0}, seed=2)
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-9", "req-9", port, [10, 11, 12], [20, 21, 22])]))
        assert run_until_received(worker, "d-9") == set()
        _, expected = make_kv_caches("BLHNC", seed=2, **SHAPE)
        for lb, rb in ((10, 20), (11, 21), (12, 22)):
            assert block_bytes(views, "BLHNC", lb) == block_bytes(expected, "BLHNC", rb)
        assert next(iter(worker.receiver.peers.peers.values())).agent_name != old_agent
        released_once_not_expired(pf, "req-9", timeout_s=30)
        assert pf.released_by_incarnation == [{"req-1"}, {"req-9"}]
    finally:
        worker.shutdown()
        if pf.alive():
            pf.stop()


@pytest.mark.parametrize("setting,expected", [(0.001, 0.001), (0.0, 0.005), (0.01, 0.005)])
def test_worker_lowers_the_thread_switch_interval(setting: float, expected: float,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered worker lowers Python's switch interval to ``SWITCH_INTERVAL_S`` (never raises it; 0 leaves it)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    monkeypatch.setattr("p2pkv.worker.SWITCH_INTERVAL_S", setting)
    worker = make_worker("switch", free_port())
    try:
        _, views = make_kv_caches("BLHNC", **SHAPE)
        worker.register_kv_caches(views, NUM_BLOCKS)
        assert sys.getswitchinterval() == pytest.approx(expected)
    finally:
        worker.shutdown()
        sys.setswitchinterval(old)


@pytest.mark.parametrize("prefill", ["BLHNC"], indirect=True)
def test_a_part_longer_than_one_push_request_is_pushed_in_several(prefill: PrefillProc,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A push request carries at most ``MAX_PUSH_ROWS`` descriptor rows: in push mode, a part with more is cut
    into parts of at most that many rows, each its own push request (the prefill rank pins the hold once per
    request), all WRITTEN: same bytes, same blocks, and the hold released once."""
    layout, port = prefill.layout, prefill.port
    prefill.lease(["long-1"])
    monkeypatch.setattr("p2pkv.decode.movers.MAX_PUSH_ROWS", 2)  # the decode side's cap; 5 rows below
    _, expected = make_kv_caches(layout, seed=1, **SHAPE)
    _, views = make_kv_caches(layout, fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port(), transfer_mode="push")
    worker.model = model_info(layout)
    worker.register_kv_caches(views, NUM_BLOCKS)
    posted: list[int] = []
    post = worker.receiver.pushes.post
    monkeypatch.setattr(worker.receiver.pushes, "post", lambda part: (posted.append(len(part.remote_descs)),
                                                                      post(part)))
    try:
        local, remote = [3, 4, 5, 20, 40, 39, 8], [10, 11, 12, 7, 63, 0, 30]  # 5 runs of cross-layer blocks
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "long-1", port, local, remote)]))
        assert run_until_received(worker, "d-1") == set()
        assert sorted(posted) == [1, 2, 2]  # three push requests, none over the cap
        for lb, rb in zip(local, remote, strict=True):
            assert block_bytes(views, layout, lb) == block_bytes(expected, layout, rb)
        released_once_not_expired(prefill, "long-1", timeout_s=30)
        assert worker.stats.data["directions"] == {"push": 1}
    finally:
        worker.shutdown()
