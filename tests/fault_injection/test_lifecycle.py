"""Prefill-side leases (a tiny lease releases exactly once), shutdown (idempotent, no thread left, also during
a handshake) and the fault wrapper itself."""

from __future__ import annotations

import threading
import time

import pytest

from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.conftest import MODES
from tests.fault_injection.support import fake_side_channel, pull
from tests.faults import FaultyNixlAgent
from tests.p2p_harness import DECODE_CFG, LAYOUT, DecodeSide, PrefillProc, free_port, notify_task, pull_task, shape
from tests.workers import make_worker, model_info


# ---- prefill-side leases ---------------------------------------------------------------------
def test_tiny_lease_releases_exactly_once() -> None:
    """Prefill ``WorkerSide`` here with ``lease_s=0.3``: an un-notified lease is released once at
    expiry; a late notification does not release it again; a notification releases a lease once,
    before and instead of its expiry; one arriving before its lease releases it when the lease comes."""
    lease_s = 0.3
    port = free_port()
    _, views = make_kv_caches(LAYOUT, seed=3, **shape(16))
    pre: WorkerSide = make_worker("lease-engine", port, lease_s=lease_s)
    pre.model = model_info(LAYOUT)
    pre.register_kv_caches(views, 16)
    d = DecodeSide(16, **DECODE_CFG)
    releases: list[tuple[str, float]] = []

    def step(seconds: float, until: str | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and any(r == until for r, _ in releases)):
            sending, _ = pre.get_finished()
            releases.extend((r, time.monotonic()) for r in sending)
            d.step()
            time.sleep(0.003)

    def lease(rid: str, seconds: float | None = None) -> float:
        now = time.monotonic()
        pre.start_load_kv(P2pKvMetadata(send_leases={rid: now + (seconds or pre.config.lease_s)}))
        return now

    def notify(rid: str) -> None:
        d.start(notify_task(f"d-{rid}", rid, port, engine="lease-engine"))

    def times(rid: str) -> list[float]:
        return [t for r, t in releases if r == rid]

    try:
        t_quiet = lease("quiet")  # config lease_s, no notification
        step(5.0, until="quiet")
        step(0.5)
        assert [r for r, _ in releases] == ["quiet"]
        assert releases[0][1] - t_quiet >= lease_s
        notify("quiet")  # late: after the expiry
        step(1.0)
        assert times("quiet") == [releases[0][1]]

        long_s = 30.0  # only a notification can release these within the test
        t_told = lease("told", long_s)
        notify("told")
        step(5.0, until="told")
        step(0.5)
        assert len(times("told")) == 1 and times("told")[0] - t_told < 5.5, "not releases by its notification"

        notify("early")  # before its lease exists: kept for lease_s
        end = time.monotonic() + 5
        while "early" not in pre.holds.notifs and time.monotonic() < end:
            step(0.005)
        t_early = lease("early", long_s)
        step(1.0)
        assert len(times("early")) == 1 and times("early")[0] - t_early < 1.0, "early notification not applied"
        assert len(pre.holds.leases) == 0 and d.take_errors() == set()
    finally:
        d.close()
        pre.shutdown()


# ---- shutdown ---------------------------------------------------------------------------------
def _new_threads(before: set[threading.Thread], wait_s: float = 2.0) -> list[threading.Thread]:
    end = time.monotonic() + wait_s
    while True:
        bad = [t for t in threading.enumerate() if t not in before and t.is_alive()
               and (t.name.startswith("p2pkv") or not t.daemon)]
        if not bad or time.monotonic() > end:
            return bad
        time.sleep(0.05)


def test_a_notify_only_pull_on_an_idle_decode_engine_frees_the_hold_without_another_step(
        prefill: PrefillProc) -> None:
    """A request aborted before its blocks were allocated (its client left) leaves a notify-only pull; vLLM then
    has nothing to run and takes no step. The pull's "done" goes out from the pulls' thread once the handshake
    ends, not at the next request's step (seen: 25 s later, up to the lease)."""
    d = DecodeSide(64, **{**DECODE_CFG, "pull_thread": True})  # the pulls' thread, as by default
    try:
        prefill.lease(["p-idle"], 60.0)
        d.start(notify_task("d-idle", "p-idle", prefill.port))  # then no step at all
        assert prefill.wait_released({"p-idle"}, 10.0), "the hold waited for the decode engine's next step"
        assert "p-idle" in prefill.notified, "freed by its lease, not by the decode rank's word"
    finally:
        d.close()


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_is_idempotent_and_leaves_no_threads(prefill: PrefillProc, mode: str) -> None:
    before = set(threading.enumerate())
    d = DecodeSide(64, transfer_mode=mode, **DECODE_CFG)
    _, _, errors, _ = pull(d, prefill, [1, 2], [3, 4])
    assert errors == set()
    assert any(t.name.startswith("p2pkv") for t in threading.enumerate())
    d.close()
    d.close()
    d.worker.shutdown()
    assert _new_threads(before) == []


def test_shutdown_during_a_handshake_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    d = DecodeSide(64, handshake_timeout_s=3.0, handshake_attempts=1)
    try:
        with fake_side_channel(None) as (port, seen):
            d.start(pull_task("d-hs", "p-hs", port, [1], [1], engine="fake-silent"))
            end = time.monotonic() + 5
            while not seen and time.monotonic() < end:
                time.sleep(0.01)
            assert seen
            d.close()
            d.close()
            left = _new_threads(before)
    finally:
        for t in threading.enumerate():  # let the handshake finish so later tests start clean
            if t not in before and t.name.startswith("p2pkv-handshake"):
                t.join(10)
    assert left == [], f"alive after shutdown: {[t.name for t in left]}"


def test_fault_wrapper_proxies_and_validates() -> None:
    class Real:
        plugin_list = ("UCX",)

        def transfer(self, handle: object) -> str:
            return "PROC"

    f = FaultyNixlAgent(Real(), "transfer", 2, mode="err", times=2)
    assert f.plugin_list == ("UCX",)
    assert [f.transfer(None) for _ in range(5)] == ["PROC", "ERR", "ERR", "PROC", "PROC"]
    assert f.calls["transfer"] == 5 and f.faults == 2
    with pytest.raises(ValueError):
        FaultyNixlAgent(Real(), "send_notif", 1, mode="err")
    with pytest.raises(ValueError):
        FaultyNixlAgent(Real(), "no_such_method", 1)
