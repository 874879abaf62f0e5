"""The link rule (:mod:`p2pkv.prefill.stream_measures`): a layer-streamed request goes as one WRITE after its last
layer where its decode rank's link moves a layer in less than ``MIN_LINK_SHARE`` of the forward's time for
it, measured per block of one layer from the layers' report times and from earlier streams' WRITEs.

The arithmetic on a fake clock, then the rule as a prefill rank applies it, over two real NIXL agents in this
process: the first stream to a decode rank goes layer by layer and measures the link; the next one goes as the
rule says, its bytes landed either way.
"""

from __future__ import annotations

import secrets
import time

import pytest

from p2pkv.dataplane.layout import Segment
from p2pkv.prefill import stream_measures
from p2pkv.prefill.layer_stream import LayerStream, StreamSide
from p2pkv.prefill.stream_measures import WEIGHT, StreamMeasures, layer_block_bytes
from tests.clock import FakeClock
from tests.push_support import Agents
from tests.stream_rig import LAYERS, PID, Rig, open_rig

RANK = "decode-engine:0"


def _side(block_bytes: int = 1000, layers: int = 4) -> StreamSide:
    """Per-layer K and V pages of ``block_bytes / 2`` bytes each."""
    pages = tuple(Segment(addr=0, length=block_bytes // 2, block_stride=block_bytes // 2, layer_start=layer,
                          num_layers=1, kv_index=kv) for layer in range(layers) for kv in (0, 1))
    return StreamSide(pages, num_blocks=64)


def _landed(num_bytes: int, busy_s: float, failure: str | None = None) -> LayerStream:
    """A stream that moved ``num_bytes`` in ``busy_s`` seconds of WRITEs in flight, 0.5 s after its last layer."""
    stream = LayerStream("req", _side(), writer=None)  # type: ignore[arg-type]
    counters = stream.counters
    counters.bytes, counters.busy_s = num_bytes, busy_s
    counters.finished, counters.notified = 10.0, 10.5
    stream.failure = failure
    return stream


def _forward(measures: StreamMeasures, clock: FakeClock, layer_s: float, layers: int, blocks: int) -> None:
    """One step whose ``layers`` layers were reported ``layer_s`` seconds apart, computing ``blocks`` blocks."""
    for _ in range(layers):
        measures.layer_done()
        clock.now += layer_s
    measures.step_ended(blocks)


def test_layer_block_bytes_is_a_blocks_k_and_v_of_one_layer() -> None:
    assert layer_block_bytes(_side(block_bytes=1000, layers=4)) == 1000
    with pytest.raises(ValueError, match="without pages"):
        layer_block_bytes(StreamSide((), num_blocks=1))


@pytest.mark.parametrize(("min_share", "per_layer"), [(0.1, False), (0.01, True), (0.0, True)])
def test_the_rule_compares_a_layers_link_time_with_its_forward_time_per_block(min_share: float,
                                                                              per_layer: bool) -> None:
    clock = FakeClock()
    measures = StreamMeasures(min_share, block_bytes=1000, clock=clock)
    _forward(measures, clock, layer_s=0.1, layers=4, blocks=2)  # 0.05 s per block of one layer
    measures.ended(_landed(num_bytes=1_000_000, busy_s=1.0), RANK)  # 1 MB/s: 1 ms per block of one layer
    assert measures.share(RANK) == pytest.approx(0.02)
    assert measures.per_layer(RANK) is per_layer
    assert measures.take_tails() == [pytest.approx(0.5)] and measures.take_tails() == []


def test_a_rank_streams_layer_by_layer_until_both_speeds_are_measured() -> None:
    clock = FakeClock()
    measures = StreamMeasures(100.0, block_bytes=1000, clock=clock)
    assert measures.share(RANK) is None and measures.per_layer(RANK)
    measures.ended(_landed(num_bytes=1_000_000, busy_s=1.0), RANK)
    assert measures.share(RANK) is None and measures.per_layer(RANK), "the forward is not measured yet"
    _forward(measures, clock, layer_s=0.1, layers=4, blocks=2)
    assert not measures.per_layer(RANK) and measures.per_layer("decode-engine:1"), "one rank's link is its own"


