"""How often a prefill rank's stream poster turns: fast while being late costs a stream time (a ready test to
watch, a finished stream's word waiting for its WRITEs), slower while only WRITEs are in flight (a link-bound
stream's WRITEs are in flight for the whole prefill, and polling them every 0.2 ms took CPU from the forward)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from p2pkv.prefill.layer_stream import StreamTarget
from p2pkv.prefill.poster import StreamPoster
from p2pkv.prefill.write_engine import WriteEngine
from tests.test_streamer import Flag, Pair, StuckWriter, stream_pair  # noqa: F401 (stream_pair: a fixture)


def _target(pair: Pair, dst: list[int]) -> StreamTarget:
    return pair.target_of(dst)


def test_a_stream_is_urgent_only_while_being_late_costs_it_time(stream_pair: Pair) -> None:  # noqa: F811
    writer = StuckWriter(stream_pair.prefill)
    stream = stream_pair.stream(writer)
    stream.target(_target(stream_pair, [2]))
    flag = Flag()
    stream.computed(0, 0, [1], flag)
    stream.pump()
    assert stream.urgent, "a computed layer's ready test is watched"
    flag.set = True
    stream.pump()
    assert stream.busy and not stream.urgent, "only a WRITE in flight"
    writer.stuck = False
    deadline = time.monotonic() + 10
    while stream.busy:  # layer 0's WRITE ends
        assert time.monotonic() < deadline
        stream.pump()
        stream_pair.decode.progress()
    writer.stuck = True
    stream.computed(1, 0, [1])
    stream.finish()
    stream.pump()  # layer 1 goes in the last WRITE, which carries the notification
    assert stream.counters.writes == 2 and stream.busy and not stream.urgent
    writer.stuck = False
    deadline = time.monotonic() + 10
    while stream.pump():
        assert time.monotonic() < deadline
        stream_pair.decode.progress()
    assert stream_pair.notes()[0].ok

    late = stream_pair.stream(StuckWriter(stream_pair.prefill))
    late.target(_target(stream_pair, [3]))
    late.computed(0, 0, [1])
    late.pump()
    late.finish()
    late.pump()
    assert late.urgent, "finished with a WRITE in flight: its word waits for that WRITE's end"
    late.abort("test over")

    bulk = stream_pair.stream()
    bulk.bulk = True
    bulk.target(_target(stream_pair, [4]))
    bulk.computed(0, 0, [1])
    bulk.pump()
    assert not bulk.urgent and not bulk.busy, "a bulk stream waits for its finish"
    bulk.abort("test over")


def test_the_poster_turns_slowly_while_only_writes_are_in_flight(stream_pair: Pair) -> None:  # noqa: F811
    turns: list[float] = []
    progressed = SimpleNamespace(progress=lambda: turns.append(time.monotonic()))  # the engine's turns
    poster = StreamPoster(WriteEngine(progressed, None, writes_poll_s=0.05))  # type: ignore[arg-type]
    writer = StuckWriter(stream_pair.prefill)
    try:
        poster.add("r", stream_pair.stream(writer))
        poster.target("r", _target(stream_pair, [2]))
        poster.computed("r", 0, 0, [1])
        time.sleep(0.1)
        start = len(turns)
        time.sleep(0.5)
        slow = len(turns) - start
        poster.finish("r")
        time.sleep(0.1)
        start = len(turns)
        time.sleep(0.2)
        fast = len(turns) - start
    finally:
        writer.stuck = False
        poster.close()
    assert slow <= 12, slow  # 0.5 s at 50 ms and a margin (a loaded machine only turns less often)
    assert fast >= 50, fast  # finished: its word waits for the WRITE's end, at 0.2 ms a turn
