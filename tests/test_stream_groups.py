"""Layer-streamed transfer of a model with several KV cache groups (vLLM's hybrid KV cache manager).

HMA groups share the KV tensors: tensor ``i`` holds layer ``i`` of each
attention group (here ``full.i`` of group 0 and ``window.i`` of group 1), and
a block id names the same pages in every tensor; a state group's blocks
(Mamba/SSM, group 2 here) are pages of those tensors too, written by layers
that report nothing per layer. On a real prefill rank (two NIXL agents in
this process): each group's blocks land in the decode rank's blocks of the
same group, an attention group's as its layers are reported, the state
group's after the prompt's last step; a step missing one group's layers
stops the stream; a destination naming another number of groups, or a
group's block id outside the cache, is refused naming the field (staged
streams of such models: :mod:`tests.test_stream_groups_staged`). The
scheduler side: each step's chunk carries every group's blocks, vLLM's null
blocks left out, the state group's in the last chunk only; the decode side
asks for each group's newly allocated blocks.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from handshake import GroupBlocks
from p2pkv.grant import ANY_DECODE, make_stream_grant
from p2pkv.metadata import P2pKvMetadata, StreamChunk
from p2pkv.notification import PushedNotification
from p2pkv.prefill.prefill_streams import attention_blocks
from p2pkv.scheduling.load_scheduling import streamed_groups
from p2pkv.scheduling.stream_steps import StreamSteps
from tests.push_support import ENGINE, KEY, Agents
from tests.stream_rig import DIGEST, LAYERS, PID, REQ, Rig, open_rig

GROUP_OF = {**{f"full.{i}": 0 for i in range(LAYERS)}, **{f"window.{i}": 1 for i in range(LAYERS)},
            "mamba.0": 2}
"""Layer name → KV cache group: full attention, sliding window, Mamba state."""
LAYER_OF = {**{f"full.{i}": i for i in range(LAYERS)}, **{f"window.{i}": i for i in range(LAYERS)}}
"""The attention layers' tensors (one per layer of each attention group; Mamba layers report no layer)."""


def _meta(rig: Rig, first_block: int, full: list[int], window: GroupBlocks, state: list[int], num_tokens: int,
          last: bool) -> P2pKvMetadata:
    first = first_block == 0
    chunk = StreamChunk(REQ, rig.stream_id, first_block, tuple(full), num_tokens, last, DIGEST if first else "",
                        31 if first else 0, (window, GroupBlocks(0, state)))
    return P2pKvMetadata(streams=[chunk])


def _forward(rig: Rig, meta: P2pKvMetadata, groups: tuple[str, ...] = ("full", "window")) -> None:
    """One step's forward: the layers of ``groups`` reported done, then the step's end."""
    rig.streams.prepare(meta)
    for layer in range(LAYERS):
        for name in groups:
            rig.streams.save_layer(f"{name}.{layer}", meta)
    rig.streams.end_step()


def test_each_group_lands_in_its_own_blocks_and_the_state_after_the_last_step(agents: Agents) -> None:
    """Chunked prefill of a prompt of 4 blocks in 2 steps. Group 0 (full attention): every block, prompt blocks
    0..3 → decode 10..13. Group 1 (window): the decode engine keeps prompt blocks 2..3 only (``first_block`` 2)
    → 8, 9. Group 2 (state): the request's one block, 7 → 15, after the last step."""
    full, window, state = [1, 2, 3, 4], [0, 5, 6, 14], 7  # window block 0: vLLM's null block, freed
    with open_rig(agents, layer_of=LAYER_OF, group_of=GROUP_OF, state_groups=frozenset({2})) as rig:
        rig.streams._open(_meta(rig, 0, full[:2], GroupBlocks(1, window[1:2]), [], 20, False).streams[0])
        request = msgspec.structs.replace(rig.request([10, 11, 12, 13]), group_blocks=[
            GroupBlocks(2, [8, 9]), GroupBlocks(0, [15])])
        assert rig.streams.on_stream(request) == ("accepted", "")
        _forward(rig, _meta(rig, 0, full[:2], GroupBlocks(1, window[1:2]), [], 20, False))
        rig.wait_landed({1: 10, 2: 11}, range(LAYERS))  # the window's block 1 lies before the decode's window
        _forward(rig, _meta(rig, 1, full[1:], GroupBlocks(1, window[1:]), [state], 31, True))
        assert rig.notes() == [PushedNotification(PID, True)]
        assert rig.landed({1: 10, 2: 11, 3: 12, 4: 13, 6: 8, 14: 9, 7: 15}, range(LAYERS))
        rig.settle()


