"""Which destinations a prefill rank takes for one stream id (:class:`p2pkv.prefill.stream_ledger.StreamLedger`):
one per decode rank that reads it, all from one decode engine that says the same number of readers, none from a
rank that already gave one, none after a decline; and on a real prefill rank, a second destination from the same
decode rank is refused while the first stream lands.
"""

from __future__ import annotations

import time

import pytest

from p2pkv.metadata import P2pKvMetadata
from p2pkv.notification import PushedNotification
from p2pkv.prefill.stream_ledger import StreamLedger
from tests.clock import FakeClock
from tests.push_support import DECODE, Agents
from tests.stream_rig import LAYERS, PID, REQ, open_rig

SID = "ab" * 16


@pytest.mark.parametrize(("rank", "readers", "why"), [
    (("decode", 0), 2, "already had a destination from decode rank decode:0"),
    (("decode", 1), 3, "read by 2 rank(s) of decode engine decode; this destination says 3 of decode"),
    (("other", 1), 2, "read by 2 rank(s) of decode engine decode; this destination says 2 of other"),
])
def test_a_second_destination_must_come_from_another_rank_of_the_same_engine(rank: tuple[str, int], readers: int,
                                                                             why: str) -> None:
    ledger = StreamLedger(FakeClock())
    assert ledger.refuse(SID, ("decode", 0), 2) is None
    ledger.serve(SID, 1e12, ("decode", 0), 2)
    assert why in (ledger.refuse(SID, rank, readers) or "")


def test_a_stream_takes_as_many_destinations_as_its_readers_and_none_after_a_decline() -> None:
    ledger = StreamLedger(FakeClock())
    for tp_rank in range(2):
        assert ledger.refuse(SID, ("decode", tp_rank), 2) is None
        ledger.serve(SID, 1e12, ("decode", tp_rank), 2)
    assert "already has its 2 destination(s)" in (ledger.refuse(SID, ("decode", 2), 2) or "")
    ledger.serve("cd" * 16, 1e12)  # declined
    assert "or was declined" in (ledger.refuse("cd" * 16, ("decode", 0), 1) or "")
    ledger.forget_expired(2e12)
    assert ledger.refuse(SID, ("decode", 0), 2) is None, "an expired grant's id is forgotten"


def test_a_second_destination_from_the_same_decode_rank_is_refused_and_the_first_stream_lands(
        agents: Agents) -> None:
    with open_rig(agents) as rig:
        meta = rig.chunk((3, 4))
        rig.streams.prepare(meta)
        assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
        status, why = rig.streams.on_stream(rig.request([7, 8]))
        assert status == "refused" and "already had a destination from decode rank" in why
        rig.step(meta)
        assert rig.notes() == [PushedNotification(PID, True)]
        rig.settle()
        assert rig.landed({3: 5, 4: 6}, range(LAYERS)), "the refused destination's blocks were written"


def test_a_stream_two_ranks_read_keeps_its_hold_until_the_other_comes_or_the_lease_ends(agents: Agents) -> None:
    """One of two reading ranks sent its destination: its stream lands, but the hold stays (the other rank's
    stream would read it) until the lease ends; then the stream id is closed to late destinations."""
    with open_rig(agents) as rig:
        meta = rig.chunk((3, 4))
        rig.streams.prepare(meta)
        assert rig.streams.on_stream(rig.request([5, 6], readers=2)) == ("accepted", "")
        rig.step(meta)
        assert rig.notes() == [PushedNotification(PID, True)]
        rig.holds.hold(REQ, time.monotonic() + 600, (3, 4))
        rig.streams.begin_step(P2pKvMetadata(send_leases={REQ: time.monotonic() + 600}, send_blocks={REQ: (3, 4)}))
        rig.settle_ended(1)
        assert rig.landed({3: 5, 4: 6}, range(LAYERS))
        assert rig.holds.released([], {"leases_expired": 0, "leases_notified": 0}) == set(), "freed too early"
        assert rig.holds._pins == {}, "nothing WRITEs from it now: the lease may end it"
        rig.streams.holds_ended({REQ})  # what the worker calls when the lease ran out
        assert REQ not in rig.streams._live
        status, why = rig.streams.on_stream(rig.request([7, 8], readers=2))
        assert status == "refused" and "stopped before this destination came" in why, why


def test_a_reading_rank_that_gives_up_before_its_destination_frees_the_hold_once_the_others_landed(
        agents: Agents) -> None:
    """Two ranks read this one; rank 1's load failed before it sent a destination (it sends a release of the
    stream id): once rank 0's stream has landed, the request waits for nobody and its hold is freed."""
    with open_rig(agents) as rig:
        meta = rig.chunk((3, 4))
        rig.streams.prepare(meta)
        assert rig.streams.on_stream(rig.request([5, 6], readers=2)) == ("accepted", "")
        assert rig.streams.on_release([rig.stream_id], [[]], "other-engine:1") == 0, "another engine's rank"
        rig.step(meta)
        assert rig.notes() == [PushedNotification(PID, True)]
        rig.holds.hold(REQ, time.monotonic() + 600, (3, 4))
        rig.streams.begin_step(P2pKvMetadata(send_leases={REQ: time.monotonic() + 600}, send_blocks={REQ: (3, 4)}))
        rig.settle_ended(1)
        assert REQ in rig.streams._live, "rank 1 may still send its destination"
        assert rig.streams.on_release([rig.stream_id], [[]], f"{DECODE}:1") == 1
        assert REQ not in rig.streams._live
        assert rig.holds.released([], {"leases_expired": 0, "leases_notified": 0}) == {REQ}
