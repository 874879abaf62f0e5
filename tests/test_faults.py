"""Fault injection on every decode-side NIXL call of a pull, on the side channel, and on leases.

A real prefill :class:`~p2pkv.worker.WorkerSide` runs in its own process
(:class:`tests.p2p_harness.PrefillProc`); a real decode ``WorkerSide`` runs
here with :func:`tests.faults.inject` making one NIXL method fail. The
documented behaviour (``p2pkv/worker.py``):

* a pull that fails to start (``get_xfer_descs``, ``initialize_xfer``,
  ``transfer``) or while in flight (``check_xfer_state``) drops the peer,
  re-handshakes and is retried once: one fault costs nothing, a fault on
  every call ends as load errors;
* a handshake failure (``add_remote_agent``, or any side-channel fault) is
  final: the pull's local blocks are load errors at once;
* ``release_xfer_handle`` failures are logged and ignored;
* every failed pull is still reported in ``finished_recving``, with exactly
  its local blocks in ``get_block_ids_with_load_errors()``, and nothing
  escapes ``get_finished``.

After each fault a clean pull of another request must move exact bytes. The
prefill process reports every release; at the end no request may have been
released twice.

Push mode (``transfer_mode: push``: the prefill rank WRITEs) has its own
faults, on the prefill side: its NIXL agent failing a WRITE
(:meth:`tests.p2p_harness.PrefillProc.inject`), its pusher held back, its
side channel slowed, the process killed after accepting a push; and on the
decode side: notifications it cannot read, a decode worker closed with a
push queued. Beside exact bytes and exact load errors, each checks that a
decode worker hands blocks back only after the WRITE into them ended (the
prefill process reports the times, on the host's one monotonic clock) and
that no hold stays pinned.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from handshake import PROTOCOL_VERSION, Destination, HoldQuery, HoldsReply, MetadataReply, encode, fetch_agent_info
from handshake import decode as decode_message
from handshake.compat import fingerprint
from p2pkv.metadata import P2pKvMetadata
from p2pkv.tools.bench.synth import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.conftest import MODES
from tests.faults import FaultyNixlAgent, inject, restore
from tests.p2p_harness import ENGINE, LAYOUT, DecodeSide, PrefillProc, free_port, notify_task, pull_task, shape
from tests.workers import COMPAT_FIELDS, make_worker, model_info

HOST = "127.0.0.1"
BOUND_S = 10.0  # a failed or retried pull is reported within this (it takes well under a second)
DECODE_CFG = dict(handshake_timeout_s=2.0, handshake_retries=1, transfer_timeout_s=10.0,
                  pull_poll_interval_s=0.0)  # faults are injected per call: only the test steps the pulls

_ids = itertools.count()
SPARES: dict[int, PrefillProc] = {}
"""A second prefill process per module prefill (by its port), spawned with it: a test may kill it."""


def spare(pf: PrefillProc) -> PrefillProc:
    """The spare prefill process started beside ``pf`` (its start-up overlapped the tests before), ready."""
    victim = SPARES[pf.port]
    victim.wait_ready()
    return victim


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProc]:
    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0)
    extra = PrefillProc(free_port(), seed=2, num_blocks=64, lease_s=30.0)
    extra.spawn()  # started beside the first, for the test that kills one (see ``spare``)
    pf.start()
    SPARES[pf.port] = extra
    try:
        yield pf
    finally:
        pf.stop()
        if extra.alive():
            extra.stop()
        SPARES.pop(pf.port, None)
    twice = {r for r in pf.leased if pf.times_released(r) > 1}
    assert not twice, f"requests released more than once on the prefill side: {sorted(twice)}"
    assert not pf.released() - pf.leased, "released requests that were never leased"
    assert not pf.pinned_at_stop, f"holds still pinned by a WRITE at the end: {pf.pinned_at_stop}"


@pytest.fixture
def decode() -> Iterator[DecodeSide]:
    d = DecodeSide(64, **DECODE_CFG)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(params=MODES)
def mode_decode(request: pytest.FixtureRequest) -> Iterator[DecodeSide]:
    """A decode worker in each transfer mode (the test runs once per mode)."""
    d = DecodeSide(64, transfer_mode=request.param, **DECODE_CFG)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def push_decode() -> Iterator[DecodeSide]:
    """A decode worker in push mode (the prefill rank WRITEs), stepped only by the test."""
    d = DecodeSide(64, transfer_mode="push", **DECODE_CFG)
    try:
        yield d
    finally:
        d.close()


def new_ids() -> tuple[str, str]:
    n = next(_ids)
    return f"d-{n}", f"p-{n}"


def pull(d: DecodeSide, pf: PrefillProc, local: list[int], remote: list[int],
         engine_port: int | None = None, engine: str = "prefill-engine") -> tuple[str, str, set[int], float]:
    """Lease, pull and wait; ``(decode id, prefill id, load errors, seconds)``.

    Asserts the request finished receiving exactly once within :data:`BOUND_S`.
    """
    rid, prid = new_ids()
    pf.lease([prid])
    t0 = time.monotonic()
    d.start(pull_task(rid, prid, engine_port or pf.port, local, remote, engine=engine))
    missing = d.pump({rid}, BOUND_S)
    seconds = time.monotonic() - t0
    assert not missing, f"{rid} hung: not reported in finished_recving within {BOUND_S} s"
    d.pump(set(), 0.05)  # a few more steps: it must not be reported twice
    assert d.finished[rid] == 1, f"{rid} reported {d.finished[rid]} times"
    return rid, prid, d.take_errors(), seconds


def assert_bytes(d: DecodeSide, pf: PrefillProc, local: list[int], remote: list[int]) -> None:
    expected = pf.expected()
    bad = [lb for lb, rb in zip(local, remote, strict=True) if not d.block_ok(lb, rb, expected)]
    assert not bad, f"local blocks {bad} do not hold the prefill bytes"


def released(d: DecodeSide | None, pf: PrefillProc, ids: set[str], timeout_s: float = BOUND_S) -> bool:
    """True once every id in ``ids`` was released on the prefill side. The decode worker (if any) keeps
    stepping meanwhile, as an engine does: its steps progress NIXL's sends of the "done" notifications (one
    sent on a connection just set up, after a re-handshake, leaves only then)."""
    end = time.monotonic() + timeout_s
    while not ids <= pf.released() and time.monotonic() < end:
        if d is not None:
            d.step()
        pf.drain(0.005)
    return ids <= pf.released()


def clean_pull_succeeds(d: DecodeSide, pf: PrefillProc) -> None:
    local, remote = [40, 41, 42, 50], [60, 61, 62, 1]
    _, prid, errors, _ = pull(d, pf, local, remote)
    assert errors == set()
    assert_bytes(d, pf, local, remote)
    assert released(d, pf, {prid}) and pf.times_released(prid) == 1


# ---- one fault on the first call -------------------------------------------------------
# (method, mode, outcome): "retried" = re-handshake + retry succeeds; "ignored" = no retry
# needed; "failed" = load errors at once.
SINGLE = [
    ("get_xfer_descs", "raise", "retried"),
    ("initialize_xfer", "raise", "retried"),
    ("transfer", "raise", "retried"),
    ("transfer", "err", "retried"),
    ("check_xfer_state", "raise", "retried"),
    ("check_xfer_state", "err", "retried"),
    ("release_xfer_handle", "raise", "ignored"),
    ("add_remote_agent", "raise", "failed"),
]


@pytest.mark.parametrize(("method", "mode", "outcome"), SINGLE, ids=[f"{m}-{k}" for m, k, _ in SINGLE])
def test_first_call_fault(prefill: PrefillProc, decode: DecodeSide, method: str, mode: str, outcome: str) -> None:
    faulty = inject(decode.worker, method, 1, mode)  # type: ignore[arg-type]
    local, remote = [3, 4, 5, 20], [10, 11, 12, 7]
    _, prid, errors, seconds = pull(decode, prefill, local, remote)
    assert faulty.faults == 1
    assert seconds < BOUND_S
    if outcome == "failed":
        assert errors == set(local)
        assert faulty.calls["add_remote_agent"] == 1  # a failed handshake is final: no retry
    else:
        assert errors == set()
        assert_bytes(decode, prefill, local, remote)
        # "retried": the peer was dropped and handshaken again, once.
        assert faulty.calls["add_remote_agent"] == (2 if outcome == "retried" else 1)
        assert prefill.wait_released({prid}, BOUND_S)
    clean_pull_succeeds(decode, prefill)


# ---- a fault on every call ---------------------------------------------------------------
ALWAYS = [(m, k) for m, k, outcome in SINGLE if outcome != "ignored"]


@pytest.mark.parametrize(("method", "mode"), ALWAYS, ids=[f"{m}-{k}" for m, k in ALWAYS])
def test_persistent_fault_ends_as_load_error(prefill: PrefillProc, decode: DecodeSide, method: str,
                                             mode: str) -> None:
    faulty = inject(decode.worker, method, 1, mode, times=None)  # type: ignore[arg-type]
    local, remote = [7, 8, 30], [7, 9, 33]
    _, _, errors, seconds = pull(decode, prefill, local, remote)
    assert errors == set(local)
    assert seconds < BOUND_S
    # Two attempts (the retry after a re-handshake), except a failed handshake: one.
    assert faulty.calls["add_remote_agent"] == (1 if method == "add_remote_agent" else 2)
    assert decode.worker.puller.pulls == []  # nothing left behind for a later request
    restore(decode.worker)
    clean_pull_succeeds(decode, prefill)


def test_persistent_release_fault_never_fails_a_pull(prefill: PrefillProc, decode: DecodeSide) -> None:
    faulty = inject(decode.worker, "release_xfer_handle", 1, times=None)
    for _ in range(3):
        local, remote = [1, 2], [2, 3]
        _, _, errors, _ = pull(decode, prefill, local, remote)
        assert errors == set()
        assert_bytes(decode, prefill, local, remote)
    assert faulty.faults == 3
    assert faulty.calls["add_remote_agent"] == 1


@pytest.mark.parametrize(("method", "mode"), [("check_xfer_state", "raise"), ("check_xfer_state", "err"),
                                              ("transfer", "raise")])
def test_fault_in_one_pull_of_a_batch(prefill: PrefillProc, decode: DecodeSide, method: str, mode: str) -> None:
    """One pull's failure drops the peer under the others in flight (NIXL then fails their READs
    too): every pull still finishes exactly once, each with exact bytes or all its blocks in load
    errors, and no other block is reported. (Zero load errors is what the retry aims for; see
    ``test_stale_failure_keeps_the_new_peer`` for why some may still fail.)"""
    faulty = inject(decode.worker, method, 3, mode)  # type: ignore[arg-type]
    tasks, pairs = [], {}
    for i in range(8):
        rid, prid = new_ids()
        local, remote = [2 * i, 2 * i + 1], [63 - i, 40 + i]
        tasks.append(pull_task(rid, prid, prefill.port, local, remote))
        pairs[rid] = (prid, local, remote)
    prefill.lease([p for p, _, _ in pairs.values()])
    decode.start(*tasks)
    assert decode.pump(set(pairs), BOUND_S) == set()
    decode.pump(set(), 0.05)
    assert faulty.faults == 1
    assert all(decode.finished[r] == 1 for r in pairs)
    errors = decode.take_errors()
    for _, local, remote in pairs.values():
        if set(local) <= errors:
            errors -= set(local)
        else:
            assert not set(local) & errors, "a pull's blocks were partly reported"
            assert_bytes(decode, prefill, local, remote)
    assert errors == set(), f"load errors for blocks of no pull: {sorted(errors)}"
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
    while not (b_fails.faults and w.puller.peers.handshakes) and time.monotonic() < end:  # B failed, re-handshake began
        decode.step()
    reads_in_flight = sum(r.in_flight for p in w.puller.pulls for r in p.reads)
    assert a_slow.faults == 1 and outer.calls["check_xfer_state"] == 2 and reads_in_flight == 1
    (pending,) = w.puller.peers.handshakes.values()
    assert pending.future is not None
    pending.future.result(timeout=BOUND_S)  # re-handshake done: B restarts, then A's poll fails
    assert decode.pump({a, b}, BOUND_S) == set()
    assert outer.faults == 1 and b_fails.faults == 1 and a_slow.faults == 1
    assert outer.calls["remove_remote_agent"] == 1, "the re-handshaken peer was dropped for a stale failure"
    assert decode.take_errors() == set()
    assert_bytes(decode, prefill, [1, 2, 5, 6], [3, 4, 7, 8])


def test_stuck_read_times_out_as_load_error(prefill: PrefillProc) -> None:
    """A READ that never reports done is given up after ``transfer_timeout_s``: load errors, no retry."""
    d = DecodeSide(64, handshake_timeout_s=2.0, handshake_retries=1, transfer_timeout_s=0.5)
    try:
        faulty = inject(d.worker, "check_xfer_state", 1, "proc", times=None)
        local, remote = [30, 31], [32, 33]
        _, _, errors, seconds = pull(d, prefill, local, remote)
        assert errors == set(local)
        assert 0.5 <= seconds < BOUND_S
        assert faulty.calls["add_remote_agent"] == 1 and d.worker.puller.pulls == []
        restore(d.worker)
        clean_pull_succeeds(d, prefill)
    finally:
        d.close()


def test_cancelled_read_nixl_keeps_active_holds_its_blocks_until_it_ends(prefill: PrefillProc) -> None:
    """A stuck READ is given up after ``transfer_timeout_s``, but NIXL refuses to release it (still
    active: its bytes may still land). Its blocks go back to vLLM (load errors, finished) only after the
    READ ends or another ``transfer_timeout_s`` passed, never while it may still write them."""
    d = DecodeSide(64, handshake_timeout_s=2.0, handshake_retries=1, transfer_timeout_s=0.5)
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


# ---- notifications -------------------------------------------------------------------------
@pytest.mark.parametrize("peer_known", [False, True], ids=["new_peer", "known_peer"])
def test_notify_only_send_failure_is_contained(prefill: PrefillProc, mode_decode: DecodeSide, peer_known: bool) -> None:
    """An aborted request's notify-only task whose ``send_notif`` fails: the prefill side falls
    back on its lease; nothing may escape, and the pull queued after it must still run."""
    decode = mode_decode
    if peer_known:
        clean_pull_succeeds(decode, prefill)
    faulty = inject(decode.worker, "send_notif", 1)
    abort_rid, abort_prid = new_ids()
    rid, prid = new_ids()
    prefill.lease([abort_prid, prid])
    local, remote = [9, 10], [11, 12]
    decode.start(notify_task(abort_rid, abort_prid, prefill.port),
                 pull_task(rid, prid, prefill.port, local, remote))
    assert decode.pump({rid}, BOUND_S) == set()
    assert faulty.faults == 1
    assert abort_rid not in decode.finished  # report=False: never reported
    assert decode.take_errors() == set()
    assert_bytes(decode, prefill, local, remote)


def test_notify_only_task_releases_the_prefill_lease(prefill: PrefillProc, decode: DecodeSide) -> None:
    rid, prid = new_ids()
    prefill.lease([prid])
    decode.start(notify_task(rid, prid, prefill.port))
    end = time.monotonic() + BOUND_S
    while time.monotonic() < end and prid not in prefill.released():
        decode.step()
        prefill.drain(0.01)
    assert prefill.notified.get(prid) == 1 and prid not in prefill.expired
    assert rid not in decode.finished and decode.take_errors() == set()


def test_notification_poll_failure_does_not_escape_get_finished(prefill: PrefillProc, decode: DecodeSide) -> None:
    inject(decode.worker, "get_new_notifs", 1, times=None)
    local, remote = [5, 6], [6, 7]
    _, _, errors, _ = pull(decode, prefill, local, remote)
    assert errors == set()


# ---- side channel (ZMQ) faults ---------------------------------------------------------------
@contextlib.contextmanager
def fake_side_channel(respond: Callable[[list[bytes]], list[bytes]] | None,
                      delay_s: float = 0.0) -> Iterator[tuple[int, list[list[bytes]]]]:
    """A ROUTER socket in a thread: answers each request with ``respond(body)`` after ``delay_s``
    (``respond=None``: never answers). Yields ``(port, requests seen)``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    seen: list[list[bytes]] = []
    stop = threading.Event()

    def loop() -> None:
        due: list[tuple[float, list[bytes]]] = []
        while not stop.is_set():
            if sock.poll(5):
                identity, *body = sock.recv_multipart()
                seen.append(body)
                if respond is not None and (reply := respond(body)) is not None:  # None: no answer
                    due.append((time.monotonic() + delay_s, [identity, *reply]))
            now = time.monotonic()
            for item in [x for x in due if x[0] <= now]:
                due.remove(item)
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(item[1], zmq.NOBLOCK)
        sock.close(0)

    thread = threading.Thread(target=loop, name="fake-side-channel", daemon=True)
    thread.start()
    try:
        yield port, seen
    finally:
        stop.set()
        thread.join(2)
        ctx.term()