def test_what_measures_nothing_changes_nothing() -> None:
    clock = FakeClock()
    measures = StreamMeasures(0.1, block_bytes=1000, clock=clock)
    _forward(measures, clock, layer_s=0.1, layers=1, blocks=2)  # one layer: no interval between layers
    _forward(measures, clock, layer_s=0.1, layers=4, blocks=0)  # no streamed block
    measures.ended(_landed(num_bytes=1_000_000, busy_s=1.0, failure="stopped"), RANK)  # did not land whole
    measures.ended(_landed(num_bytes=0, busy_s=0.0), RANK)  # nothing in flight (a prompt the decode has cached)
    assert measures._forward_s is None and measures._link_bps == {}
    assert measures.take_tails() == [pytest.approx(0.5)], "only a stream that landed gives its tail"
    assert measures.take_landed() == {"per_layer": 1, "whole": 0} and measures.take_landed()["per_layer"] == 0


def test_the_speeds_are_exponentially_weighted_means() -> None:
    clock = FakeClock()
    measures = StreamMeasures(0.1, block_bytes=1000, clock=clock)
    _forward(measures, clock, layer_s=0.1, layers=3, blocks=1)
    _forward(measures, clock, layer_s=0.2, layers=3, blocks=1)
    assert measures._forward_s == pytest.approx((1 - WEIGHT) * 0.1 + WEIGHT * 0.2)
    measures.ended(_landed(num_bytes=1000, busy_s=1.0), RANK)
    measures.ended(_landed(num_bytes=3000, busy_s=1.0), RANK)
    assert measures._link_bps[RANK] == pytest.approx((1 - WEIGHT) * 1000 + WEIGHT * 3000)


def test_the_links_of_the_least_recently_measured_ranks_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_measures, "MAX_RANKS", 2)
    measures = StreamMeasures(0.1, block_bytes=1000, clock=FakeClock())
    for rank in ("a:0", "b:0", "a:0", "c:0"):
        measures.ended(_landed(num_bytes=1000, busy_s=1.0), rank)
    assert list(measures._link_bps) == ["a:0", "c:0"]


def _stream_one(rig: Rig, layer_s: float) -> LayerStream:
    """Stream the rig's request into decode blocks 5, 6 from prefill blocks 3, 4, its layers reported ``layer_s``
    seconds apart (the destination known first), and return it once it has ended."""
    rig.agents.target.zero_()
    rig.stream_id = secrets.token_hex(16)
    meta = rig.chunk((3, 4))
    rig.streams.prepare(meta)
    assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
    for layer in range(LAYERS):
        rig.streams.save_layer(f"layers.{layer}", meta)
        time.sleep(layer_s)
    rig.streams.end_step()
    assert [(n.push_id, n.ok) for n in rig.notes()] == [(PID, True)]
    rig.settle()
    assert rig.landed({3: 5, 4: 6}, range(LAYERS))
    return rig.ended[-1]


@pytest.mark.parametrize(("min_share", "per_layer"), [(100.0, False), (1e-9, True)], ids=["one_write", "per_layer"])
def test_the_next_stream_to_a_measured_rank_goes_as_the_link_rule_says(agents: Agents, min_share: float,
                                                                       per_layer: bool) -> None:
    """Layers 20 ms apart, two blocks each: the forward takes 10 ms per block of one layer, the link over UCX's
    host-memory copy far less, a share far under 100 and far over 1e-9."""
    with open_rig(agents, clock=time.monotonic, min_link_share=min_share) as rig:
        first = _stream_one(rig, layer_s=0.02)
        assert first.counters.writes == LAYERS and not first.bulk, "an unmeasured link streams layer by layer"
        assert first.counters.busy_s > 0
        share = rig.streams.measures.share(RANK)
        assert share is not None and 1e-9 < share < 100.0
        second = _stream_one(rig, layer_s=0.02)
        assert second.counters.writes == (LAYERS if per_layer else 1)
        assert second.bulk is not per_layer
        assert rig.streams.measures.take_landed() == {"per_layer": 1 + per_layer, "whole": int(not per_layer)}
