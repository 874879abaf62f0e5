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
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from handshake import PROTOCOL_VERSION, HoldQuery, HoldsReply, MetadataReply, encode, fetch_agent_info
from handshake import decode as decode_message
from handshake.compat import fingerprint
from p2pkv.metadata import P2pKvMetadata
from p2pkv.tools.bench.synth import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.faults import FaultyNixlAgent, inject, restore
from tests.p2p_harness import ENGINE, LAYOUT, DecodeSide, PrefillProc, free_port, notify_task, pull_task, shape
from tests.workers import COMPAT_FIELDS, make_worker, model_info

HOST = "127.0.0.1"
BOUND_S = 10.0  # a failed or retried pull is reported within this (it takes well under a second)
DECODE_CFG = dict(handshake_timeout_s=2.0, handshake_retries=1, transfer_timeout_s=10.0,
                  pull_poll_interval_s=0.0)  # faults are injected per call: only the test steps the pulls

_ids = itertools.count()


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProc]:
    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0)
    pf.start()
    try:
        yield pf
    finally:
        pf.stop()
    twice = {r for r in pf.leased if pf.times_released(r) > 1}
    assert not twice, f"requests released more than once on the prefill side: {sorted(twice)}"
    assert not pf.released() - pf.leased, "released requests that were never leased"


@pytest.fixture
def decode() -> Iterator[DecodeSide]:
    d = DecodeSide(64, **DECODE_CFG)
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


def clean_pull_succeeds(d: DecodeSide, pf: PrefillProc) -> None:
    local, remote = [40, 41, 42, 50], [60, 61, 62, 1]
    _, prid, errors, _ = pull(d, pf, local, remote)
    assert errors == set()
    assert_bytes(d, pf, local, remote)
    assert pf.wait_released({prid}, BOUND_S) and pf.times_released(prid) == 1


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
def test_notify_only_send_failure_is_contained(prefill: PrefillProc, decode: DecodeSide, peer_known: bool) -> None:
    """An aborted request's notify-only task whose ``send_notif`` fails: the prefill side falls
    back on its lease; nothing may escape, and the pull queued after it must still run."""
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
    info = fetch_agent_info(HOST, pf.port, 0, "test", fingerprint(COMPAT_FIELDS), timeout_s=5.0, retries=2,
                            engine_id=ENGINE)

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


# ---- shutdown ---------------------------------------------------------------------------------
def _new_threads(before: set[threading.Thread], wait_s: float = 2.0) -> list[threading.Thread]:
    end = time.monotonic() + wait_s
    while True:
        bad = [t for t in threading.enumerate() if t not in before and t.is_alive()
               and (t.name.startswith("p2pkv") or not t.daemon)]
        if not bad or time.monotonic() > end:
            return bad
        time.sleep(0.05)


def test_shutdown_is_idempotent_and_leaves_no_threads(prefill: PrefillProc) -> None:
    before = set(threading.enumerate())
    d = DecodeSide(64, **DECODE_CFG)
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
