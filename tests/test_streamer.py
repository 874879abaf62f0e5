"""Layer-streamed WRITEs (:mod:`p2pkv.prefill.layer_stream`) and their rows by layer (:mod:`p2pkv.dataplane.layers`).

The streams run over two real NIXL agents in this process (UCX moves host
memory), and every test compares the decode cache's bytes with the prefill
cache's, layer by layer and block by block: the blocks asked for hold the
prefill's values, every other block is still zero. A fake writer is used only
to inject a failed WRITE or one NIXL would not cancel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layers import layer_rows, page_segments
from p2pkv.dataplane.layout import LayoutError, Segment
from p2pkv.dataplane.plan import PlanError
from p2pkv.notification import PUSH_PREFIX, PushedNotification
from p2pkv.prefill.layer_stream import LayerStream, StreamSide, StreamState, StreamTarget
from p2pkv.prefill.poster import StreamPoster
from p2pkv.prefill.prefill_streams import MEASURED_MIN_TOKENS, measured_min_tokens
from p2pkv.prefill.write_engine import WriteEngine
from tests.stream_pair import BLOCKS, KEY, LAYERS, PAGE, PUSH_ID, Pair, drain, ended_on, kv_layout, open_pair

# --- rows by layer -------------------------------------------------------------------------------------------------


def test_a_cross_layer_block_cuts_into_one_page_per_layer() -> None:
    _, _, layout = kv_layout("BLHNC", fill=0.0)
    (seg,) = layout.segments
    pages = page_segments(layout.segments, PAGE)
    assert [(p.addr - seg.addr, p.length, p.layer_start, p.block_stride) for p in pages] == [
        (q * PAGE, PAGE, q, seg.block_stride) for q in range(LAYERS)]
    _, _, split = kv_layout("KV_SPLIT", fill=0.0)
    half = page_segments(split.segments, PAGE // 2)
    assert [(p.layer_start, p.kv_index) for p in half] == [(q, kv) for q in range(LAYERS) for kv in (0, 1)]
    with pytest.raises(LayoutError, match="not one 3-B page per layer"):
        page_segments(layout.segments, 3)
    with pytest.raises(LayoutError, match=r"one .* page per layer"):  # layers interleaved inside a page
        page_segments([Segment(0, 2 * PAGE, 4 * PAGE, 0, 4)], PAGE)


def test_rows_by_layer_pair_up_and_cost_one_row_per_block_in_a_cross_layer_cache() -> None:
    _, _, cross = kv_layout("BLHNC", fill=0.0)
    _, _, per_layer = kv_layout("LBHNC", fill=0.0)
    src_ids, dst_ids = [3, 4, 5, 9], [10, 11, 12, 2]
    rows = layer_rows(page_segments(cross.segments, PAGE), page_segments(per_layer.segments, PAGE), src_ids, dst_ids,
                      source_num_blocks=BLOCKS, target_num_blocks=BLOCKS, target_device=1)
    assert [r.layer for r in rows] == list(range(LAYERS))
    for r in rows:
        assert r.source.shape == r.target.shape == (4, 3)  # cross-layer pages stride by the block: one row each
        assert np.array_equal(r.source[:, 1], r.target[:, 1]) and r.num_bytes == 4 * PAGE
        assert set(r.target[:, 2].tolist()) == {1}
    both_per_layer = layer_rows(page_segments(per_layer.segments, PAGE), page_segments(per_layer.segments, PAGE),
                                src_ids, dst_ids, source_num_blocks=BLOCKS, target_num_blocks=BLOCKS)
    assert [r.source.shape[0] for r in both_per_layer] == [2] * LAYERS  # runs 3-5→10-12 and 9→2 coalesce
    _, _, split = kv_layout("KV_SPLIT", fill=0.0)
    with pytest.raises(PlanError, match="pages per block"):
        layer_rows(page_segments(split.segments, PAGE // 2), page_segments(cross.segments, PAGE), [1], [1],
                   source_num_blocks=BLOCKS, target_num_blocks=BLOCKS)
    with pytest.raises(PlanError, match="repeat"):
        layer_rows(page_segments(cross.segments, PAGE), page_segments(cross.segments, PAGE), [1, 2], [5, 5],
                   source_num_blocks=BLOCKS, target_num_blocks=BLOCKS)
    with pytest.raises(PlanError, match=f"outside \\[0, {BLOCKS}\\)"):
        layer_rows(page_segments(cross.segments, PAGE), page_segments(cross.segments, PAGE), [BLOCKS], [0],
                   source_num_blocks=BLOCKS, target_num_blocks=BLOCKS)


# --- streams over NIXL ---------------------------------------------------------------------------------------------



@pytest.fixture
def stream_pair() -> Iterator[Pair]:
    with open_pair() as made:
        yield made


class Flag:
    """A ``ready`` test the test flips (an event recorded after a layer, on a GPU)."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> bool:
        return self.set


