"""Faults on the NIXL calls of a pull, once or on every call: the decode rank's READ (:func:`tests.faults.inject`
on its agent) and, in push mode, the prefill rank's WRITE (:meth:`tests.p2p_harness.PrefillProc.inject`).

Documented (``p2pkv/worker.py``, ``docs/reliability.md``): a pull that fails to start (``get_xfer_descs``,
``initialize_xfer``, ``transfer``) or while in flight (``check_xfer_state``) drops the peer, re-handshakes and is
retried once: one fault costs nothing, a fault on every call ends as load errors; a handshake failure
(``add_remote_agent``) is final; ``release_xfer_handle`` failures are logged and ignored. Every failed pull is
still reported in ``finished_recving``, with exactly its local blocks as load errors, and after each fault a
clean pull of another request moves exact bytes.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tests.fault_injection.support import (
    BOUND_S,
    assert_bytes,
    clean_pull_succeeds,
    counting_handshakes,
    failure_lines,
    new_ids,
    pull,
    pushes_since,
    released,
    released_once_not_expired,
    settled,
)
from tests.faults import FaultyNixlAgent, inject, restore
from tests.p2p_harness import DecodeSide, PrefillProc, pull_task

# ---- one table: a fault on the first call, or on every call -----------------------------------------------
# (transfer mode, NIXL method, how it fails) → (outcome of one fault on its first call, of a fault on every call).
# pull: the decode rank's READ fails (its agent); push: the prefill rank's WRITE fails (its agent).
# First call: "retried" = pull: re-handshake and retry, which succeeds; push: a "push_failed" note and the push
# alone retried (the peer kept), whose WRITE lands. "moved" = push: the WRITE was posted before its poll failed:
# its own note or the failure's comes first, exact bytes either way. "ignored" = nothing to retry. "failed" =
# load errors at once (a failed handshake is final). "rehandshaken" = push: the prefill rank's NIXL refused the
# decode agent: a new handshake, the push retried.
# Every call: "load errors" (pull: two attempts, one for a failed handshake); push: the failure kind logged,
# "transfer" (two pushes, both failed) or "refused" (two handshakes, no push accepted); None: not run here
# (release_xfer_handle has its own tests below).
FAULTS: dict[tuple[str, str, str], tuple[str, str | None]] = {
    ("pull", "get_xfer_descs", "raise"): ("retried", "load errors"),
    ("pull", "initialize_xfer", "raise"): ("retried", "load errors"),
    ("pull", "transfer", "raise"): ("retried", "load errors"),
    ("pull", "transfer", "err"): ("retried", "load errors"),
    ("pull", "check_xfer_state", "raise"): ("retried", "load errors"),
    ("pull", "check_xfer_state", "err"): ("retried", "load errors"),
    ("pull", "release_xfer_handle", "raise"): ("ignored", None),
    ("pull", "add_remote_agent", "raise"): ("failed", "load errors"),
    ("push", "get_xfer_descs", "raise"): ("retried", "transfer"),
    ("push", "initialize_xfer", "raise"): ("retried", None),
    ("push", "transfer", "raise"): ("retried", "transfer"),
    ("push", "transfer", "err"): ("retried", "transfer"),
    ("push", "check_xfer_state", "raise"): ("moved", None),
    ("push", "check_xfer_state", "err"): ("moved", None),
    ("push", "release_xfer_handle", "raise"): ("ignored", None),
    ("push", "add_remote_agent", "raise"): ("rehandshaken", "refused"),
}
FIRST_CALL = [(*key, first) for key, (first, _) in FAULTS.items()]
EVERY_CALL = [(*key, every) for key, (_, every) in FAULTS.items() if every is not None]


def fault_id(case: tuple[str, ...]) -> str:
    return "-".join(case[:3])


def decode_in(request: pytest.FixtureRequest, transfer_mode: str) -> DecodeSide:
    """The test's decode worker in ``transfer_mode`` (the ``decode`` or the ``push_decode`` fixture)."""
    return request.getfixturevalue("decode" if transfer_mode == "pull" else "push_decode")