def real_reply(pf: PrefillProc, nonce: bytes | None = None) -> Callable[[list[bytes]], list[bytes]]:
    """Answers with the prefill process's own (valid) metadata, echoing each request's nonce
    (or always ``nonce``: a reply captured from another exchange)."""
    info = fetch_agent_info(Destination(HOST, pf.port, ENGINE, 0), "test", fingerprint(COMPAT_FIELDS), timeout_s=5.0,
                            retries=2)

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = decode_message(body, None).nonce if nonce is None else nonce
        return encode(MetadataReply(protocol_version=PROTOCOL_VERSION, info=info, nonce=echoed), None)

    return respond


ZMQ_TIMEOUT_S, ZMQ_RETRIES = 0.4, 2
ZMQ_BOUND_S = ZMQ_RETRIES * ZMQ_TIMEOUT_S + 0.2 + 2.0  # attempts + backoff + slack for a loaded machine

ZMQ_CASES = {
    "silent": (None, 0.0),
    "garbage": (lambda body: [b"\xc1\x00garbage\xff"], 0.0),
    "empty_frame": (lambda body: [b""], 0.0),
    "echoed_request": (lambda body: body, 0.0),
    "late": ("real", 3 * ZMQ_TIMEOUT_S),
    "replayed": ("replayed", 0.0),
}


