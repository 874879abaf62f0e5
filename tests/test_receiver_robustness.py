"""One hostile pull never stops the others: containment, deadlines, block-id bounds, canonical and bounded peers.

Whoever reaches the decode engine's HTTP API chooses every byte of
``kv_transfer_params``. A real prefill :class:`~p2pkv.worker.WorkerSide`
runs in its own process (:class:`tests.p2p_harness.PrefillProc`) and a real
decode ``WorkerSide`` here (NIXL over loopback); each test sends one bad
pull, checks that it fails alone (its blocks reported as load errors) and
that good pulls, in the same batch or after it, move exact bytes.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

import p2pkv.decode.keeper as keeper_module
import p2pkv.decode.movers as movers_module
import p2pkv.decode.notifier as notifier_module
import p2pkv.decode.peers as peers_module
from p2pkv.decode.peers import PeerId
from p2pkv.decode.transfer import TransferState
from p2pkv.metadata import LoadSpec
from p2pkv.params import RemotePrefill
from tests.fault_injection.support import (
    BOUND_S,
    assert_bytes,
    failure_lines,
    new_ids,
    pull,
    released_once_not_expired,
)
from tests.faults import inject, restore
from tests.p2p_harness import ENGINE, DecodeSide, PrefillProc, free_port, pull_task
from tests.polling import eventually

DECODE_CFG = dict(handshake_timeout_s=1.0, handshake_attempts=1, transfer_timeout_s=10.0)
"""This module's decode workers (the ``decode`` fixtures' too): the pulls' thread polls, as in an engine."""


def spec(rid: str, prid: str, port: int, local: list[int], remote: list[int], *, host: str = "127.0.0.1",
         remote_all: tuple[int, ...] | None = None, tp_size: int = 1, report: bool = True) -> LoadSpec:
    """A pull of ``remote`` into ``local``; ``remote_all``: the params' block ids if other than ``remote``."""
    rp = RemotePrefill(ENGINE, prid, host, port, tuple(remote) if remote_all is None else remote_all, tp_size)
    return LoadSpec(rid, tuple(local), tuple(remote), rp, report=report)


def good_pull(d: DecodeSide, pf: PrefillProc, local: list[int], remote: list[int]) -> None:
    """Lease, pull and check: reported once, no load errors, exact bytes, the hold released by notification."""
    _, prid, errors, _ = pull(d, pf, local, remote)
    assert errors == set()
    assert_bytes(d, pf, local, remote)
    released_once_not_expired(pf, prid, d)