@pytest.mark.parametrize(("transfer_mode", "method", "mode", "outcome"), FIRST_CALL, ids=map(fault_id, FIRST_CALL))
def test_first_call_fault(prefill: PrefillProc, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture,
                          transfer_mode: str, method: str, mode: str, outcome: str) -> None:
    """One fault costs nothing but a retry (push: of the push alone after a failed WRITE, the peer kept; after a
    new handshake when the prefill rank refused the decode agent, it may have restarted), except a failed
    handshake of a pull: its blocks as load errors at once. Every hold ends once, nothing stays pinned, and a
    clean pull follows."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = decode_in(request, transfer_mode)
    local, remote = [3, 4, 5, 20], [10, 11, 12, 7]
    if transfer_mode == "pull":
        faulty = inject(d.worker, method, 1, mode)  # type: ignore[arg-type]
        _, prid, errors, seconds = pull(d, prefill, local, remote)
        assert faulty.faults == 1
        assert seconds < BOUND_S
        if outcome == "failed":
            assert errors == set(local)
            assert faulty.calls["add_remote_agent"] == 1  # a failed handshake is final: no retry
        else:
            assert errors == set()
            assert_bytes(d, prefill, local, remote)
            # "retried": the peer was dropped and handshaken again, once.
            assert faulty.calls["add_remote_agent"] == (2 if outcome == "retried" else 1)
            assert prefill.wait_released({prid}, BOUND_S)
    else:
        handshakes = counting_handshakes(d)
        before = settled(prefill)
        prefill.inject((method, 1, mode, 1))
        rid, prid, errors, seconds = pull(d, prefill, local, remote)
        assert prefill.restore()["faults"] == 1
        assert seconds < BOUND_S
        accepted, failed, written = pushes_since(before, settled(prefill))
        assert errors == set() and failure_lines(caplog, rid) == []
        assert_bytes(d, prefill, local, remote)
        expected = {"rehandshaken": (2, 1, 0, 1), "retried": (1, 2, 1, 1), "ignored": (1, 1, 0, 1)}  # handshakes,
        if outcome in expected:  # accepted, failed, written ("moved": either note may come first)
            assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == expected[outcome]
        released_once_not_expired(prefill, prid, d)
    clean_pull_succeeds(d, prefill)


@pytest.mark.parametrize(("transfer_mode", "method", "mode", "outcome"), EVERY_CALL, ids=map(fault_id, EVERY_CALL))
def test_persistent_fault_ends_as_load_error(prefill: PrefillProc, request: pytest.FixtureRequest,
                                             caplog: pytest.LogCaptureFixture, transfer_mode: str, method: str,
                                             mode: str, outcome: str) -> None:
    """The call fails every time: exactly the pull's blocks as load errors after two attempts (the retry; one
    for a failed handshake of a pull; push: the push retried, or a new handshake when the decode agent is
    refused, with the failure kind named), nothing left behind (no pull, no byte written, the hold freed once,
    nothing pinned); then a clean pull works."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = decode_in(request, transfer_mode)
    local, remote = [7, 8, 30], [7, 9, 33]
    if transfer_mode == "pull":
        faulty = inject(d.worker, method, 1, mode, times=None)  # type: ignore[arg-type]
        _, _, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local)
        assert seconds < BOUND_S
        # Two attempts (the retry after a re-handshake), except a failed handshake: one.
        assert faulty.calls["add_remote_agent"] == (1 if method == "add_remote_agent" else 2)
        assert d.worker.receiver.transfers == []  # nothing left behind for a later request
        restore(d.worker)
    else:
        handshakes = counting_handshakes(d)
        before = settled(prefill)
        prefill.inject((method, 1, mode, None))
        rid, prid, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local) and seconds < BOUND_S
        (line,) = failure_lines(caplog, rid)
        assert f"kind={outcome}" in line, line
        accepted, failed, written = pushes_since(before, settled(prefill))
        expected = (2, 0, 0, 0) if outcome == "refused" else (1, 2, 2, 0)  # handshakes, accepted, failed, written
        assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == expected
        assert d.worker.receiver.transfers == [] and torch.count_nonzero(d.base[local]) == 0
        released_once_not_expired(prefill, prid, d)
        assert prefill.restore()["faults"] >= 1
    clean_pull_succeeds(d, prefill)