@pytest.mark.parametrize("case", list(ZMQ_CASES))
def test_side_channel_fault_fails_the_pull_cleanly(prefill: PrefillProc, case: str) -> None:
    respond, delay = ZMQ_CASES[case]
    if respond in ("real", "replayed"):
        respond = real_reply(prefill, None if respond == "real" else b"nonce of an earlier exchange")
    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_retries=ZMQ_RETRIES)
    try:
        with fake_side_channel(respond, delay) as (port, seen):  # type: ignore[arg-type]
            local, remote = [11, 12, 13], [1, 2, 3]
            _, _, errors, seconds = pull(d, prefill, local, remote, engine_port=port, engine=f"fake-{case}")
            assert seen, "the fake side channel never got a request"
        assert errors == set(local)
        assert seconds < ZMQ_BOUND_S, f"failing took {seconds:.2f} s"
        assert d.worker.puller.peers.peers == {} and d.worker.puller.peers.handshakes == {}
        clean_pull_succeeds(d, prefill)
    finally:
        d.close()


def test_fake_side_channel_with_a_prompt_real_reply_pulls(prefill: PrefillProc) -> None:
    """Control for ``late`` and ``replayed``: the same reply, sent in time and answering this request, pulls."""
    metadata = real_reply(prefill)

    def respond(body: list[bytes]) -> list[bytes]:  # metadata, then the pull's fence questions
        msg = decode_message(body, None)
        if not isinstance(msg, HoldQuery):
            return metadata(body)
        return encode(HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=len(msg.request_ids),
                                     request_ids=msg.request_ids, nonce=msg.nonce), None)

    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_retries=ZMQ_RETRIES)
    try:
        with fake_side_channel(respond) as (port, _):
            local, remote = [11, 12, 13], [1, 2, 3]
            _, _, errors, _ = pull(d, prefill, local, remote, engine_port=port)
        assert errors == set()
        assert_bytes(d, prefill, local, remote)
    finally:
        d.close()


