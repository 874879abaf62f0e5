"""The decode worker's bounded, fair thread pools (:mod:`p2pkv.decode.pool`, :mod:`p2pkv.decode.background`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from p2pkv.decode.background import Background
from p2pkv.decode.pool import FairPool, PoolFull
from tests.polling import eventually


def _blocker(release: threading.Event, running: list[str], name: str):  # type: ignore[no-untyped-def]
    def fn() -> str:
        running.append(name)
        release.wait(10)
        return name

    return fn


def _threads(pool: FairPool) -> int:
    """Threads alive in ``pool``."""
    with pool._cv:
        return len(pool._threads)


def _keys(pool: FairPool) -> set[str]:
    """Keys of ``pool`` with calls waiting or running (a key with none is forgotten)."""
    with pool._cv:
        return set(pool._keys)


def test_one_slow_key_holds_at_most_per_key_threads_and_never_delays_another_key() -> None:
    pool = FairPool("p2pkv-test-pool", max_threads=4, per_key=2)
    release, running = threading.Event(), []
    try:
        slow = [pool.submit("unreachable", f"slow-{i}", _blocker(release, running, f"slow-{i}")) for i in range(50)]
        assert eventually(lambda: len(running) == 2), running  # a loaded machine starts threads late
        time.sleep(0.1)  # room for a third to start, which must not
        assert running == ["slow-0", "slow-1"] and _threads(pool) == 2
        # The slow calls block for 10 s: an answer within 2 s did not wait behind them.
        assert pool.submit("good", "good", lambda: "answer").result(timeout=2) == "answer"
        assert _threads(pool) <= 4
        release.set()
        assert [f.result(timeout=10) for f in slow] == [f"slow-{i}" for i in range(50)]
        # A call's future is set before its thread forgets the key: the last key goes a moment later.
        assert eventually(lambda: _keys(pool) == set()), _keys(pool)
        assert _threads(pool) <= 4
    finally:
        release.set()
        pool.close()


def test_keys_take_turns_for_a_full_pool() -> None:
    pool = FairPool("p2pkv-test-turns", max_threads=1, per_key=1)
    gate, order = threading.Event(), []
    try:
        first = pool.submit("a", "a0", lambda: gate.wait(5))
        futures = [pool.submit(k, f"{k}{i}", lambda k=k, i=i: order.append(f"{k}{i}")) for k in "ab" for i in
                   range(1, 3)]
        gate.set()
        first.result(timeout=5)
        for f in futures:
            f.result(timeout=5)
        assert order == ["b1", "a1", "b2", "a2"]  # a had the thread: b's turn first, then they alternate
    finally:
        pool.close()


def test_a_full_queue_refuses_and_close_cancels_the_rest_quickly() -> None:
    pool = FairPool("p2pkv-test-bound", max_threads=2, per_key=1, max_queued=3)
    stop = threading.Event()
    try:
        futures = [pool.submit("k", "c0", lambda: stop.wait(30))]
        assert eventually(lambda: futures[0].running())
        futures += [pool.submit("k", f"c{i}", lambda: stop.wait(30)) for i in range(1, 5)]
        assert isinstance(futures[4].exception(timeout=1), PoolFull)
        t0 = time.monotonic()
        pool.close(timeout_s=0.0)  # cancels what waits
        stop.set()  # what runs ends by its cancel event
        pool.close(timeout_s=2.0)
        assert time.monotonic() - t0 < 2.5
        assert futures[0].result(timeout=1) is True
        assert all(f.cancelled() for f in futures[1:4])
        with pytest.raises(CancelledError):
            futures[1].result()
        assert isinstance(pool.submit("k", "late", lambda: 1).exception(timeout=1), PoolFull)
        assert not [t for t in threading.enumerate() if t.name.startswith("p2pkv-test-bound")]
    finally:
        stop.set()
        pool.close()


def test_background_calls_get_cancel_lanes_run_in_order_and_close_ends_them() -> None:
    woken = []
    bg = Background(on_done=lambda: woken.append(1), call_threads=2, per_key=1, lane_threads=1)
    seen: list[int] = []

    def waits(cancel: threading.Event) -> str:
        cancel.wait(30)
        return "cancelled"

    def lane_call(i: int, cancel: threading.Event) -> int:
        seen.append(i)
        return i

    hung = [bg.call(f"p2pkv-handshake-{i}", waits, key="127.0.0.2") for i in range(3)]
    lane = [bg.call("p2pkv-fence-x", lane_call, i, lane="x:1") for i in range(20)]
    assert [f.result(timeout=5) for f in lane] == list(range(20)) == seen
    assert _threads(bg._calls) + _threads(bg._lanes) <= 3 and _keys(bg._lanes) == set()
    time.sleep(0.1)
    names = {t.name for t in threading.enumerate()}
    assert "p2pkv-handshake-0" in names and "p2pkv-handshake-1" not in names  # per_key=1: one at a time
    t0 = time.monotonic()
    bg.close()
    assert time.monotonic() - t0 < 2.0
    assert hung[0].result(timeout=1) == "cancelled" and hung[1].cancelled() and hung[2].cancelled()
    assert len(woken) >= 21


def test_close_lets_flushed_calls_end_first_and_cancels_those_that_do_not() -> None:
    """A release queued just before the worker closes (``flush=True``) still runs, uncancelled, and so frees its
    prefill hold at once; one that would not end is cancelled once ``flush_s`` has passed, as every other call."""
    bg = Background(call_threads=2, per_key=1)
    seen: list[bool] = []

    def release(cancel: threading.Event) -> str:
        time.sleep(0.05)  # a side-channel round trip
        seen.append(cancel.is_set())
        return "freed"

    def stuck(cancel: threading.Event) -> str:
        cancel.wait(30)
        return "cancelled"

    freed = bg.call("p2pkv-release-a", release, key="a", flush=True)
    hung = bg.call("p2pkv-release-b", stuck, key="b", flush=True)
    other = [bg.call(f"p2pkv-handshake-{i}", stuck, key="c") for i in range(2)]
    bg.close(flush_s=0.5)
    assert freed.result(timeout=1) == "freed" and seen == [False]
    assert hung.result(timeout=1) == "cancelled"
    assert other[0].result(timeout=1) == "cancelled" and other[1].cancelled()
