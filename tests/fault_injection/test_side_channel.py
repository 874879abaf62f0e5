"""Faults on the side channel (a peer that is silent, answers garbage, echoes, answers late or replays) and
on the "done" notifications (a send or a poll that fails, a notify-only task): each pull fails cleanly or
succeeds, and nothing escapes ``get_finished``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

from handshake import PROTOCOL_VERSION, HoldQuery, HoldsReply, encode
from handshake import decode as decode_message
from tests.fault_injection.support import (
    BOUND_S,
    assert_bytes,
    clean_pull_succeeds,
    fake_side_channel,
    new_ids,
    pull,
    real_reply,
)
from tests.faults import inject
from tests.p2p_harness import DecodeSide, PrefillProc, notify_task, pull_task


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



ZMQ_TIMEOUT_S, ZMQ_ATTEMPTS = 0.4, 2
ZMQ_BOUND_S = ZMQ_ATTEMPTS * ZMQ_TIMEOUT_S + 0.2 + 2.0  # attempts + backoff + slack for a loaded machine

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
    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_attempts=ZMQ_ATTEMPTS, transfer_mode="pull")
    try:
        with fake_side_channel(respond, delay) as (port, seen):  # type: ignore[arg-type]
            local, remote = [11, 12, 13], [1, 2, 3]
            _, _, errors, seconds = pull(d, prefill, local, remote, engine_port=port, engine=f"fake-{case}")
            assert seen, "the fake side channel never got a request"
        assert errors == set(local)
        assert seconds < ZMQ_BOUND_S, f"failing took {seconds:.2f} s"
        assert d.worker.receiver.peers.peers == {} and d.worker.receiver.peers.handshakes == {}
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

    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_attempts=ZMQ_ATTEMPTS, transfer_mode="pull")
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
    d = DecodeSide(64, handshake_timeout_s=ZMQ_TIMEOUT_S, handshake_attempts=ZMQ_ATTEMPTS, transfer_mode="pull")
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
