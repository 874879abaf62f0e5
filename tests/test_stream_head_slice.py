"""A layer stream of a slice of heads (``StreamRequest.head_slice``): a decode rank of another TP size over
head-major pages takes its heads of each of the prefill rank's pages straight into its own pages, no staging.

The checks run on a real prefill rank's streams over two NIXL agents in this
process: the decode blocks must hold the prefill's heads the slice names, in
the slice of each page it names, and nothing anywhere else; every request a
decode rank may send is checked against both ranks' pages first.
"""

from __future__ import annotations

import msgspec
import pytest

from handshake import HeadSlice, StreamRequest
from p2pkv.dataplane.negotiate import layout_desc
from p2pkv.notification import PushedNotification
from p2pkv.prefill.stream_requests import CheckedStream, check_stream_request, stream_side
from tests.push_support import ENGINE, KEY, SHAPE, Agents
from tests.stream_rig import LAYERS, MODEL, PID, Rig, open_rig

HEADS = SHAPE["num_heads"]


def _sliced(rig: Rig, block_ids: list[int], cut: HeadSlice | None, **fields: object) -> StreamRequest:
    """Rank 0 of the decode engine's destination in ``block_ids`` with ``cut`` (and ``fields`` replaced)."""
    return msgspec.structs.replace(rig.request(block_ids), head_slice=cut, **fields)


def _check(agents: Agents, msg: StreamRequest, attn_layout: str = "HND") -> CheckedStream | str:
    source = stream_side(layout_desc(agents.layout, MODEL, attn_layout, mem_type="DRAM"))
    return check_stream_request(msg, source, KEY, ENGINE, msg.sent_at)


def test_a_slice_of_heads_is_cut_from_both_ranks_pages(agents: Agents) -> None:
    with open_rig(agents) as rig:
        whole = _check(agents, _sliced(rig, [5, 6], None))
        checked = _check(agents, _sliced(rig, [5, 6], HeadSlice(1, 0, 1)))
    assert isinstance(whole, CheckedStream) and isinstance(checked, CheckedStream), (whole, checked)
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    half = source.pages[0].length // HEADS
    assert [(p.addr, p.length) for p in checked.source_pages] == [(p.addr + half, half) for p in source.pages]
    assert [(p.addr, p.length) for p in checked.side.pages] == [(p.addr, half) for p in whole.side.pages]
    assert whole.source_pages == (), "a request without head_slice reads the pages whole"


@pytest.mark.parametrize(("cut", "fields", "layout", "why"), [
    (HeadSlice(1, 0, 2), {}, "HND", "head_slice: heads 1..2 lie outside the prefill rank's 2 heads"),
    (HeadSlice(0, 1, 2), {}, "HND", "head_slice: heads 1..2 lie outside the decode rank's 2 heads"),
    (HeadSlice(0, 0, 1), {}, "NHD", "head_slice: pages must be head-major on both ranks"),
    (HeadSlice(0, 0, 1), {"staging_addrs": [1 << 20]}, "HND", "head_slice: goes without staging_addrs"),
])
def test_a_slice_outside_either_ranks_heads_or_of_token_major_pages_is_refused(
        agents: Agents, cut: HeadSlice, fields: dict, layout: str, why: str) -> None:
    with open_rig(agents) as rig:
        msg = _sliced(rig, [5, 6], cut, **fields)
        if layout != "HND":  # both ranks token-major: the requester's pages say so too
            info = msgspec.structs.replace(msg.agent, layout=layout_desc(agents.decode_layout, MODEL, layout,
                                                                         mem_type="DRAM"))
            msg = msgspec.structs.replace(msg, agent=info)
        got = _check(agents, msg, layout)
    assert isinstance(got, str) and got.startswith(why), got


def test_a_sliced_stream_writes_the_prefill_heads_it_names_into_the_decode_heads_it_names(agents: Agents) -> None:
    """Prefill head 1 of blocks 3, 4 lands in decode head 0 of blocks 5, 6, layer by layer; decode head 1 and
    every other block stay zero, and only the slice's bytes move."""
    with open_rig(agents) as rig:
        meta = rig.chunk((3, 4))
        rig.streams.prepare(meta)
        assert rig.streams.on_stream(_sliced(rig, [5, 6], HeadSlice(1, 0, 1))) == ("accepted", "")
        rig.step(meta)
        assert rig.notes() == [PushedNotification(PID, True)]
        rig.settle()
        (stream,) = rig.ended
    want = agents.target.clone().zero_()
    for src, dst in ((3, 5), (4, 6)):
        want[dst, :, 0] = agents.source[src, :, 1]
    assert agents.target.equal(want), "the decode blocks differ from the prefill heads the slice names"
    head_bytes = agents.source[0, 0, 0].numel() * agents.source.element_size()
    assert stream.counters.bytes == 2 * LAYERS * head_bytes