# ---- 1. an exception while advancing one pull fails that pull alone --------------------------------
@pytest.mark.parametrize("fault", ["block_id_beyond_int64", "planning_bug"])
def test_a_pull_whose_planning_raises_after_its_handshake_fails_alone(
        prefill: PrefillProc, mode_decode: DecodeSide, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Two pulls queued on one handshake; planning the first raises (a block id numpy cannot hold, or any
    bug). Before: the exception escaped ``_finish_handshakes``, both pulls stayed in HANDSHAKE forever and
    their blocks leaked. Now the bad one fails alone and the good one moves exact bytes (pulled or pushed)."""
    decode = mode_decode
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    (bad, bad_p), (good, good_p) = new_ids(), new_ids()
    prefill.lease([bad_p, good_p])
    bad_remote = [2**64 if fault == "block_id_beyond_int64" else 7, 8]
    if fault == "planning_bug":
        real_plan = movers_module.plan_reads

        def plan_reads(pull, *args, **kwargs):  # type: ignore[no-untyped-def]
            if pull.request_id == bad:
                raise RuntimeError("planning bug")
            return real_plan(pull, *args, **kwargs)

        monkeypatch.setattr(movers_module, "plan_reads", plan_reads)
    decode.start(spec(bad, bad_p, prefill.port, [1, 2], bad_remote), spec(good, good_p, prefill.port, [3, 4], [9, 10]))
    assert decode.pump({bad, good}, BOUND_S) == set(), "pulls hung behind the handshake"
    assert decode.take_errors() == {1, 2}
    assert_bytes(decode, prefill, [3, 4], [9, 10])
    (line,) = failure_lines(caplog, bad)
    if fault == "block_id_beyond_int64":
        assert "kind=bad_block_ids" in line and str(2**64) in line and "outside [0, 64)" in line
    else:
        assert "kind=refused" in line and "RuntimeError('planning bug')" in line
    assert decode.worker.receiver.transfers == []
    good_pull(decode, prefill, [5, 6], [11, 12])


def test_a_notify_that_raises_does_not_stop_later_pulls_being_reported(
        prefill: PrefillProc, decode: DecodeSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose "done" notification cannot be encoded (any bug; ids are ASCII, checked with the params,
    ``tests/test_params_capability.py``). Before: ``step`` raised before clearing its notify list, so from
    then on no pull of the worker was ever reported finished. Now its notify is logged and skipped, and the
    pulls after it are reported with exact bytes."""
    real_encode = notifier_module.encode_done

    def encode_done(note, secret=None):  # type: ignore[no-untyped-def]
        if note.request_id == "p-notify-bug":
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "injected")
        return real_encode(note, secret)

    monkeypatch.setattr(notifier_module, "encode_done", encode_done)
    prefill.lease(["p-notify-bug"])
    decode.start(pull_task("d-notify-bug", "p-notify-bug", prefill.port, [30], [31]))
    assert decode.pump({"d-notify-bug"}, BOUND_S) == set()
    decode.pump(set(), 0.2)
    for local, remote in (([40, 41], [1, 2]), ([42], [3])):
        good_pull(decode, prefill, local, remote)


def test_the_pulls_thread_survives_any_exception() -> None:
    from p2pkv.decode.progress import Progress

    calls: list[int] = []

    def advance() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit("not an Exception")
        return False

    progress = Progress(advance, "p2pkv-test-survivor", interval_s=0.001)
    try:
        progress.wake()
        time.sleep(0.1)
        progress.wake()
        end = time.monotonic() + 2
        while len(calls) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert len(calls) == 2, "the pulls' thread died with the first call's exception"
    finally:
        progress.close()


