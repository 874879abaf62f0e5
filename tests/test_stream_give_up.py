"""A decode rank giving a layer stream up, and a stream's window, on the prefill side
(:class:`p2pkv.prefill.prefill_streams.PrefillStreams` with a real :class:`~p2pkv.prefill.pusher.Pusher` and
:class:`~p2pkv.prefill.holds.PrefillHolds`, over two real NIXL agents in this process: UCX moves host memory).

* A release of the stream id with no block ids from the decode rank that holds the stream's destination stops
  the running stream: that rank is told ``ok=False``, and no layer computed afterwards lands in its blocks. The
  same release from another rank or engine changes nothing: the stream ends normally.
* A destination released by its own rank before its request is known here is dropped: when the request's first
  chunk comes, its stream stops with nothing written.
* A destination's window (``window_s`` from receipt) stops a stream still waiting for layers.
* A destination that never comes: the hold's lease ends the stream, and a destination coming after that is
  refused at once.

Every test compares the decode cache's bytes with the prefill cache's, layer by layer and block by block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from p2pkv.metadata import P2pKvMetadata
from p2pkv.notification import PushedNotification
from p2pkv.prefill.write_engine import Pace
from tests.push_support import Agents
from tests.stream_rig import LAYERS, PID, REQ, Rig, open_rig

DECLINED = "the decode engine declined the stream (it loads nothing of it)"


@pytest.fixture
def rig(agents: Agents) -> Iterator[Rig]:
    with open_rig(agents) as made:
        yield made


@pytest.mark.parametrize(("requester", "stops"), [("decode-engine:0", True), ("decode-engine:1", False),
                                                  ("other-engine:0", False)],
                         ids=["destination_rank", "other_rank", "other_engine"])
def test_a_release_by_the_destinations_rank_stops_a_running_stream(rig: Rig, requester: str, stops: bool) -> None:
    meta = rig.chunk((3, 4))
    rig.streams.prepare(meta)
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
    rig.streams.save_layer("layers.0", meta)
    rig.wait_landed({3: 5, 4: 6}, [0])  # the stream runs: layer 0 is in the decode blocks
    assert rig.streams.on_release([rig.stream_id], [[]], requester) == int(stops)
    rig.streams.save_layer("layers.1", meta)  # computed after the release
    rig.streams.end_step()
    (note,) = rig.notes()
    if stops:
        assert note.push_id == PID and not note.ok and "gave the load up" in note.reason, note
    else:
        assert note == PushedNotification(PID, True)
    # the request's hold (made as it finished) is pinned by the stream, then freed once it has ended
    rig.holds.hold(REQ, time.monotonic() + 600, (3, 4))
    rig.streams.begin_step(P2pKvMetadata(send_leases={REQ: time.monotonic() + 600}, send_blocks={REQ: (3, 4)}))
    rig.settle()
    assert rig.holds.released([], {"leases_expired": 0, "leases_notified": 0}) == {REQ}
    assert rig.holds._pins == {} and rig.streams_held() == 0
    (stream,) = rig.ended
    assert stream.counters.layers_posted == ([0] if stops else [0, 1])
    assert rig.landed({3: 5, 4: 6}, [0] if stops else range(LAYERS))
    assert rig.notes(timeout_s=0.1) == []


@pytest.mark.parametrize(("requester", "drops"), [("decode-engine:0", True), ("decode-engine:1", False)],
                         ids=["destination_rank", "other_rank"])
def test_a_destination_released_before_its_request_is_known_is_dropped(rig: Rig, requester: str,
                                                                       drops: bool) -> None:
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")  # no chunk of its request yet
    assert rig.streams_held() == 1
    assert rig.pusher.turn(rig.clock(), False) is Pace.IDLE, "a stream's agent held gives the pusher nothing to poll"
    assert rig.streams.on_release([rig.stream_id], [[]], requester) == int(drops)
    assert rig.streams_held() == (0 if drops else 1), "a dropped destination keeps its decode agent loaded"
    rig.step(rig.chunk((3, 4)))
    rig.settle()
    (stream,) = rig.ended
    if drops:
        assert stream.failure == DECLINED and stream.counters.writes == 0
        assert rig.notes(timeout_s=0.3) == [], "a stream without a destination tells nobody"
        assert torch.count_nonzero(rig.agents.target) == 0
    else:
        assert stream.failure is None and rig.notes() == [PushedNotification(PID, True)]
        assert rig.landed({3: 5, 4: 6}, range(LAYERS))
    assert rig.streams_held() == 0


def test_a_stream_whose_window_passes_while_it_waits_for_layers_stops(rig: Rig) -> None:
    first = rig.chunk((3,), num_tokens=16, last=False)  # chunked prefill: prompt block 0 now, block 1 next step
    rig.streams.prepare(first)
    assert rig.streams.on_stream(rig.request([5, 6], window_s=5.0)) == ("accepted", "")
    rig.step(first)
    rig.wait_landed({3: 5}, range(LAYERS))
    assert rig.notes(timeout_s=0.2) == [], "the stream stopped before its window passed"
    rig.clock.now += 6.0  # the decode rank gives the load up now
    (note,) = rig.notes()
    assert note.push_id == PID and not note.ok and "window passed" in note.reason, note
    rig.step(rig.chunk((4,), first_block=1))  # the second chunk's layers, computed after the window
    rig.settle()
    (stream,) = rig.ended
    assert "window passed" in (stream.failure or "") and stream.counters.layers_posted == [0, 1]
    assert rig.landed({3: 5}, range(LAYERS)), "a layer was written after the window"
    assert rig.notes(timeout_s=0.1) == [] and rig.streams_held() == 0


def test_a_destination_that_never_comes_ends_with_the_hold_and_a_late_one_is_refused_at_once(rig: Rig) -> None:
    """The prefill finished, its hold was made, no destination came before the hold's lease ended: the stream
    stops and tells nobody; a destination that comes after that is refused at once, naming why (the decode
    rank fails its load then, not at its window)."""
    meta = rig.chunk((3, 4))
    rig.step(meta)
    rig.holds.hold(REQ, time.monotonic() + 600, (3, 4))
    rig.streams.begin_step(P2pKvMetadata(send_leases={REQ: time.monotonic() + 600}, send_blocks={REQ: (3, 4)}))
    rig.streams.holds_ended({REQ})  # what the worker calls when the lease ran out
    rig.settle()
    (stream,) = rig.ended
    assert "hold ended before the decode rank's destination arrived" in (stream.failure or "")
    assert stream.counters.writes == 0 and rig.notes(timeout_s=0.2) == []
    status, why = rig.streams.on_stream(rig.request([5, 6]))
    assert status == "refused" and "stopped before this destination came" in why and "hold ended" in why, why
    assert rig.streams_held() == 0 and torch.count_nonzero(rig.agents.target) == 0


def test_a_stream_id_with_a_destination_here_is_answered_held_and_others_are_the_holds(rig: Rig) -> None:
    """A decode rank waiting for a stream asks whether this rank knows it (p2pkv.decode.stream_watch): known once
    its destination came (before and after its request, until the grant expires), unknown before; other ids in
    the same question are the holds' to answer."""
    assert rig.streams.on_heartbeat([rig.stream_id], 10.0, [[]]).unknown == [rig.stream_id]
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
    status = rig.streams.on_heartbeat([rig.stream_id, "never-held"], 10.0, [[], []])
    assert (status.unknown, status.expired, status.not_held) == (["never-held"], [], [])
    rig.step(rig.chunk((1, 2)))
    rig.wait_landed({1: 5, 2: 6}, range(LAYERS))
    rig.settle()
    assert rig.streams.on_heartbeat([rig.stream_id], 10.0, []).unknown == []  # ended, still known