def _fence_dropping(prefill: PrefillProc, drop: Callable[[int], bool]) -> Callable[[list[bytes]], list[bytes] | None]:
    """The real metadata, and fence answers "held" except for the fence questions ``drop(n)`` picks (1-based)."""
    metadata, asked = real_reply(prefill), itertools.count(1)

    def respond(body: list[bytes]) -> list[bytes] | None:
        msg = decode_message(body, None)
        if not isinstance(msg, HoldQuery):
            return metadata(body)
        if drop(next(asked)):
            return None
        return encode(HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=len(msg.request_ids),
                                     request_ids=msg.request_ids, nonce=msg.nonce), None)

    return respond


@pytest.mark.parametrize(("drop", "ok"), [(lambda n: n == 2, True), (lambda n: n >= 2, False)],
                         ids=["one_unanswered", "never_answered"])
def test_unanswered_fence_question(prefill: PrefillProc, drop: Callable[[int], bool], ok: bool) -> None:
    """The question after the READ gets no answer: asked once more; a second silence fails the pull
    (kind=unconfirmed), exactly its blocks as load errors, within two side-channel timeouts."""
    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_retries=ZMQ_RETRIES)
    try:
        with fake_side_channel(_fence_dropping(prefill, drop)) as (port, seen):
            local, remote = [21, 22], [5, 6]
            _, _, errors, seconds = pull(d, prefill, local, remote, engine_port=port)
        assert errors == (set() if ok else set(local))
        assert len(seen) >= 4 and seconds < ZMQ_BOUND_S + ZMQ_TIMEOUT_S
        if ok:
            assert_bytes(d, prefill, local, remote)
    finally:
        d.close()


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
    released: list[tuple[str, float]] = []

    def step(seconds: float, until: str | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and any(r == until for r, _ in released)):
            sending, _ = pre.get_finished()
            released.extend((r, time.monotonic()) for r in sending)
            d.step()
            time.sleep(0.003)

    def lease(rid: str, seconds: float | None = None) -> float:
        now = time.monotonic()
        pre.start_load_kv(P2pKvMetadata(send_leases={rid: now + (seconds or pre.config.lease_s)}))
        return now

    def notify(rid: str) -> None:
        d.start(notify_task(f"d-{rid}", rid, port, engine="lease-engine"))

    def times(rid: str) -> list[float]:
        return [t for r, t in released if r == rid]

    try:
        t_quiet = lease("quiet")  # config lease_s, no notification
        step(5.0, until="quiet")
        step(0.5)
        assert [r for r, _ in released] == ["quiet"]
        assert released[0][1] - t_quiet >= lease_s
        notify("quiet")  # late: after the expiry
        step(1.0)
        assert times("quiet") == [released[0][1]]

        long_s = 30.0  # only a notification can release these within the test
        t_told = lease("told", long_s)
        notify("told")
        step(5.0, until="told")
        step(0.5)
        assert len(times("told")) == 1 and times("told")[0] - t_told < 5.5, "not released by its notification"

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