def test_a_step_missing_one_groups_layers_stops_the_stream(agents: Agents) -> None:
    with open_rig(agents, layer_of=LAYER_OF, group_of=GROUP_OF, state_groups=frozenset({2})) as rig:
        meta = _meta(rig, 0, [1, 2], GroupBlocks(0, [3, 4]), [5], 31, True)
        rig.streams._open(meta.streams[0])
        request = msgspec.structs.replace(rig.request([10, 11]), group_blocks=[GroupBlocks(0, [8, 9]),
                                                                               GroupBlocks(0, [15])])
        assert rig.streams.on_stream(request) == ("accepted", "")
        _forward(rig, meta, groups=("full",))
        [note] = rig.notes()
        assert not note.ok and "first missing: layer 0 of KV cache group 1" in note.reason
        rig.settle()


@pytest.mark.parametrize(("change", "why"), [
    ({"group_blocks": [GroupBlocks(0, [8])]}, "group_blocks: 1 KV cache group(s) after the first, but this engine "
                                              "has 3 groups"),
    ({"group_blocks": [GroupBlocks(0, [8]), GroupBlocks(0, [99])]}, "group_blocks[1].block_ids"),
])
def test_a_destination_that_does_not_name_each_group_within_the_cache_is_refused(agents: Agents, change: dict,
                                                                                 why: str) -> None:
    with open_rig(agents, layer_of=LAYER_OF, group_of=GROUP_OF, state_groups=frozenset({2})) as rig:
        request = msgspec.structs.replace(rig.request([10, 11]), **{
            "group_blocks": [GroupBlocks(0, [8]), GroupBlocks(0, [9])], **change})
        status, message = rig.streams.on_stream(request)
        assert status == "refused" and why in message


def _output(new: list[tuple[str, tuple[list[int], ...], int]], cached: list[tuple[str, tuple[list[int], ...], int]],
            counts: dict[str, int]) -> SimpleNamespace:
    """A SchedulerOutput: new requests (id, block ids per group, computed), cached ones (id, new block ids per
    group, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[b for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set()),
        num_scheduled_tokens=counts)


def test_the_scheduler_gives_each_group_its_blocks_without_null_blocks_and_the_state_last() -> None:
    steps = StreamSteps(ENGINE, KEY, 4, 0, 3, frozenset({2}))
    grant = make_stream_grant(ENGINE, ANY_DECODE, KEY, time.time() + 60)
    steps.on_new_request(SimpleNamespace(request_id="r", prompt_token_ids=list(range(11)),
                                         kv_transfer_params={"p2pkv_stream_grant": grant}))
    [first] = steps.chunks(_output([("r", ([1, 2], [0, 5], [9]), 0)], [], {"r": 6}))
    assert (first.first_block, first.block_ids, first.group_blocks) == (0, (1, 2), (GroupBlocks(1, [5]),
                                                                                    GroupBlocks(0, [])))
    [second] = steps.chunks(_output([], [("r", ([3], [6]), 6)], {"r": 5}))
    assert (second.first_block, second.block_ids, second.last) == (1, (2, 3), True)
    assert second.group_blocks == (GroupBlocks(1, [5, 6]), GroupBlocks(0, [9]))


def test_the_decode_engine_asks_for_each_groups_newly_allocated_blocks() -> None:
    """A prefix-cache hit (group 0's first block) and a window's null blocks (group 1) are not asked for."""
    blocks = SimpleNamespace(get_block_ids=lambda: ([4, 5, 6], [0, 0, 7], [8]),
                             get_unhashed_block_ids_all_groups=lambda: ([5, 6], [7], [8]))
    assert streamed_groups(blocks) == (GroupBlocks(1, [5, 6]), GroupBlocks(2, [7]), GroupBlocks(0, [8]))


def test_the_link_rule_counts_a_steps_attention_blocks_not_its_state_block() -> None:
    """The forward's time per block divides by the blocks a layer computes: a hybrid model's state group (here
    group 0) has one block in the last chunk and none before, which would make the forward look 8 times slower."""
    last = StreamChunk("r", "s", 0, (9,), 256, True, group_blocks=(GroupBlocks(0, list(range(1, 9))),))
    before = StreamChunk("r", "s", 0, (), 128, False, group_blocks=(GroupBlocks(0, list(range(1, 5))),))
    assert attention_blocks(last, 2, frozenset({0})) == 8 and attention_blocks(before, 2, frozenset({0})) == 4
    assert attention_blocks(last, 2, frozenset()) == 8 and attention_blocks(last, 1, frozenset()) == 1