def test_each_layer_is_written_once_ready_and_the_last_write_carries_the_notification(stream_pair: Pair) -> None:
    src, dst = [5, 6, 7, 20], [0, 1, 2, 9]
    stream = stream_pair.stream()
    stream.target(stream_pair.target_of(dst))
    flags = [Flag() for _ in range(LAYERS)]
    for layer in range(LAYERS):
        stream.computed(layer, 0, src, flags[layer])
    stream.pump()
    assert stream.counters.writes == 0, "nothing may be written before its layer is ready"
    flags[2].set = True  # layer 2 before layers 0 and 1: layers go independently
    stream.pump()
    assert stream.counters.layers_posted == [2]
    for layer in (0, 1, 3):
        flags[layer].set = True
        stream.pump()
    stream.finish()
    drain(stream, stream_pair)
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)]
    assert stream_pair.landed(src, dst)
    assert stream.counters.writes == LAYERS and sorted(stream.counters.layers_posted) == list(range(LAYERS))
    assert stream.counters.bytes == LAYERS * len(src) * PAGE and stream.failure is None


def test_layers_computed_before_the_destination_arrives_go_in_one_write(stream_pair: Pair) -> None:
    src, dst = [1, 2, 3], [4, 5, 6]
    stream = stream_pair.stream()
    for layer in range(2):
        stream.computed(layer, 0, src)
    assert stream.pump() and stream.state is StreamState.WAITING and stream.counters.writes == 0
    assert not stream.busy, "a stream waiting for its destination needs no polling"
    stream.target(stream_pair.target_of(dst))
    stream.pump()
    assert stream.counters.writes == 1 and stream.counters.layers_posted == [0, 1] and stream.busy
    for layer in range(2, LAYERS):
        stream.computed(layer, 0, src)
        stream.pump()
    stream.finish()
    drain(stream, stream_pair)
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)] and stream_pair.landed(src, dst)
    assert stream.counters.writes == 1 + (LAYERS - 2)


def test_a_destination_after_the_prefill_has_finished_is_one_plain_push(stream_pair: Pair) -> None:
    src, dst = [8, 9], [3, 4]
    stream = stream_pair.stream()
    for layer in range(LAYERS):
        stream.computed(layer, 0, src)
    stream.finish()
    stream.target(stream_pair.target_of(dst))
    drain(stream, stream_pair)
    assert stream.counters.writes == 1 and stream_pair.notes() == [PushedNotification(PUSH_ID, True)]
    assert stream_pair.landed(src, dst)


def test_chunks_stream_with_their_shared_block_sent_again_and_cached_blocks_skipped(stream_pair: Pair) -> None:
    """Chunked prefill: chunk 1 ends inside prompt block 2, chunk 2 covers blocks 2..4. The decode engine has
    prompt block 0 cached itself (``first_block`` 1): block 0 is never written."""
    src = [10, 11, 12, 13, 14]
    dst = [7, 8, 9, 15]  # prompt blocks 1..4
    stream = stream_pair.stream()
    stream.target(stream_pair.target_of(dst, first_block=1))
    for layer in range(LAYERS):
        stream.computed(layer, 0, src[:3])
        stream.pump()
    for layer in range(LAYERS):
        stream.computed(layer, 2, src[2:])
        stream.pump()
    stream.finish()
    drain(stream, stream_pair)
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)]
    assert stream_pair.landed(src[1:], dst)
    assert stream.counters.bytes == LAYERS * (2 + 3) * PAGE  # block 2 twice, block 0 never


def test_an_aborted_stream_stops_writing_and_tells_the_decode_rank(stream_pair: Pair) -> None:
    src, dst = [1, 2], [3, 4]
    stream = stream_pair.stream()
    stream.target(stream_pair.target_of(dst))
    stream.computed(0, 0, src)
    stream.pump()
    stream.computed(1, 0, src, lambda: False)
    stream.abort("the decode leg was aborted")
    stream.computed(2, 0, src)
    drain(stream, stream_pair)
    assert stream.ended and stream.failure == "the decode leg was aborted"
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, False, "the decode leg was aborted")]
    assert stream.counters.layers_posted == [0]
    assert stream_pair.landed(src, dst, layers=range(1))


