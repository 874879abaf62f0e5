"""What a prefill rank does with stream ids it did not choose: one request per stream id, bounded waits per decode
rank, no stream kept past its grant (:class:`p2pkv.prefill.prefill_streams.PrefillStreams` with a real
:class:`~p2pkv.prefill.pusher.Pusher` and :class:`~p2pkv.prefill.holds.PrefillHolds`, over two real NIXL agents
in this process).

* A chunk of another request naming a stream id that already serves a request here is not streamed: the
  honest stream keeps its destination and lands (before, the stream id was moved to the newest request, the
  honest destination attached to it, the digests differed and the honest load failed).
* Destinations for stream ids the rank knows nothing of wait at most ``UNKNOWN_WAIT_S``, at most
  ``MAX_UNKNOWN_PER_RANK`` per decode rank, and are told when they are dropped; a destination for a stream
  the rank runs or has admitted is never turned away for room.
* A stream refused by the scheduler, or whose request was aborted before its first chunk, refuses and tells
  its destinations at once; a stream that had no destination by its grant's expiry ends, freeing its hold.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

from p2pkv.metadata import P2pKvMetadata, StreamChunk
from p2pkv.notification import PushedNotification
from p2pkv.params import CLOCK_SKEW_S
from p2pkv.prefill.stream_pending import MAX_UNKNOWN_PER_RANK, UNKNOWN_WAIT_S
from p2pkv.prompt_digest import prompt_digest
from tests.push_support import Agents
from tests.stream_rig import LAYERS, PID, REQ, Rig, open_rig


@pytest.fixture
def rig(agents: Agents) -> Iterator[Rig]:
    with open_rig(agents) as made:
        yield made


def _released(rig: Rig) -> set[str]:
    return rig.holds.released([], {"leases_expired": 0, "leases_notified": 0})


def test_a_chunk_of_another_request_never_takes_a_stream_id_over_and_the_honest_stream_lands(rig: Rig) -> None:
    honest = rig.chunk((3, 4))
    rig.streams.prepare(honest)
    replay = P2pKvMetadata(streams=[StreamChunk("replayed-req", rig.stream_id, 0, (7, 8), 32, True,
                                                prompt_digest(list(range(5, 36))), 31)])
    rig.streams.prepare(replay)  # a replayed grant that reached the workers (the scheduler refuses it first)
    assert "replayed-req" not in rig.streams._live
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
    rig.step(honest)
    rig.wait_landed({3: 5, 4: 6}, range(LAYERS))
    assert rig.notes() == [PushedNotification(PID, True)]
    rig.settle()


def test_a_flood_of_destinations_for_unknown_streams_fills_only_its_share_and_is_told_within_seconds(
        rig: Rig) -> None:
    known = rig.chunk((3, 4))
    rig.streams.prepare(known)
    honest_id = rig.stream_id
    for i in range(MAX_UNKNOWN_PER_RANK):
        rig.stream_id = secrets.token_hex(16)
        assert rig.streams.on_stream(rig.request([10 + i % 4])) == ("accepted", ""), i
    rig.stream_id = secrets.token_hex(16)
    status, why = rig.streams.on_stream(rig.request([12]))
    assert status == "busy" and f"{MAX_UNKNOWN_PER_RANK} destinations from decode rank" in why, why
    rig.stream_id = honest_id  # the stream this rank runs: never turned away for room
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
    rig.clock.now += UNKNOWN_WAIT_S + 0.1
    rig.streams.collect()
    told = rig.notes()
    deadline = time.monotonic() + 5
    while len(told) < MAX_UNKNOWN_PER_RANK and time.monotonic() < deadline:
        told += rig.notes(timeout_s=0.2)
    assert len(told) == MAX_UNKNOWN_PER_RANK and all(not n.ok and "no prefill request for stream" in n.reason
                                                    for n in told), told[:3]
    rig.step(known)
    rig.wait_landed({3: 5, 4: 6}, range(LAYERS))
    assert rig.notes() == [PushedNotification(PID, True)]
    rig.settle()
    assert rig.streams._pending.waiting() == 0 and rig.streams_held() == 0


def _admit(rig: Rig, expires_in_s: float = 60.0) -> None:
    rig.streams.prepare(P2pKvMetadata(stream_admits={REQ: (rig.stream_id, time.time() + expires_in_s)}))


def test_an_admitted_streams_destination_waits_its_window_and_an_abort_before_its_first_chunk_tells_it(
        rig: Rig) -> None:
    _admit(rig)
    assert rig.streams.on_stream(rig.request([5, 6], window_s=30.0)) == ("accepted", "")
    rig.clock.now += UNKNOWN_WAIT_S + 1  # its request is queued here: its destination waits on
    rig.streams.collect()
    assert rig.notes(timeout_s=0.2) == [] and rig.streams._pending.waiting() == 1
    rig.streams.prepare(P2pKvMetadata(stream_aborts={REQ: "the prefill request was aborted"}))
    (note,) = rig.notes()
    assert not note.ok and "aborted" in note.reason and rig.streams_held() == 0
    status, why = rig.streams.on_stream(rig.request([5, 6]))
    assert status == "refused" and "stopped before this destination came" in why, why


def test_a_stream_the_scheduler_refused_refuses_its_destination_at_once(rig: Rig) -> None:
    rig.streams.prepare(P2pKvMetadata(stream_refusals={rig.stream_id: "12 blocks more would pass "
                                                                      "max_held_fraction=0.5 (8 blocks)"}))
    status, why = rig.streams.on_stream(rig.request([5, 6]))
    assert status == "refused" and "max_held_fraction" in why, why
    assert rig.streams_held() == 0


def test_a_stream_without_a_destination_ends_when_its_grant_expires_and_frees_its_hold(rig: Rig) -> None:
    _admit(rig, expires_in_s=20.0)
    meta = rig.chunk((3, 4))
    rig.step(meta)
    rig.holds.hold(REQ, time.monotonic() + 600, (3, 4))  # the holds' clock is the real one
    rig.streams.begin_step(P2pKvMetadata(send_leases={REQ: time.monotonic() + 600}, send_blocks={REQ: (3, 4)}))
    rig.streams.collect()
    assert _released(rig) == set(), "held while a destination may still come"
    rig.clock.now += 20.0 + CLOCK_SKEW_S + 1
    rig.settle()
    (stream,) = rig.ended
    assert "grant expired" in (stream.failure or "") and stream.counters.writes == 0
    assert _released(rig) == {REQ}, "the hold outlived the only transfer it could serve"