def test_persistent_release_fault_never_fails_a_pull(prefill: PrefillProc, decode: DecodeSide) -> None:
    faulty = inject(decode.worker, "release_xfer_handle", 1, times=None)
    for _ in range(3):
        local, remote = [1, 2], [2, 3]
        _, _, errors, _ = pull(decode, prefill, local, remote)
        assert errors == set()
        assert_bytes(decode, prefill, local, remote)
    assert faulty.faults == 3
    assert faulty.calls["add_remote_agent"] == 1


def pull_batch_whole_or_failed(d: DecodeSide, pf: PrefillProc, lease_s: float | None = None) -> set[str]:
    """Eight pulls of 2 blocks in one batch (leased for ``lease_s``, default the process's): each finishes
    exactly once, with exact bytes or all its blocks in load errors, and no other block is reported. The
    prefill request ids."""
    tasks, pairs = [], {}
    for i in range(8):
        rid, prid = new_ids()
        local, remote = [2 * i, 2 * i + 1], [63 - i, 40 + i]
        tasks.append(pull_task(rid, prid, pf.port, local, remote))
        pairs[rid] = (prid, local, remote)
    pf.lease([p for p, _, _ in pairs.values()], seconds=lease_s)
    d.start(*tasks)
    assert d.pump(set(pairs), BOUND_S) == set()
    d.pump(set(), 0.05)
    assert all(d.finished[r] == 1 for r in pairs)
    errors = d.take_errors()
    for _, local, remote in pairs.values():
        if set(local) <= errors:
            errors -= set(local)
        else:
            assert not set(local) & errors, "a pull's blocks were partly reported"
            assert_bytes(d, pf, local, remote)
    assert errors == set(), f"load errors for blocks of no pull: {sorted(errors)}"
    return {p for p, _, _ in pairs.values()}


@pytest.mark.parametrize(("method", "mode"), [("check_xfer_state", "raise"), ("check_xfer_state", "err"),
                                              ("transfer", "raise")])
def test_fault_in_one_pull_of_a_batch(prefill: PrefillProc, decode: DecodeSide, method: str, mode: str) -> None:
    """One pull's failure drops the peer under the others in flight (NIXL then fails their READs
    too): every pull still finishes exactly once, each with exact bytes or all its blocks in load
    errors, and no other block is reported. (Zero load errors is what the retry aims for; see
    ``test_stale_failure_keeps_the_new_peer`` for why some may still fail.)"""
    faulty = inject(decode.worker, method, 3, mode)  # type: ignore[arg-type]
    pull_batch_whole_or_failed(decode, prefill)
    assert faulty.faults == 1
    restore(decode.worker)
    clean_pull_succeeds(decode, prefill)


@pytest.mark.parametrize(("method", "mode"), [("transfer", "raise"), ("transfer", "err"),
                                              ("initialize_xfer", "raise")])
def test_start_fault_in_a_batch_waiting_for_its_handshake(prefill: PrefillProc, decode: DecodeSide,
                                                          method: str, mode: str) -> None:
    """Pulls queued behind the first handshake start one after the other when it completes; the
    first one's start failure drops the peer. Regression: the next pull then looked the dropped peer
    up (``KeyError`` out of ``get_finished``, the rest of the batch lost). Now they wait for the
    re-handshake and all succeed."""
    faulty = inject(decode.worker, method, 1, mode)  # type: ignore[arg-type]
    tasks, pairs = [], {}
    for i in range(3):
        rid, prid = new_ids()
        local, remote = [10 + i], [20 + i]
        tasks.append(pull_task(rid, prid, prefill.port, local, remote))
        pairs[rid] = (prid, local, remote)
    prefill.lease([p for p, _, _ in pairs.values()])
    decode.start(*tasks)
    assert decode.pump(set(pairs), BOUND_S) == set()
    assert faulty.faults == 1 and faulty.calls["add_remote_agent"] == 2
    assert decode.take_errors() == set()
    for _, local, remote in pairs.values():
        assert_bytes(decode, prefill, local, remote)


