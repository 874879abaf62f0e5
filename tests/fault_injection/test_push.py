"""Push mode, the prefill rank's WRITE stalls, comes late or never: a push given up drains until its WRITE
ended, notes the decode worker cannot read, a side channel that takes no push, a decode worker closed with a
push queued, a push handled late, the prefill process killed after accepting a push or restarted. Beside
exact bytes and load errors, each checks that the decode worker hands blocks back only after the WRITE into
them ended (the prefill process reports the times on the host's one monotonic clock) and that no hold stays
pinned.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.fault_injection.support import (
    BOUND_S,
    PUSH_CFG,
    assert_bytes,
    clean_pull_succeeds,
    failure_lines,
    new_ids,
    pull,
    pushes_since,
    released_once_not_expired,
    settled,
    wait_pinned,
)
from tests.faults import inject, restore
from tests.p2p_harness import ENGINE, LAYOUT, DecodeSide, PrefillProc, free_port, pull_task, shape
from tests.workers import make_worker, model_info


@pytest.mark.parametrize("stage", ["queued", "in_flight"])
def test_a_push_given_up_drains_until_its_write_ended(prefill: PrefillProc, caplog: pytest.LogCaptureFixture,
                                                     stage: str) -> None:
    """The decode worker gives up on a push (``transfer_timeout_s``) while the prefill rank still has the WRITE
    queued (its pusher held back) or in flight (a post NIXL never got, polled "in flight"). The prefill rank
    drops or cancels it once the decode rank's window has passed and says so; only then, and promptly (not at
    its drain deadline, a second later), may the pull's blocks go back to vLLM: load errors, untouched. The
    decode worker's release, which came meanwhile, frees the hold once the WRITE ended, exactly once.

    In flight, the prefill rank's cancel and the decode rank's deadline fall due together (both count
    ``transfer_timeout_s``): a "push_failed" note read first makes the decode worker retry once, and the retry
    ends the same way."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, **{**PUSH_CFG, "handshake_timeout_s": 2.0, "transfer_timeout_s": 0.5})
    try:
        clean_pull_succeeds(d, prefill)  # the peer is known: the push request leaves at once
        before = settled(prefill)
        if stage == "queued":
            prefill.call("stall_pusher", 1.2)
        else:
            prefill.inject(("transfer", 1, "proc", None), ("check_xfer_state", 1, "proc", None))
        local, remote = [30, 31], [32, 33]
        rid, prid, errors, _ = pull(d, prefill, local, remote)
        assert errors == set(local)
        (line,) = failure_lines(caplog, rid)
        assert "kind=timeout" in line or (stage == "in_flight" and "kind=transfer" in line), line
        ended = prefill.unpinned(prid)  # the last WRITE from the hold ended (dropped or cancelled)
        assert d.finished_at[rid] >= ended, "the blocks went back to vLLM before the WRITE into them ended"
        assert d.finished_at[rid] - ended < 0.5, "waited for the drain deadline: the push_failed note was not used"
        assert torch.count_nonzero(d.base[local]) == 0
        if stage == "in_flight":
            assert prefill.restore()["faults"] >= 2
        accepted, failed, written = pushes_since(before, settled(prefill))
        assert written == 0 and accepted == failed and accepted in ((1, 2) if stage == "in_flight" else (1,))
        released_once_not_expired(prefill, prid, d)
        assert prefill.released_at[prid][0] >= ended, "the hold ended while a WRITE from it was queued or in flight"
        prefill.call("stall_pusher", 0.0)
        clean_pull_succeeds(d, prefill)
    finally:
        prefill.call("stall_pusher", 0.0)
        prefill.restore()
        d.close()