# ---- 2. every waiting state has a deadline --------------------------------------------------------------
def test_a_handshake_that_never_completes_times_out(decode: DecodeSide, caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A handshake call that never returns (until shutdown): the pull fails ``timeout`` after the
    handshake's budget (3 attempts of 1 s, the pauses between them, 2 s margin: 5.6 s), its blocks reported as load
    errors. Before: no deadline in HANDSHAKE, it waited forever."""
    from p2pkv.decode.deadlines import Deadlines

    limit = Deadlines.of(decode.worker.config).handshake_s
    assert limit == pytest.approx(5.6)
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    started = threading.Event()

    def stuck(*args, cancel: threading.Event, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        cancel.wait()
        raise RuntimeError("cancelled")

    monkeypatch.setattr(peers_module, "fetch_agent_info", stuck)
    t0 = time.monotonic()
    decode.start(spec("d-stuck", "p-stuck", free_port(), [7, 8], [7, 8]))
    assert started.wait(5)
    assert decode.pump({"d-stuck"}, limit + 4.0) == set(), "the pull never left HANDSHAKE"
    seconds = time.monotonic() - t0
    assert decode.take_errors() == {7, 8}
    assert limit <= seconds < limit + 3.0, seconds
    (line,) = failure_lines(caplog, "d-stuck")
    assert "kind=timeout" in line and "handshake" in line
    assert decode.worker.receiver.in_state(TransferState.HANDSHAKE) == []


def test_every_waiting_state_has_a_deadline() -> None:
    from p2pkv.config import P2pKvConfig
    from p2pkv.decode.deadlines import HANDSHAKE_MARGIN_S, Deadlines

    cfg = P2pKvConfig(handshake_timeout_s=2.0, transfer_timeout_s=30.0, insecure=True)
    d = Deadlines.of(cfg)
    assert d.limit(TransferState.HANDSHAKE) == pytest.approx(3 * 2.0 + 0.2 + 0.4 + HANDSHAKE_MARGIN_S)
    assert d.limit(TransferState.STAGING) == d.limit(TransferState.READING) == d.limit(TransferState.FENCING) == 30.0
    assert d.limit(TransferState.DONE) is None and d.limit(TransferState.FAILED) is None
    assert d.limit(TransferState.READING, "stream_timeout_s") == 30.0  # stream_timeout_s 0: transfer_timeout_s
    streams = Deadlines.of(P2pKvConfig(transfer_timeout_s=30.0, stream_timeout_s=600.0, insecure=True))
    assert streams.limit(TransferState.READING, "stream_timeout_s") == 600.0
    assert streams.limit(TransferState.READING) == 30.0
    assert streams.limit(TransferState.STAGING, "stream_timeout_s") == 30.0


# ---- 3. block ids bounded by the peer's num_blocks -----------------------------------------------------
@pytest.mark.parametrize(("local", "remote", "remote_all", "named"), [
    ([1, 2], [3, 64], None, "remote block id 64 outside [0, 64)"),
    ([1, 2], [3, 4], (3, 4, 2**64), f"remote block id {2**64} outside [0, 64)"),
    ([1, 2], [3, 4], (3, 4, 64), "remote block id 64 outside [0, 64)"),
    ([1, 64], [3, 4], None, "local block id 64 outside [0, 64)"),
], ids=["read_id_at_num_blocks", "unread_id_beyond_uint64", "unread_id_at_num_blocks", "local_id_at_num_blocks"])
def test_block_ids_beyond_num_blocks_fail_as_bad_block_ids(
        prefill: PrefillProc, mode_decode: DecodeSide, caplog: pytest.LogCaptureFixture, local: list[int],
        remote: list[int], remote_all: tuple[int, ...] | None, named: str) -> None:
    """A block id at or past the peer's (or our) ``num_blocks``, also among the params' ids not read (the
    fence names them all to the prefill rank): ``bad_block_ids`` naming the id and the bound, before any
    READ; the good pull posted with it moves exact bytes. Before: an unread id past 2**64 failed the fence
    question of every pull batched with it, one at 64 was ``not_held``. In push mode the bad pull is refused
    before any push request: no hold is pinned, the prefill worker writes nothing for it."""
    decode = mode_decode
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    (bad, bad_p), (good, good_p) = new_ids(), new_ids()
    prefill.lease([bad_p, good_p])
    good_pull(decode, prefill, [20], [21])  # the peer is known: both pulls post at once, in one fence batch
    decode.start(spec(bad, bad_p, prefill.port, local, remote, remote_all=remote_all),
                 spec(good, good_p, prefill.port, [10, 11], [12, 13]))
    assert decode.pump({bad, good}, BOUND_S) == set()
    assert decode.take_errors() == set(local)
    assert_bytes(decode, prefill, [10, 11], [12, 13])
    (line,) = failure_lines(caplog, bad)
    assert "kind=bad_block_ids" in line and named in line
    prefill.drain(0.05)
    assert not [p for p in prefill.pins if p[0] == bad_p], "a push request went out for the bad pull"
    good_pull(decode, prefill, [14, 15], [16, 17])


# ---- 4. peers keyed by a canonical address -------------------------------------------------------------
SPELLINGS = ["127.0.0.1", "127.1", "127.0.1", "0x7f.0.0.1", "0X7F.0.0.1", "0x7f.1", "0177.0.0.1", "0177.1",
             "127.000.000.001", "2130706433", "0x7f000001", "017700000001", "127.0.0.1.", "[::ffff:127.0.0.1]",
             "::ffff:127.0.0.1", "::FFFF:7F00:1"]


def test_canonical_host() -> None:
    from p2pkv.decode.peers import canonical_host

    assert {canonical_host(h) for h in SPELLINGS} == {"127.0.0.1"} and len(set(SPELLINGS)) == 16
    assert canonical_host("[0:0:0:0:0:0:0:1]") == canonical_host("::1") == "::1"
    assert canonical_host("Prefill-0.Example.COM.") == "prefill-0.example.com"
    assert canonical_host("deadbeef") == "deadbeef" and canonical_host("1e2") == "1e2"  # names, not numbers
    remote = RemotePrefill(ENGINE, "r", "0x7f.1", 5000, (), 2)
    assert PeerId.of(remote, 1) == PeerId(ENGINE, "127.0.0.1", 5001, 1)


def test_sixteen_spellings_of_one_address_make_one_peer(prefill: PrefillProc, mode_decode: DecodeSide) -> None:
    """16 spellings of 127.0.0.1 in one batch: one handshake, one peer, one fence connection (push: the one
    link the push requests go on), and every pull moves exact bytes. Before: 16 peers (or failed handshakes for
    the spellings ZMQ cannot parse)."""
    decode = mode_decode
    pulls = []
    for i, host in enumerate(SPELLINGS):
        rid, prid = new_ids()
        prefill.lease([prid])
        pulls.append(spec(rid, prid, prefill.port, [2 * i, 2 * i + 1], [63 - i, 40 - i], host=host))
    decode.start(*pulls)
    assert decode.pump({p.request_id for p in pulls}, BOUND_S) == set()
    assert decode.take_errors() == set()
    for p in pulls:
        assert_bytes(decode, prefill, list(p.local_block_ids), list(p.remote_block_ids))
    receiver = decode.worker.receiver
    assert list(receiver.peers.peers) == [PeerId(ENGINE, "127.0.0.1", prefill.port, 0)]
    assert set(receiver.fence._links) <= {("127.0.0.1", prefill.port)}


# ---- 5. peers capped and idle ones dropped -------------------------------------------------------------
def test_max_peers_drops_the_least_recently_used_peer_with_its_link_and_lane(
        prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAX_PEERS`` 1; "127.0.0.1" and "localhost" are two peers (names are not resolved). A pull through
    the second drops the first: its NIXL remote agent, its fence connection (closed), its lane. While a
    pull is in flight on the only peer, a pull needing another one is refused naming MAX_PEERS."""
    monkeypatch.setattr(keeper_module, "MAX_PEERS", 1)
    d = DecodeSide(64, **DECODE_CFG)
    receiver = d.worker.receiver
    try:
        good_pull(d, prefill, [1], [2])
        first = PeerId(ENGINE, "127.0.0.1", prefill.port, 0)
        assert list(receiver.peers.peers) == [first]
        link = receiver.fence._links[("127.0.0.1", prefill.port)]
        rid, prid = new_ids()
        prefill.lease([prid])
        d.start(spec(rid, prid, prefill.port, [3, 4], [5, 6], host="localhost"))
        assert d.pump({rid}, BOUND_S) == set() and d.take_errors() == set()
        assert_bytes(d, prefill, [3, 4], [5, 6])
        assert list(receiver.peers.peers) == [PeerId(ENGINE, "localhost", prefill.port, 0)]
        assert ("127.0.0.1", prefill.port) not in receiver.fence._links
        assert eventually(lambda: link._sock.closed), "the dropped peer's fence connection stayed open"
        assert eventually(lambda: f"127.0.0.1:{prefill.port}" not in receiver.background._lanes._keys)
        # A READ stuck in flight on "localhost": no peer can be dropped for another spelling.
        inject(d.worker, "check_xfer_state", 1, "proc", times=None)
        (stuck, stuck_p), (refused, refused_p) = new_ids(), new_ids()
        prefill.lease([stuck_p, refused_p])
        d.start(spec(stuck, stuck_p, prefill.port, [7], [8], host="localhost"))
        d.start(spec(refused, refused_p, prefill.port, [9], [10]))
        assert d.pump({refused}, BOUND_S) == set() and d.take_errors() == {9}
        assert list(receiver.peers.peers) == [PeerId(ENGINE, "localhost", prefill.port, 0)]
        restore(d.worker)
    finally:
        d.close()


def test_idle_peers_are_dropped_with_their_link(prefill: PrefillProc, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="p2pkv.decode")
    monkeypatch.setattr(keeper_module, "PEER_IDLE_S", 0.5)
    d = DecodeSide(64, **DECODE_CFG)
    receiver = d.worker.receiver
    try:
        good_pull(d, prefill, [1], [2])
        link = receiver.fence._links[("127.0.0.1", prefill.port)]
        assert eventually(lambda: not d.step() and not receiver.peers.peers, 5.0), "the idle peer was kept"
        assert eventually(lambda: link._sock.closed) and receiver.fence._links == {}
        assert "unused for more than PEER_IDLE_S=0.5 s" in caplog.text
        good_pull(d, prefill, [3], [4])  # handshakes again
    finally:
        d.close()


# ---- 6. bounded pools ----------------------------------------------------------------------------------
def test_tp_size_512_at_an_unreachable_host_never_runs_more_threads_than_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One request naming 512 prefill ranks at 127.0.0.2 (nothing listens): 512 handshakes, then 512
    releases, all on bounded pools. Before: one thread per call, 512 at once."""
    from p2pkv.decode.background import CALL_THREADS, LANE_THREADS

    monkeypatch.setattr(keeper_module, "MAX_PEERS", 1024)
    d = DecodeSide(64, handshake_timeout_s=0.5, handshake_attempts=1, transfer_timeout_s=10.0)
    try:
        before = threading.active_count()
        d.start(spec("d-512", "p-512", 20000, [1, 2], [1, 2], host="127.0.0.2", tp_size=512))
        most, end = 0, time.monotonic() + 4.0
        while time.monotonic() < end:
            most = max(most, threading.active_count())
            d.step()
            time.sleep(0.005)
        assert "d-512" in d.finished and d.take_errors() == {1, 2}
        assert most - before <= CALL_THREADS + LANE_THREADS, f"{most - before} threads for one request"
        bg = d.worker.receiver.background
        assert len(bg._calls._threads) + len(bg._lanes._threads) <= CALL_THREADS + LANE_THREADS
        assert d.worker.receiver.peers.handshakes == {}  # the ones nobody waited for were never started
    finally:
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < 3.0


def test_a_pull_needing_more_than_max_peers_is_refused_alone(prefill: PrefillProc, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull naming 8 prefill ranks with ``MAX_PEERS`` 4, beside a good pull: refused naming MAX_PEERS
    before any handshake; the good one moves exact bytes."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    monkeypatch.setattr(keeper_module, "MAX_PEERS", 4)
    d = DecodeSide(64, **DECODE_CFG)
    try:
        (bad, bad_p), (good, good_p) = new_ids(), new_ids()
        prefill.lease([bad_p, good_p])
        d.start(spec(bad, bad_p, 20000, [1], [1], host="127.0.0.2", tp_size=8),
                spec(good, good_p, prefill.port, [2, 3], [4, 5]))
        assert d.pump({bad, good}, BOUND_S) == set()
        assert d.take_errors() == {1}
        assert_bytes(d, prefill, [2, 3], [4, 5])
        (line,) = failure_lines(caplog, bad)
        assert "kind=refused" in line and "MAX_PEERS=4" in line
        assert d.worker.receiver.peers.handshakes == {}
    finally:
        d.close()


def test_the_peer_bounds_are_constants() -> None:
    from p2pkv.config import ConfigError, load_config

    assert (keeper_module.MAX_PEERS, keeper_module.PEER_IDLE_S) == (256, 600.0)
    for key in ("max_peers", "peer_idle_s"):
        with pytest.raises(ConfigError, match=f"`{key}` was removed: .*p2pkv.decode.keeper"):
            load_config({key: 1}, environ={})