def test_an_abort_before_the_destination_ends_the_stream_without_a_word(stream_pair: Pair) -> None:
    stream = stream_pair.stream()
    stream.computed(0, 0, [1])
    stream.abort("lease expired")
    assert not stream.pump() and stream.ended and stream.counters.writes == 0
    assert stream_pair.notes(timeout_s=0.2) == []


class FailingWriter:
    """The prefill agent, but the first WRITE to end is reported failed (a peer gone mid-stream)."""

    def __init__(self, agent: NixlTransferAgent) -> None:
        self.agent, self.failed = agent, False
        self.start_write: Callable[..., object] = agent.start_write
        self.cancel = agent.cancel
        self.send_notif = agent.send_notif

    def poll(self, xfer: object) -> bool:
        done = self.agent.poll(xfer)  # NIXL releases the WRITE once it has ended, failed or not
        if done and not self.failed:
            self.failed = True
            raise TransferError("NIXL WRITE to decode ended in error")
        return done


def test_a_failed_write_ends_the_stream_with_its_reason(stream_pair: Pair) -> None:
    src, dst = [1], [2]
    stream = stream_pair.stream(FailingWriter(stream_pair.prefill))
    stream.target(stream_pair.target_of(dst))
    stream.computed(0, 0, src)
    drain(stream, stream_pair)  # ends when the WRITE fails, though the prefill is not finished
    stream.computed(1, 0, src)
    assert not stream.pump() and stream.ended
    (note,) = stream_pair.notes()
    assert not note.ok and "ended in error" in note.reason
    assert stream.counters.layers_posted == [0], "nothing is posted after a failed WRITE"


def test_a_ready_test_that_raises_ends_the_stream_and_tells_the_decode_rank(stream_pair: Pair) -> None:
    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    stream = stream_pair.stream()
    stream.target(stream_pair.target_of([2]))
    stream.computed(0, 0, [1], broken)
    assert not stream.pump() and stream.ended
    (note,) = stream_pair.notes()
    assert not note.ok and "illegal memory access" in note.reason


class StuckWriter:
    """The prefill agent, but NIXL refuses to cancel a WRITE and reports it in flight until :attr:`stuck` is
    cleared (a WRITE still moving bytes when the stream stops)."""

    def __init__(self, agent: NixlTransferAgent) -> None:
        self.agent, self.stuck = agent, True
        self.start_write: Callable[..., object] = agent.start_write
        self.send_notif = agent.send_notif

    def cancel(self, xfer: object) -> bool:
        return False

    def poll(self, xfer: object) -> bool:
        return not self.stuck and self.agent.poll(xfer)


def test_a_stopped_stream_tells_the_decode_rank_only_once_no_write_is_in_flight(stream_pair: Pair) -> None:
    """The decode rank hands its blocks back to vLLM on the word: a WRITE still landing then would write into
    another request's blocks, so the word waits for it."""
    src, dst = [1, 2], [3, 4]
    writer = StuckWriter(stream_pair.prefill)
    stream = stream_pair.stream(writer)
    stream.target(stream_pair.target_of(dst))
    stream.computed(0, 0, src)
    stream.pump()
    stream.abort("the decode rank gave the load up")
    for _ in range(20):
        assert stream.pump() and not stream.ended
    assert stream_pair.notes(timeout_s=0.2) == [], "told while a WRITE was in flight"
    writer.stuck = False
    drain(stream, stream_pair)
    assert stream.ended and stream_pair.notes() == [
        PushedNotification(PUSH_ID, False, "the decode rank gave the load up")]
    assert stream_pair.landed(src, dst, layers=range(1))