# ---- push mode: the prefill rank's WRITEs fail, stall, or never come -----------------------------------------
PUSH_CFG = dict(transfer_mode="push", handshake_timeout_s=1.0, handshake_retries=1, pull_poll_interval_s=0.0)


def failure_lines(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    """The decode worker's "pull failed" log lines about ``rid``."""
    return [r.getMessage() for r in caplog.records
            if "pull failed" in r.getMessage() and f"request={rid} " in r.getMessage()]


def counting_handshakes(d: DecodeSide) -> FaultyNixlAgent:
    """Count the decode agent's ``add_remote_agent`` calls (one per handshake); nothing fails."""
    return inject(d.worker, "add_remote_agent", 10**9)


def settled(pf: PrefillProc, timeout_s: float = BOUND_S) -> dict:
    """The prefill worker's state once no WRITE is queued or in flight and no hold is pinned."""
    end = time.monotonic() + timeout_s
    while True:
        state = pf.state()
        if (state["pending"], state["pins"]) == (0, {}) or time.monotonic() > end:
            assert (state["pending"], state["pins"]) == (0, {}), f"WRITEs or pins left: {state}"
            return state["counters"]
        time.sleep(0.02)


def pushes_since(before: dict, after: dict) -> tuple[int, int, int]:
    """``(accepted, failed, written)`` push counts between two :func:`settled` states."""
    return tuple(after[k] - before[k] for k in ("accepted", "failed", "written"))  # type: ignore[return-value]


def released_once_not_expired(pf: PrefillProc, prid: str, d: DecodeSide | None = None,
                              timeout_s: float = BOUND_S) -> None:
    """The hold ended exactly once, by its "done" or a release (not by its lease); ``d`` steps meanwhile."""
    assert released(d, pf, {prid}, timeout_s), f"{prid} was not released within {timeout_s} s"
    pf.drain(0.05)
    assert pf.times_released(prid) == 1 and prid not in pf.expired, (pf.notified.get(prid), pf.expired.get(prid))


def wait_pinned(d: DecodeSide, pf: PrefillProc, prid: str, timeout_s: float = BOUND_S) -> float:
    """Step the decode worker until the prefill worker pinned ``prid`` for a WRITE; when it did."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        d.step()
        pf.drain(0.005)
        pinned = [t for rid, answer, t in pf.pins if rid == prid and answer == "held"]
        if pinned:
            return pinned[0]
    raise AssertionError(f"the prefill worker never accepted a push of {prid}")


# (method, mode, outcome): "retried" = a "push_failed" note, re-handshake, the second push writes; "moved" = the
# WRITE was posted before its poll failed: its own note or the failure's comes first, exact bytes either way;
# "ignored" = nothing to retry; "refused" = the decode agent refused by NIXL there: the push is refused.
PUSH_SINGLE = [
    ("get_xfer_descs", "raise", "retried"),
    ("initialize_xfer", "raise", "retried"),
    ("transfer", "raise", "retried"),
    ("transfer", "err", "retried"),
    ("check_xfer_state", "raise", "moved"),
    ("check_xfer_state", "err", "moved"),
    ("release_xfer_handle", "raise", "ignored"),
    ("add_remote_agent", "raise", "rehandshaken"),
]


@pytest.mark.parametrize(("method", "mode", "outcome"), PUSH_SINGLE, ids=[f"{m}-{k}" for m, k, _ in PUSH_SINGLE])
def test_push_first_write_fault(prefill: PrefillProc, push_decode: DecodeSide, caplog: pytest.LogCaptureFixture,
                                method: str, mode: str, outcome: str) -> None:
    """One fault on the prefill rank's NIXL agent (the push analogue of ``test_first_call_fault``): one fault
    costs nothing but a retry — of the push alone after a failed WRITE (the prefill rank said so: the peer is
    kept), after a new handshake when the prefill rank refused the decode agent (it may have restarted).
    Every hold ends once, nothing stays pinned."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = push_decode
    handshakes = counting_handshakes(d)
    before = settled(prefill)
    prefill.inject((method, 1, mode, 1))
    local, remote = [3, 4, 5, 20], [10, 11, 12, 7]
    rid, prid, errors, seconds = pull(d, prefill, local, remote)
    assert prefill.restore()["faults"] == 1
    assert seconds < BOUND_S
    accepted, failed, written = pushes_since(before, settled(prefill))
    assert errors == set() and failure_lines(caplog, rid) == []
    assert_bytes(d, prefill, local, remote)
    if outcome == "rehandshaken":
        assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == (2, 1, 0, 1)
    else:
        if outcome == "retried":
            assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == (1, 2, 1, 1)
        elif outcome == "ignored":
            assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == (1, 1, 0, 1)
    released_once_not_expired(prefill, prid, d)
    clean_pull_succeeds(d, prefill)


PUSH_ALWAYS = [("get_xfer_descs", "raise", "transfer"), ("transfer", "raise", "transfer"),
               ("transfer", "err", "transfer"), ("add_remote_agent", "raise", "refused")]


@pytest.mark.parametrize(("method", "mode", "kind"), PUSH_ALWAYS, ids=[f"{m}-{k}" for m, k, _ in PUSH_ALWAYS])
def test_push_persistent_write_fault_ends_as_load_error(prefill: PrefillProc, push_decode: DecodeSide,
                                                        caplog: pytest.LogCaptureFixture, method: str, mode: str,
                                                        kind: str) -> None:
    """Every WRITE fails on the prefill side: two pushes (the retry of the push; after a new handshake when
    the decode agent is refused), then exactly the pull's blocks as load errors with the kind named; the hold
    freed once, nothing pinned."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = push_decode
    handshakes = counting_handshakes(d)
    before = settled(prefill)
    prefill.inject((method, 1, mode, None))
    local, remote = [7, 8, 30], [7, 9, 33]
    rid, prid, errors, seconds = pull(d, prefill, local, remote)
    assert errors == set(local) and seconds < BOUND_S
    (line,) = failure_lines(caplog, rid)
    assert f"kind={kind}" in line, line
    accepted, failed, written = pushes_since(before, settled(prefill))
    expected = (2, 0, 0, 0) if kind == "refused" else (1, 2, 2, 0)  # handshakes, accepted, failed, written
    assert (handshakes.calls["add_remote_agent"], accepted, failed, written) == expected
    assert d.worker.puller.pulls == [] and torch.count_nonzero(d.base[local]) == 0
    released_once_not_expired(prefill, prid, d)
    assert prefill.restore()["faults"] >= 1
    clean_pull_succeeds(d, prefill)


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
    tasks, pairs = [], {}
    for i in range(8):
        rid, prid = new_ids()
        local, remote = [2 * i, 2 * i + 1], [63 - i, 40 + i]
        tasks.append(pull_task(rid, prid, prefill.port, local, remote))
        pairs[rid] = (prid, local, remote)
    prefill.lease([p for p, _, _ in pairs.values()], seconds=3.0)  # a lost "done" falls back on a short lease
    d.start(*tasks)
    assert d.pump(set(pairs), BOUND_S) == set()
    d.pump(set(), 0.05)
    assert prefill.restore()["faults"] == 1
    assert all(d.finished[r] == 1 for r in pairs)
    errors = d.take_errors()
    for _, local, remote in pairs.values():
        if set(local) <= errors:
            errors -= set(local)
        else:
            assert not set(local) & errors, "a pull's blocks were partly reported"
            assert_bytes(d, prefill, local, remote)
    assert errors == set(), f"load errors for blocks of no pull: {sorted(errors)}"
    settled(prefill)
    prids = {p for p, _, _ in pairs.values()}
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
    pushes = d.worker.puller.pushes
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
    """``get_new_notifs`` fails once: the next call reads the note, the pull succeeds. It always fails: nothing
    says the WRITE ended, so the pull fails ``timeout`` and its blocks go back only after the push's window plus a
    reply timeout (past which the prefill rank writes nothing); the hold is freed once."""
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
        end = time.monotonic() + BOUND_S
        while pushes_since(before, prefill.state()["counters"])[0] < 1 and time.monotonic() < end:
            time.sleep(0.05)
        prefill.call("delay_push", 0.0)
        end = time.monotonic() + BOUND_S  # the retry's request is handled 2 s after the first: let it pass
        while sum(rid == prid for rid, _, _ in prefill.pins) < 2 and time.monotonic() < end:
            prefill.drain(0.02)
        settled(prefill)
        assert prefill.wait_released({prid}, BOUND_S)
        prefill.drain(0.05)
        assert prefill.times_released(prid) == 1
        assert bool((d.base[local] == -7.0).all()), "a WRITE landed in blocks the decode worker had handed back"
    finally:
        prefill.call("delay_push", 0.0)
        d.close()


def test_prefill_killed_after_accepting_a_push(prefill: PrefillProc, caplog: pytest.LogCaptureFixture) -> None:
    """Peer death, prefill side: the prefill process accepts a push (the hold pinned), then is SIGKILLed before
    its WRITE. Nothing tells the decode worker (no READ of its own to fail): the pull fails ``timeout`` after
    ``transfer_timeout_s``, exactly its blocks as load errors, untouched, and only after the push's window
    (past which a WRITE it accepted could no longer start there). The dead process released nothing twice and
    the hold ended with it, unreleased. (A new incarnation taking over the leases is the churn's, in pull
    mode; in push mode see ``test_a_restarted_prefill_is_used_again_in_push_mode``.)"""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    victim = spare(prefill)
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
        assert 1.0 + 1.0 <= seconds < BOUND_S, f"blocks handed back after {seconds:.2f} s, within the push's window"
        (line,) = failure_lines(caplog, rid)
        assert any(f"kind={k}" in line for k in ("timeout", "transfer", "disconnect")), line
        assert torch.count_nonzero(d.base[local]) == 0
        assert d.worker.puller.pulls == []
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


# ---- shutdown ---------------------------------------------------------------------------------
def _new_threads(before: set[threading.Thread], wait_s: float = 2.0) -> list[threading.Thread]:
    end = time.monotonic() + wait_s
    while True:
        bad = [t for t in threading.enumerate() if t not in before and t.is_alive()
               and (t.name.startswith("p2pkv") or not t.daemon)]
        if not bad or time.monotonic() > end:
            return bad
        time.sleep(0.05)


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
    d = DecodeSide(64, handshake_timeout_s=3.0, handshake_retries=1)
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
