"""A streamed prefill preempted mid-way (:meth:`p2pkv.prefill.layer_stream.LayerStream.restart`).

vLLM frees a preempted request's blocks at once, without asking the
connector, and computes the request again from its first token in the blocks
it is given when resumed. Layers the stream has computed but not WRITTEN yet
(its destination had not come, or a bulk stream waits for the last layer)
would then be read from blocks that may hold another request's KV, in the same
WRITE as the layers computed again, into the same decode blocks. These tests
run a real prefill rank's streams over two NIXL agents in this process: the
freed blocks are overwritten as the next request's forward would, and the
decode blocks must hold the recomputed layers, with only their bytes moved.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from p2pkv.metadata import P2pKvMetadata
from p2pkv.notification import PushedNotification
from p2pkv.prefill.poster import StreamPoster
from p2pkv.prefill.write_engine import WriteEngine
from tests.push_support import Agents
from tests.stream_pair import LAYERS, PAGE, Pair, ended_on, open_pair
from tests.stream_rig import LAYERS as RIG_LAYERS
from tests.stream_rig import PID, REQ, open_rig


@contextlib.contextmanager
def _reused(cache: torch.Tensor, blocks: list[int]) -> Iterator[None]:
    """``blocks`` of ``cache`` (``[blocks, ...]``) hold another request's values (-7.0) until the exit."""
    saved = cache[blocks].clone()
    cache[blocks] = -7.0
    try:
        yield
    finally:
        cache[blocks] = saved


@contextlib.contextmanager
def _held(poster: StreamPoster, held: bool) -> Iterator[None]:
    """(``held``) ``poster``'s thread applies no call and pumps no stream until the exit; then it takes the calls
    made meanwhile in their order, in one turn."""
    if not held:
        yield
        return
    gate = threading.Event()
    apply = poster._apply

    def gated() -> None:
        gate.wait(10.0)
        apply()

    poster._apply = gated  # type: ignore[method-assign]
    try:
        yield
    finally:
        poster._apply = apply  # type: ignore[method-assign]
        gate.set()


@pytest.mark.parametrize("told", [True, False], ids=["told-at-preemption", "seen-at-resumption"])
def test_a_preempted_stream_writes_only_the_layers_computed_again(agents: Agents, told: bool) -> None:
    """Step 1 computes every layer of prompt blocks 0-1 into blocks 3, 4 (no destination yet). The request is
    preempted (``told``: the step that preempts it says so; else the workers see it when it comes back) and
    blocks 3, 4 are reused. The destination arrives; nothing is WRITTEN from the freed blocks. Resumed, the
    request is computed again into blocks 7, 8: those land, once, and the decode rank is told after them."""
    with open_rig(agents) as rig:
        rig.step(rig.chunk((3, 4), last=False))
        with _reused(agents.source, [3, 4]):
            preempting = P2pKvMetadata(stream_restarts=[REQ]) if told else P2pKvMetadata()
            rig.step(preempting)
            # Not told, this rank learns of the preemption only from the resumed chunk: a destination that came
            # in between and reached the poster first would have it WRITE the freed blocks' layers (a race the
            # told path, vLLM's preempted_req_ids, does not have). The poster takes both in one turn here.
            with _held(rig.streams.poster, not told):
                assert rig.streams.on_stream(rig.request([5, 6])) == ("accepted", "")
                rig.step(rig.chunk((7, 8)))  # resumed: from block 0 again, its last chunk
            assert rig.notes() == [PushedNotification(PID, True)]
            rig.settle()
            assert rig.landed({7: 5, 8: 6}, range(RIG_LAYERS)), "a freed block's bytes landed"
        (stream,) = rig.ended
        block_bytes = agents.source[0, 0].numel() * agents.source.element_size()
        assert stream.counters.bytes == 2 * RIG_LAYERS * block_bytes, "layers of the freed blocks were WRITTEN"


def test_a_rank_that_reads_the_stream_later_gets_only_the_layers_computed_again(stream_pair: Pair) -> None:
    """A second decode rank's destination (a fork) replays the layers computed so far: after a preemption, only
    those computed again."""
    poster = StreamPoster(WriteEngine(stream_pair.prefill, None))
    try:
        first, second = stream_pair.stream(), stream_pair.stream()
        poster.add("req-1", first, keep=True)
        for layer in range(LAYERS):
            poster.computed("req-1", layer, 0, [1, 2])
        poster.restart("req-1")
        for layer in range(LAYERS):
            poster.computed("req-1", layer, 0, [5, 6])
        poster.target("req-1", stream_pair.target_of([3, 4]))
        poster.fork("req-1", second, stream_pair.target_of([7, 8]))
        poster.finish("req-1")
        ended = ended_on(poster, stream_pair)
        while len(ended) < 2:
            ended += ended_on(poster, stream_pair)
        assert first.failure is None and second.failure is None
        assert stream_pair.landed([5, 6, 5, 6], [3, 4, 7, 8])
        assert first.counters.bytes == second.counters.bytes == LAYERS * 2 * PAGE
    finally:
        poster.close()


@pytest.fixture
def stream_pair() -> Iterator[Pair]:
    with open_pair() as made:
        yield made