def test_stale_failure_keeps_the_new_peer(prefill: PrefillProc, decode: DecodeSide) -> None:
    """Pulls A and B in flight; B's READ fails: the peer is dropped (its NIXL connection removed) and
    B is retried on a fresh handshake. A's failure (its READ died with the old connection) surfaces
    only after that; it must retry A, not tear down the connection B's retry runs on. Expected: the
    remote agent is removed once, and both pulls succeed."""
    w = decode.worker
    assert w.agent is not None
    a_slow = FaultyNixlAgent(w.agent._agent, "check_xfer_state", 1, mode="proc")  # poll 1 (A): in flight
    b_fails = FaultyNixlAgent(a_slow, "check_xfer_state", 2, mode="err")  # poll 2 (B): failed
    w.agent._agent = outer = FaultyNixlAgent(b_fails, "check_xfer_state", 3)  # poll 3 (A, stale): failed
    (a, pa), (b, pb) = new_ids(), new_ids()
    prefill.lease([pa, pb])
    decode.start(pull_task(a, pa, prefill.port, [1, 2], [3, 4]), pull_task(b, pb, prefill.port, [5, 6], [7, 8]))
    end = time.monotonic() + BOUND_S
    # B failed, re-handshake began
    while not (b_fails.faults and w.receiver.peers.handshakes) and time.monotonic() < end:
        decode.step()
    reads_in_flight = sum(r.in_flight for p in w.receiver.transfers for r in p.parts)
    assert a_slow.faults == 1 and outer.calls["check_xfer_state"] == 2 and reads_in_flight == 1
    (pending,) = w.receiver.peers.handshakes.values()
    assert pending.future is not None
    pending.future.result(timeout=BOUND_S)  # re-handshake done: B restarts, then A's poll fails
    assert decode.pump({a, b}, BOUND_S) == set()
    assert outer.faults == 1 and b_fails.faults == 1 and a_slow.faults == 1
    assert outer.calls["remove_remote_agent"] == 1, "the re-handshaken peer was dropped for a stale failure"
    assert decode.take_errors() == set()
    assert_bytes(decode, prefill, [1, 2, 5, 6], [3, 4, 7, 8])


def test_stuck_read_times_out_as_load_error(prefill: PrefillProc) -> None:
    """A READ that never reports done is given up after ``transfer_timeout_s``: load errors, no retry."""
    d = DecodeSide(64, handshake_timeout_s=2.0, handshake_attempts=1, transfer_timeout_s=0.5)
    try:
        faulty = inject(d.worker, "check_xfer_state", 1, "proc", times=None)
        local, remote = [30, 31], [32, 33]
        _, _, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local)
        assert 0.5 <= seconds < BOUND_S
        assert faulty.calls["add_remote_agent"] == 1 and d.worker.receiver.transfers == []
        restore(d.worker)
        clean_pull_succeeds(d, prefill)
    finally:
        d.close()


