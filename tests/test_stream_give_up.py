"""A decode rank giving a layer stream up, and a stream's window, on the prefill side
(:class:`p2pkv.prefill.streams.PrefillStreams` with a real :class:`~p2pkv.prefill.pusher.Pusher` and
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

import os
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from handshake import PROTOCOL_VERSION, StreamRequest
from p2pkv.dataplane.negotiate import ModelInfo, layout_desc
from p2pkv.grant import make_stream_grant
from p2pkv.metadata import P2pKvMetadata, StreamChunk
from p2pkv.notification import PUSH_PREFIX, PushedNotification, parse_pushed
from p2pkv.params import prompt_digest
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.stream_requests import stream_side
from p2pkv.prefill.streamer import LayerStream
from p2pkv.prefill.streams import PrefillStreams
from tests.clock import FakeClock
from tests.push_support import DECODE, ENGINE, KEY, SHAPE, Agents

PID = bytes(range(100, 116))
LAYERS = SHAPE["num_layers"]
MODEL = ModelInfo("BLHNC", "float32", SHAPE["num_heads"], SHAPE["head_dim"], SHAPE["block_size"])
DIGEST = prompt_digest(list(range(31)))  # the decode engine loads all but the prompt's last token
REQ = "prefill-req-1"
DECLINED = "the decode engine declined the stream (it loads nothing of it)"


@dataclass
class Rig:
    """A prefill rank's streams (fake clock) beside the decode agent of ``agents``, and one stream id."""

    agents: Agents
    holds: PrefillHolds
    pusher: Pusher
    streams: PrefillStreams
    clock: FakeClock
    stream_id: str = field(default_factory=lambda: secrets.token_hex(16))
    ended: list[LayerStream] = field(default_factory=list)

    def chunk(self, block_ids: tuple[int, ...], first_block: int = 0, num_tokens: int = 32,
              last: bool = True) -> P2pKvMetadata:
        """One step's metadata with one chunk of REQ (the first chunk carries the digest)."""
        first = first_block == 0
        return P2pKvMetadata(streams=[StreamChunk(REQ, self.stream_id, first_block, block_ids, num_tokens, last,
                                                  DIGEST if first else "", 31 if first else 0)])

    def request(self, block_ids: list[int], window_s: float = 30.0) -> StreamRequest:
        """Rank 0 of DECODE's destination for the stream, sent now."""
        info = msgspec.structs.replace(self.agents.info(), layout=layout_desc(self.agents.decode_layout, MODEL,
                                                                              "HND", mem_type="DRAM"))
        grant = make_stream_grant(ENGINE, DECODE, KEY, time.time() + 60, self.stream_id)
        return StreamRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=ENGINE, to_rank=0, sent_at=time.time(),
                             nonce=os.urandom(16), requester_engine_id=DECODE, grant=grant, block_ids=block_ids,
                             first_block=0, num_tokens=31, prompt_digest=DIGEST, push_id=PID, agent=info,
                             window_s=window_s)

    def step(self, meta: P2pKvMetadata) -> None:
        """The forward of ``meta``'s step: every layer done, then the step's end."""
        self.streams.prepare(meta)
        for layer in range(LAYERS):
            self.streams.save_layer(f"layers.{layer}", meta)
        self.streams.end_step()

    def landed(self, pairs: dict[int, int], layers: Iterable[int]) -> bool:
        """Layers ``layers`` of decode blocks ``pairs.values()`` hold the prefill's ``pairs.keys()``; all else 0."""
        want = torch.zeros_like(self.agents.target)
        for src, dst in pairs.items():
            for layer in layers:
                want[dst, layer] = self.agents.source[src, layer]
        return torch.equal(self.agents.target, want)

    def wait_landed(self, pairs: dict[int, int], layers: Iterable[int], timeout_s: float = 10.0) -> None:
        layers, deadline = list(layers), time.monotonic() + timeout_s
        while not self.landed(pairs, layers):
            assert time.monotonic() < deadline, f"layers {layers} of {pairs} did not land"
            self.agents.decode.progress()
            time.sleep(0.001)

    def notes(self, timeout_s: float = 10.0) -> list[PushedNotification]:
        """The "pushed" notifications the decode agent received (waits up to ``timeout_s`` for the first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.agents.decode.progress()
            got = [parse_pushed(m, KEY) for m in self.agents.decode.take_notifs(PUSH_PREFIX)]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.002)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Collect until no stream is left (the ended ones recorded in :attr:`ended`)."""
        deadline = time.monotonic() + timeout_s
        while self.streams._live:
            assert time.monotonic() < deadline, "a stream did not end"
            self.agents.decode.progress()
            self.streams.collect()
            time.sleep(0.002)

    def starting(self) -> int:
        """Streams (destinations) that keep rank 0 of DECODE loaded now."""
        entry = self.pusher._agents.get((DECODE, 0))
        return 0 if entry is None else entry.starting


@pytest.fixture
def rig(agents: Agents) -> Iterator[Rig]:
    agents.target.zero_()
    agents.decode.take_notifs(PUSH_PREFIX)  # notes an earlier test left; kept apart from now on
    holds = PrefillHolds(lease_s=30.0)
    pusher = Pusher(agents.prefill, holds, agents.layout, KEY)
    clock = FakeClock()
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    streams = PrefillStreams(ENGINE, agents.prefill, holds, pusher, source,
                             {f"layers.{i}": i for i in range(LAYERS)}, KEY, clock=clock)
    made = Rig(agents, holds, pusher, streams, clock)
    take_ended = streams.poster.take_ended

    def recorded() -> list[LayerStream]:
        got = take_ended()
        made.ended.extend(got)
        return got

    streams.poster.take_ended = recorded  # type: ignore[method-assign]
    try:
        yield made
    finally:
        streams.close()
        pusher.close()


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
    assert rig.holds._pins == {} and rig.starting() == 0
    (stream,) = rig.ended
    assert stream.counters.layers_posted == ([0] if stops else [0, 1])
    assert rig.landed({3: 5, 4: 6}, [0] if stops else range(LAYERS))
    assert rig.notes(timeout_s=0.1) == []


@pytest.mark.parametrize(("requester", "drops"), [("decode-engine:0", True), ("decode-engine:1", False)],
                         ids=["destination_rank", "other_rank"])
def test_a_destination_released_before_its_request_is_known_is_dropped(rig: Rig, requester: str,
                                                                       drops: bool) -> None:
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")  # no chunk of its request yet
    assert rig.starting() == 1
    assert rig.streams.on_release([rig.stream_id], [[]], requester) == int(drops)
    assert rig.starting() == (0 if drops else 1), "a dropped destination keeps its decode agent loaded"
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
    assert rig.starting() == 0


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
    assert rig.notes(timeout_s=0.1) == [] and rig.starting() == 0


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
    assert rig.starting() == 0 and torch.count_nonzero(rig.agents.target) == 0


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
