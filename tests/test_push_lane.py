"""Push requests that wait on their lane behind a request the prefill rank does not answer.

A decode rank sends its push requests to one prefill rank one at a time over
one connection (the rank's lane), each waiting up to ``handshake_timeout_s``
for its reply. When the prefill rank stops answering (killed and restarted,
or its side-channel thread stalled), the requests queued behind the first
used to wait out each predecessor's timeout in turn: the k-th was sent only
about ``k × handshake_timeout_s`` after it was posted, so its pull timed out
"still in flight" before its request even left — although the prefill rank
was back long before — and, once sent, it granted the prefill rank a full
window from then, past the time the decode rank had handed the pull's
blocks back to vLLM. Now the requests still waiting for the lane are retried
at once after one goes unanswered, and a request's window counts from its
post.

Both tests stall the prefill rank's side-channel thread once, for
:data:`STALL_S`, on the first push request of a batch of :data:`N` pulls.
"""

from __future__ import annotations

import logging
import time

import pytest

from tests.p2p_harness import DecodeSide, PrefillProc, pull_task

N = 6
STALL_S = 2.5
BOUND_S = 20.0
PUSH_CFG = dict(transfer_mode="push", handshake_timeout_s=0.5, transfer_timeout_s=2.0, pull_thread=False)


def batch(d: DecodeSide, pf: PrefillProc, tag: str) -> dict[str, tuple[str, list[int], list[int]]]:
    """Start :data:`N` pulls of 2 blocks each, the first push request stalled :data:`STALL_S` on the prefill
    side; decode request id → (prefill request id, local blocks, remote blocks)."""
    pulls = {f"d-{tag}-{i}": (f"p-{tag}-{i}", [2 * i + 10, 2 * i + 11], [2 * i + 30, 2 * i + 31]) for i in range(N)}
    pf.lease([prid for prid, _, _ in pulls.values()])
    pf.call("delay_next_push", STALL_S)
    d.start(*(pull_task(rid, prid, pf.port, local, remote) for rid, (prid, local, remote) in pulls.items()))
    assert d.pump(set(pulls), BOUND_S) == set(), "a pull hung"
    return pulls


def warm(d: DecodeSide, pf: PrefillProc, tag: str) -> None:
    """One clean pull: the peer is known on both sides, so the batch's requests leave at once."""
    pf.lease([f"p-warm-{tag}"])
    d.start(pull_task(f"d-warm-{tag}", f"p-warm-{tag}", pf.port, [1], [2]))
    assert d.pump({f"d-warm-{tag}"}, BOUND_S) == set() and d.take_errors() == set()
    assert d.block_ok(1, 2, pf.expected())


def test_pushes_queued_behind_an_unanswered_one_are_retried_at_once(prefill: PrefillProc,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Handshakes outlast the stall (6 attempts): every pull of the batch moves its bytes, none times out with
    its request still waiting for the lane (before: the 5th and 6th did, ``READ still in flight``)."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, handshake_attempts=6, **PUSH_CFG)
    try:
        warm(d, prefill, "retried")
        pulls = batch(d, prefill, "retried")
        failures = [r.getMessage() for r in caplog.records if "pull failed" in r.getMessage()]
        assert failures == [] and d.take_errors() == set(), failures
        for prid, local, remote in pulls.values():
            assert all(d.block_ok(lb, rb, prefill.expected()) for lb, rb in zip(local, remote, strict=True)), prid
        assert prefill.wait_released({prid for prid, _, _ in pulls.values()}, BOUND_S)
    finally:
        d.close()


def test_a_push_request_that_waited_for_its_lane_never_writes_blocks_handed_back(prefill: PrefillProc) -> None:
    """Handshakes give up within the stall (one attempt): the pulls fail and their blocks go back to vLLM.
    No WRITE from their holds may end after that (before: the requests sent late were granted a full window
    from when they left, and the prefill rank wrote into blocks handed back half a second earlier)."""
    d = DecodeSide(64, handshake_attempts=1, **PUSH_CFG)
    try:
        warm(d, prefill, "given-up")
        pulls = batch(d, prefill, "given-up")
        time.sleep(STALL_S)  # the stalled thread answers what queued up meanwhile; WRITEs it accepts end soon after
        prefill.drain(1.0)
        for rid, (prid, local, _) in pulls.items():
            pinned = [t for r, answer, t in prefill.pins if r == prid and answer == "held"]
            if not pinned:
                continue
            ended = prefill.unpinned(prid)
            assert set(local) <= d.errors or d.block_ok(local[0], pulls[rid][2][0], prefill.expected()), rid
            if set(local) <= d.errors:
                assert d.finished_at[rid] >= ended, (f"{rid}: a WRITE into its blocks ended "
                                                     f"{ended - d.finished_at[rid]:.2f} s after they were handed back")
    finally:
        d.close()