def test_cancelled_read_nixl_keeps_active_holds_its_blocks_until_it_ends(prefill: PrefillProc) -> None:
    """A stuck READ is given up after ``transfer_timeout_s``, but NIXL refuses to release it (still
    active: its bytes may still land). Its blocks go back to vLLM (load errors, finished) only after the
    READ ends or another ``transfer_timeout_s`` passed, never while it may still write them."""
    d = DecodeSide(64, handshake_timeout_s=2.0, handshake_attempts=1, transfer_timeout_s=0.5)
    try:
        assert d.worker.agent is not None
        stuck = FaultyNixlAgent(d.worker.agent._agent, "check_xfer_state", 1, mode="proc", times=None)
        d.worker.agent._agent = refusals = FaultyNixlAgent(stuck, "release_xfer_handle", 1, times=None)
        local, remote = [40, 41], [42, 43]
        _, _, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local) and refusals.faults >= 1
        assert 1.0 <= seconds < BOUND_S, f"blocks handed back after {seconds:.2f} s"
        d.worker.agent._agent = stuck.real
        clean_pull_succeeds(d, prefill)
    finally:
        d.close()


def test_push_persistent_release_fault_never_fails_a_pull(prefill: PrefillProc, push_decode: DecodeSide) -> None:
    """The prefill side's ``release_xfer_handle`` always fails: logged, every push still lands and is notified."""
    prefill.inject(("release_xfer_handle", 1, "raise", None))
    for _ in range(3):
        local, remote = [1, 2], [2, 3]
        _, prid, errors, _ = pull(push_decode, prefill, local, remote)
        assert errors == set()
        assert_bytes(push_decode, prefill, local, remote)
        released_once_not_expired(prefill, prid, push_decode)
    assert prefill.restore()["faults"] == 3
    settled(prefill)


def test_push_write_fault_in_one_pull_of_a_batch(prefill: PrefillProc, push_decode: DecodeSide) -> None:
    """The third of eight WRITEs fails: the prefill rank says so ("push_failed"), and that pull retries with
    the peer kept (the other pulls' pushes in flight on it, their "done"s queued for it: see
    ``test_a_sibling_write_failure_does_not_cost_a_finished_pull_its_done``). Every pull finishes once with
    exact bytes or all its blocks as load errors, no other block is reported, every hold ends once and nothing
    stays pinned."""
    d = push_decode
    prefill.inject(("transfer", 3, "err", 1))
    prids = pull_batch_whole_or_failed(d, prefill, lease_s=3.0)  # a lost "done" falls back on a short lease
    assert prefill.restore()["faults"] == 1
    settled(prefill)
    assert released(d, prefill, prids)
    prefill.drain(0.05)
    assert all(prefill.times_released(p) == 1 for p in prids)  # by its "done", or by its 3 s lease were one lost


def test_a_sibling_write_failure_does_not_cost_a_finished_pull_its_done(prefill: PrefillProc,
                                                                       push_decode: DecodeSide) -> None:
    """Pulls A and B from one prefill rank in one batch; A's WRITE fails to start (a "push_failed" note), B's
    lands. The decode worker takes both notes in one step (held back until both came): A is retried after a
    re-handshake, B is done. Both holds must end by their "done", promptly, not by their leases."""
    d = push_decode
    clean_pull_succeeds(d, prefill)  # the peer is known: both push requests leave at once
    pushes = d.worker.receiver.pushes
    arrivals, held = pushes.arrivals, []

    def both_at_once(now: float) -> list:
        held.extend(arrivals(now))
        if len(held) < 2:
            return []
        out = list(held)
        held.clear()
        return out

    pushes.arrivals = both_at_once  # type: ignore[method-assign]
    prefill.inject(("transfer", 1, "err", 1))
    (a, pa), (b, pb) = new_ids(), new_ids()
    prefill.lease([pa, pb])
    d.start(pull_task(a, pa, prefill.port, [1, 2], [3, 4]), pull_task(b, pb, prefill.port, [5, 6], [7, 8]))
    assert d.pump({b}, BOUND_S) == set()
    del pushes.arrivals
    assert prefill.restore()["faults"] == 1
    assert d.pump({a}, BOUND_S) == set() and d.take_errors() == set()
    assert_bytes(d, prefill, [1, 2, 5, 6], [3, 4, 7, 8])
    for prid in (pa, pb):
        released_once_not_expired(prefill, prid, d, timeout_s=2.0)  # a "done" takes milliseconds