def test_a_stream_whose_destination_deadline_passes_stops_and_tells_the_decode_rank(stream_pair: Pair) -> None:
    now = [100.0]
    src, dst = [1, 2], [3, 4]
    stream = LayerStream("req-1", StreamSide(tuple(stream_pair.source_pages), BLOCKS), stream_pair.prefill,
                         secret=KEY, clock=lambda: now[0])
    target = stream_pair.target_of(dst)
    stream.target(StreamTarget(target.agent, target.side, target.block_ids, target.first_block, target.push_id,
                               deadline=105.0))
    stream.computed(0, 0, src)
    _drain_until_idle(stream, stream_pair)
    now[0] = 105.0  # the decode rank gives the load up now
    stream.computed(1, 0, src)
    drain(stream, stream_pair)
    (note,) = stream_pair.notes()
    assert not note.ok and "window passed" in note.reason
    assert stream.counters.layers_posted == [0], "nothing is posted once the window has passed"
    assert stream_pair.landed(src, dst, layers=range(1))


def _whole_prompt_until(stream: LayerStream, pair: Pair, src: list[int], dst: list[int],
                        deadline: float) -> LayerStream:
    """``stream`` given ``dst`` as its destination until ``deadline``, every layer of ``src`` computed, finished."""
    target = pair.target_of(dst)
    stream.target(StreamTarget(target.agent, target.side, target.block_ids, target.first_block, target.push_id,
                               deadline=deadline))
    for layer in range(LAYERS):
        stream.computed(layer, 0, src)
    stream.finish()
    return stream


def test_a_stream_whose_last_write_landed_before_its_deadline_ends_ok(stream_pair: Pair) -> None:
    now = [100.0]
    src, dst = [1], [2]
    stream = _whole_prompt_until(_clocked(stream_pair, now), stream_pair, src, dst, deadline=105.0)
    drain(stream, stream_pair)  # every layer posted in one WRITE, the notification riding on it, before 105
    now[0] = 200.0
    assert not stream.pump() and stream.failure is None
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)] and stream_pair.landed(src, dst)


def test_a_last_write_still_in_flight_at_the_deadline_is_cut_and_the_word_waits_for_its_end(stream_pair: Pair) -> None:
    """The decode rank hands its blocks back once its window has passed and the word came: the last WRITE, which
    carries the notification, is cut at the deadline like any other; one NIXL will not cancel keeps the stream
    from ending (and the word from going) until it has ended."""
    now = [100.0]
    src, dst = [1], [2]
    writer = StuckWriter(stream_pair.prefill)
    stream = LayerStream("req-1", StreamSide(tuple(stream_pair.source_pages), BLOCKS), writer, secret=KEY,
                         clock=lambda: now[0])
    _whole_prompt_until(stream, stream_pair, src, dst, deadline=105.0)
    stream.pump()  # every layer posted, the notification riding on the WRITE, which does not end
    now[0] = 105.0
    for _ in range(20):
        assert stream.pump() and not stream.ended, "a stream ended with a WRITE in flight"
    assert stream.failure is not None and "window passed" in stream.failure
    writer.stuck = False
    drain(stream, stream_pair)
    notes = stream_pair.notes()
    assert notes and notes[0] == PushedNotification(PUSH_ID, True), "the WRITE's own word, after its bytes"
    assert stream_pair.landed(src, dst)


def _clocked(pair: Pair, now: list[float]) -> LayerStream:
    return LayerStream("req-1", StreamSide(tuple(pair.source_pages), BLOCKS), pair.prefill, secret=KEY,
                       clock=lambda: now[0])


def test_the_wait_after_the_last_layer_counts_from_the_later_of_finish_and_its_ready_test(stream_pair: Pair) -> None:
    """On a GPU the forward reports its end (``finish``) before the last layer's event has completed: the wait
    counts from when that layer was seen ready; on a CPU (no ready test) from ``finish``."""
    src, dst = [1, 2], [3, 4]
    now = [100.0]
    stream = _clocked(stream_pair, now)
    stream.target(stream_pair.target_of(dst))
    last = Flag()
    for layer in range(LAYERS - 1):
        stream.computed(layer, 0, src)
    stream.computed(LAYERS - 1, 0, src, last)
    stream.pump()
    stream.finish()  # at 100.0
    assert stream.counters.tail_s is None, "not told yet"
    now[0] = 100.5
    last.set = True
    stream.pump()  # the last layer seen ready at 100.5, its WRITE posted with the notification
    now[0] = 100.75
    drain(stream, stream_pair)
    assert stream.counters.tail_s == pytest.approx(0.25) and stream_pair.landed(src, dst)

    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)]
    now[0] = 200.0
    cpu = _clocked(stream_pair, now)
    cpu.target(stream_pair.target_of(dst))
    for layer in range(LAYERS):
        cpu.computed(layer, 0, src)
    cpu.pump()  # every layer posted before the forward's end
    cpu.finish()
    now[0] = 200.125
    drain(cpu, stream_pair)
    assert cpu.counters.tail_s == pytest.approx(0.125)