def test_push_notes_the_decode_worker_cannot_read(prefill: PrefillProc, caplog: pytest.LogCaptureFixture) -> None:
    """``get_new_notifs`` fails once: the next call reads the note, the pull succeeds. It always fails: no
    notification says the WRITE ended, so the pull fails ``timeout`` and its blocks go back only once the prefill
    rank answers that the hold has ended there (a pinned hold ends only after its WRITE), past the push's
    window; the hold is freed once."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, **{**PUSH_CFG, "transfer_timeout_s": 0.5})
    try:
        clean_pull_succeeds(d, prefill)
        inject(d.worker, "get_new_notifs", 1)
        local, remote = [5, 6], [6, 7]
        _, prid, errors, _ = pull(d, prefill, local, remote)
        assert errors == set()
        assert_bytes(d, prefill, local, remote)
        released_once_not_expired(prefill, prid, d)
        inject(d.worker, "get_new_notifs", 1, times=None)
        local, remote = [8, 9], [10, 11]
        rid, prid, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local)
        (line,) = failure_lines(caplog, rid)
        assert "kind=timeout" in line, line
        assert seconds >= 0.5 + 1.0, "blocks handed back before the push's window and a reply timeout passed"
        released_once_not_expired(prefill, prid, d)
        settled(prefill)
        restore(d.worker)
        clean_pull_succeeds(d, prefill)
    finally:
        d.close()


def test_a_side_channel_that_takes_no_push_fails_the_pull_at_once(prefill: PrefillProc,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The prefill rank's side channel takes no push requests (an older p2pkv): refused at once, naming
    ``transfer_mode pull``; the pull fails ``refused`` with exactly its blocks as load errors, and since nothing
    was queued there, its blocks go back at once, not after the push's window."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, **{**PUSH_CFG, "transfer_timeout_s": 1.5})
    try:
        clean_pull_succeeds(d, prefill)
        prefill.call("take_pushes", False)
        local, remote = [36, 37], [38, 39]
        rid, prid, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local)
        (line,) = failure_lines(caplog, rid)
        assert "kind=refused" in line and "transfer_mode pull" in line, line
        released_once_not_expired(prefill, prid, d)
        assert seconds < 1.0, f"reported after {seconds:.2f} s: waited out a push that was never queued"
    finally:
        prefill.call("take_pushes", True)
        d.close()


def test_decode_closed_with_a_push_queued_frees_the_hold_once(prefill: PrefillProc) -> None:
    """Peer death, decode side: the decode worker goes away while its push waits in the prefill rank's queue
    and the hold's lease runs out meanwhile. The WRITE is dropped once the decode rank's window passed, and
    only then does the expiry free the hold: exactly once, nothing left pinned or deferred."""
    d = DecodeSide(64, **{**PUSH_CFG, "transfer_timeout_s": 0.5})
    try:
        clean_pull_succeeds(d, prefill)
        before = settled(prefill)
        prefill.call("stall_pusher", 1.2)
        rid, prid = new_ids()
        prefill.lease([prid], seconds=0.6)
        d.start(pull_task(rid, prid, prefill.port, [12, 13], [14, 15]))
        wait_pinned(d, prefill, prid)
    finally:
        d.close()
    ended = prefill.unpinned(prid)
    assert prefill.wait_released({prid}, BOUND_S)
    prefill.drain(0.05)
    assert prefill.expired.get(prid) == 1 and prefill.times_released(prid) == 1
    assert prefill.released_at[prid][0] >= ended, "the lease freed the hold while a WRITE from it was queued"
    assert pushes_since(before, settled(prefill)) == (1, 1, 0)
    assert prefill.state()["deferred"] == []


def test_a_push_handled_late_never_writes_blocks_handed_back(prefill: PrefillProc) -> None:
    """The prefill rank's side channel is busy (each push request handled 2 s after it arrives); the decode
    worker's reply timeout is 0.3 s and its window 0.5 s, so it gives the pull up (load errors) and hands the
    blocks back. vLLM reuses them (here: a marker value); no WRITE may land in them afterwards."""
    d = DecodeSide(64, **{**PUSH_CFG, "handshake_timeout_s": 0.3, "transfer_timeout_s": 0.5})
    try:
        clean_pull_succeeds(d, prefill)
        before = settled(prefill)
        prefill.call("delay_push", 2.0)
        local, remote = [44, 45], [46, 47]
        rid, prid = new_ids()
        prefill.lease([prid], seconds=3.0)
        d.start(pull_task(rid, prid, prefill.port, local, remote))
        assert d.pump({rid}, BOUND_S) == set()
        assert d.take_errors() == set(local)
        d.base[local] = -7.0  # the blocks are vLLM's again: another request's KV

        def handled() -> int:  # push requests the prefill rank's side channel has answered (either way)
            now = prefill.state()["counters"]
            return sum(now[k] - before[k] for k in ("accepted", "refused"))

        end = time.monotonic() + BOUND_S
        while handled() < 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert handled() >= 1, "the late push request was never handled"
        prefill.call("delay_push", 0.0)
        quiet_since, seen = time.monotonic(), handled()  # one sent again meanwhile is handled 2 s after arrival
        while time.monotonic() - quiet_since < 2.5 and time.monotonic() < end:
            time.sleep(0.05)
            if (now := handled()) != seen:
                quiet_since, seen = time.monotonic(), now
        settled(prefill)
        assert prefill.wait_released({prid}, BOUND_S)
        prefill.drain(0.05)
        assert prefill.times_released(prid) == 1
        assert bool((d.base[local] == -7.0).all()), "a WRITE landed in blocks the decode worker had handed back"
    finally:
        prefill.call("delay_push", 0.0)
        d.close()


def test_prefill_killed_after_accepting_a_push(victim: PrefillProc, caplog: pytest.LogCaptureFixture) -> None:
    """Peer death, prefill side: the prefill process accepts a push (the hold pinned), then is SIGKILLed before
    its WRITE. Nothing tells the decode worker (no READ of its own to fail): the pull fails ``timeout`` after
    ``transfer_timeout_s``, exactly its blocks as load errors, untouched; they go back to vLLM then, not a
    minute later, since NIXL says the prefill agent disconnected (its process is gone: no WRITE it accepted can
    land any more). The dead process released nothing twice and
    the hold ended with it, unreleased. (A new incarnation taking over the leases is the churn's, in pull
    mode; in push mode see ``test_a_restarted_prefill_is_used_again_in_push_mode``.)"""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, **{**PUSH_CFG, "transfer_timeout_s": 1.0})
    try:
        clean_pull_succeeds(d, victim)
        victim.call("stall_pusher", 1e6)
        rid, prid = new_ids()
        victim.lease([prid])
        local, remote = [33, 34, 35], [1, 2, 3]
        t0 = time.monotonic()
        d.start(pull_task(rid, prid, victim.port, local, remote))
        wait_pinned(d, victim, prid)
        victim.kill()
        assert d.pump({rid}, BOUND_S) == set(), "the pull from a dead prefill process hung"
        seconds = time.monotonic() - t0
        assert d.take_errors() == set(local)
        assert 1.0 <= seconds < BOUND_S, f"blocks handed back after {seconds:.2f} s, within the push's window"
        (line,) = failure_lines(caplog, rid)
        assert any(f"kind={k}" in line for k in ("timeout", "transfer", "disconnect")), line
        assert torch.count_nonzero(d.base[local]) == 0
        assert d.worker.receiver.transfers == []
    finally:
        d.close()
    assert victim.times_released(prid) == 0 and not victim.alive()
    assert all(victim.times_released(r) <= 1 for r in victim.leased)


def test_a_restarted_prefill_is_used_again_in_push_mode(caplog: pytest.LogCaptureFixture) -> None:
    """The push analogue of ``test_transfer.py::test_restarted_prefill_is_used_again_without_restarting_decode``:
    prefill rank A serves a pull, then goes away; B (same engine id and port, new NIXL agent, another KV cache)
    takes its place. The next pull from the same decode worker moves B's bytes and B frees the hold by its
    "done". (Both ranks in this process: B's cache is allocated while A's still exists, so its addresses differ,
    as after a real restart.)"""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    port = free_port()

    def rank(seed: int) -> tuple[WorkerSide, object]:
        base, views = make_kv_caches(LAYOUT, seed=seed, **shape(64))
        worker = make_worker(ENGINE, port)
        worker.model = model_info(LAYOUT)
        worker.register_kv_caches(views, 64)
        return worker, base

    def run(d: DecodeSide, pre: WorkerSide, rid: str, prid: str, local: list[int], remote: list[int]) -> set[str]:
        pre.start_load_kv(P2pKvMetadata(send_leases={prid: time.monotonic() + 30}))
        d.start(pull_task(rid, prid, port, local, remote))
        freed: set[str] = set()
        end = time.monotonic() + BOUND_S
        while time.monotonic() < end and not (rid in d.finished and (prid in freed or d.errors)):
            d.step()
            freed |= pre.get_finished()[0]
            time.sleep(0.002)
        return freed

    a, a_base = rank(seed=11)
    d = DecodeSide(64, **{**PUSH_CFG, "transfer_timeout_s": 2.0})
    b = None
    try:
        assert run(d, a, "d-a", "p-a", [1, 2], [3, 4]) == {"p-a"}
        assert d.take_errors() == set() and d.block_ok(1, 3, a_base) and d.block_ok(2, 4, a_base)
        a.shutdown()
        b, b_base = rank(seed=12)
        freed = run(d, b, "d-b", "p-b", [5, 6], [7, 8])
        assert "d-b" in d.finished and failure_lines(caplog, "d-b") == []
        assert d.take_errors() == set()
        assert d.block_ok(5, 7, b_base) and d.block_ok(6, 8, b_base), "not the new incarnation's bytes"
        assert freed == {"p-b"}, "the new incarnation never got the pull's done"
    finally:
        d.close()
        a.shutdown()
        if b is not None:
            b.shutdown()