def test_a_bulk_stream_posts_every_layer_in_one_write_after_the_last(stream_pair: Pair) -> None:
    """A prompt below ``stream_min_tokens``: the destination and checks of a stream, the WRITE of a push."""
    src, dst = [1, 2, 3], [4, 5, 6]
    stream = LayerStream("req-1", StreamSide(tuple(stream_pair.source_pages), BLOCKS), stream_pair.prefill,
                         secret=KEY, bulk=True)
    stream.target(stream_pair.target_of(dst))
    for layer in range(LAYERS):
        stream.computed(layer, 0, src)
        assert stream.pump() and not stream.busy, "a bulk stream has nothing to do before its prefill ends"
    assert stream.counters.writes == 0 and stream_pair.notes(timeout_s=0.1) == []
    stream.finish()
    drain(stream, stream_pair)
    assert stream.counters.writes == 1 and stream.counters.layers_posted == list(range(LAYERS))
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)]
    assert stream_pair.landed(src, dst)


def test_the_measured_threshold_follows_the_cache_kind(stream_pair: Pair) -> None:
    """Cross-layer pages (``BLHNC``: a layer's page strides over every layer of its block) cost a descriptor per
    block and layer, so streaming pays only from longer prompts than in a per-layer cache (``LBHNC``)."""
    cross = StreamSide(tuple(stream_pair.source_pages), BLOCKS)
    per_layer = StreamSide(tuple(stream_pair.target_pages), BLOCKS)
    assert measured_min_tokens(cross) == MEASURED_MIN_TOKENS["cross_layer"] == 512
    assert measured_min_tokens(per_layer) == MEASURED_MIN_TOKENS["per_layer"] == 128
    assert measured_min_tokens("an interleaved layout cannot stream") == 0


def _drain_until_idle(stream: LayerStream, pair: Pair, timeout_s: float = 10.0) -> None:
    """Pump until no WRITE of the stream is in flight."""
    deadline = time.monotonic() + timeout_s
    while stream.pump() and stream.busy:
        assert time.monotonic() < deadline, "WRITEs still in flight"
        pair.decode.progress()
        time.sleep(0.0005)


def test_a_destination_is_checked_and_given_once(stream_pair: Pair) -> None:
    stream = stream_pair.stream()
    with pytest.raises(ValueError, match=f"decode block id {BLOCKS} outside"):
        stream.target(stream_pair.target_of([1, BLOCKS]))
    with pytest.raises(ValueError, match="pages per block differ"):
        stream.target(stream_pair.target_of([1], pages=stream_pair.target_pages[:-1]))
    halves = [Segment(p.addr, PAGE // 2, p.block_stride, p.layer_start, 1, kv) for p in stream_pair.target_pages
              for kv in (0, 1)]
    with pytest.raises(ValueError, match="pages per block differ"):  # K and V apart on one side only
        stream.target(stream_pair.target_of([1], pages=halves))
    assert stream.state is StreamState.WAITING
    stream.target(stream_pair.target_of([1]))
    with pytest.raises(ValueError, match="already has a destination"):
        stream.target(stream_pair.target_of([2]))


def test_a_poster_runs_the_streams_on_its_own_thread_while_the_forward_only_queues(stream_pair: Pair) -> None:
    src, dst = [4, 5, 6], [9, 10, 11]
    poster = StreamPoster(WriteEngine(stream_pair.prefill, None))
    try:
        stream = stream_pair.stream()
        poster.add("req-1", stream)
        for layer in range(LAYERS):
            poster.computed("req-1", layer, 0, src)
        poster.target("req-1", stream_pair.target_of(dst))  # late: the layers done so far go in one WRITE
        poster.target("req-1", stream_pair.target_of([1, 2, 3]))  # a second destination is refused, the first stays
        poster.finish("req-1")
        poster.computed("unknown-request", 0, 0, src)  # ignored
        assert ended_on(poster, stream_pair) == [stream]
        assert stream_pair.notes() == [PushedNotification(PUSH_ID, True)] and stream_pair.landed(src, dst)
        assert stream.counters.writes == 1
    finally:
        poster.close()


def test_a_forked_stream_replays_the_layers_computed_so_far_and_one_ranks_abort_stops_only_its_own(
        stream_pair: Pair) -> None:
    """A second destination of one request (another decode rank) gets a stream forked from the first: the layers
    computed before it came, then the rest; aborting one agent's stream leaves the other; a fork of a key that is
    gone is aborted at once."""
    poster = StreamPoster(WriteEngine(stream_pair.prefill, None))
    try:
        first, second, third, orphan = (stream_pair.stream() for _ in range(4))
        poster.add("req-1", first, keep=True)
        poster.target("req-1", stream_pair.target_of([3, 4]))
        poster.computed("req-1", 0, 0, [1, 2])
        poster.fork("req-1", second, stream_pair.target_of([5, 6]))  # replays layer 0
        for layer in range(1, LAYERS):
            poster.computed("req-1", layer, 0, [1, 2])
        poster.finish("req-1")
        ended = ended_on(poster, stream_pair)
        while len(ended) < 2:
            ended += ended_on(poster, stream_pair)
        assert sorted(map(id, ended)) == sorted(map(id, [first, second]))
        assert first.failure is None and second.failure is None
        assert stream_pair.landed([1, 2, 1, 2], [3, 4, 5, 6])
        poster.fork("req-1", third, stream_pair.target_of([7, 8]))  # kept: every layer replayed, then it ends
        assert ended_on(poster, stream_pair) == [third] and third.failure is None
        assert stream_pair.landed([1, 2] * 3, [3, 4, 5, 6, 7, 8])
        poster.abort_one("req-1", "another-agent", "not this one")
        poster.drop("req-1")
        poster.fork("req-1", orphan, stream_pair.target_of([9]))
        assert ended_on(poster, stream_pair) == [orphan]
        assert orphan.failure == "its request's streams ended before this destination came"
    finally:
        poster.close()


def test_a_stream_replaced_under_its_request_is_aborted_and_still_handed_back(stream_pair: Pair) -> None:
    poster = StreamPoster(WriteEngine(stream_pair.prefill, None))
    try:
        first, second = stream_pair.stream(), stream_pair.stream()
        poster.add("req-1", first)
        poster.target("req-1", stream_pair.target_of([3]))
        poster.computed("req-1", 0, 0, [1], lambda: False)
        poster.add("req-1", second)  # the request came again: the first stream must not be lost
        assert ended_on(poster, stream_pair) == [first]
        assert first.failure == "replaced by a new stream of the same request"
        poster.target("req-1", stream_pair.target_of([4]))
        for layer in range(LAYERS):
            poster.computed("req-1", layer, 0, [2])
        poster.finish("req-1")
        assert ended_on(poster, stream_pair) == [second] and second.failure is None
        assert stream_pair.landed([2], [4])
    finally:
        poster.close()


def test_closing_the_poster_aborts_the_streams_still_running(stream_pair: Pair) -> None:
    poster = StreamPoster(WriteEngine(stream_pair.prefill, None))
    stream = stream_pair.stream()
    poster.add("req-1", stream)
    poster.target("req-1", stream_pair.target_of([3]))
    poster.computed("req-1", 0, 0, [1], lambda: False)  # a layer that never completes
    poster.close()
    assert stream.ended and stream.failure == "the prefill rank is shutting down"
    assert stream_pair.notes() == [PushedNotification(PUSH_ID, False, "the prefill rank is shutting down")]
    assert stream_pair.landed([1], [3], layers=range(0))


@pytest.mark.gpu
def test_layers_in_gpu_memory_are_written_only_after_their_events() -> None:
    """On a GPU the forward runs ahead of the host: each layer is a kernel, then an event. The stream WRITEs a
    layer (VRAM to VRAM) only once its event has completed, and every byte lands."""
    src, dst = [2, 3, 4, 11], [5, 6, 7, 8]
    with open_pair("cuda") as pair:
        pair.decode.take_notifs(PUSH_PREFIX)
        stream = pair.stream()
        stream.target(pair.target_of(dst))
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time per layer
            event = torch.cuda.Event()
            event.record()
            stream.computed(layer, 0, src, event.query)
            stream.pump()
        assert stream.counters.writes == 0, "a layer was written before its kernel finished"
        stream.finish()
        drain(stream, pair, timeout_s=30)
        assert pair.notes() == [PushedNotification(PUSH_ID, True)]
        torch.cuda.synchronize()
        assert pair.landed(src, dst)
        assert stream.counters.writes == LAYERS
