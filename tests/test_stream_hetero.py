"""Layer streams between engines whose pages differ (block size, HND/NHD, cross-layer blocks), with real NIXL.

Both workers run in this process (two NIXL agents), each cache filled as in
:mod:`tests.test_hetero`: every element of (layer, token, global head,
element) holds a unique int32 code in its engine's block size and page
order. The prefill rank streams the prompt layer by layer; where the pages
differ the decode rank has it land in its staging, in the prefill's
geometry, and fixes it up into its blocks when the notification arrives.
Its blocks must then hold exactly the codes of the tokens it loads, and
nothing anywhere else.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from handshake import PROTOCOL_VERSION, GroupBlocks, KVRegion, StreamRequest
from p2pkv.dataplane.negotiate import ModelInfo, layout_desc
from p2pkv.grant import ANY_DECODE, check_stream_grant, make_stream_grant
from p2pkv.metadata import LoadSpec, P2pKvMetadata, StreamChunk
from p2pkv.params import RemotePrefill
from p2pkv.prefill.stream_requests import CheckedStream, check_stream_request, stream_side
from p2pkv.prompt_digest import prompt_digest
from tests.conftest import free_ports
from tests.push_support import DECODE, ENGINE, KEY, SHAPE, Agents
from tests.test_hetero import ROWS, block_ids, make_cache, make_workers, mode

SECRET = "stream-hetero-test-secret-32byte"

STREAM_ROWS = ["block 16 -> 32", "block 64 -> 16", "HND -> NHD", "NHD -> HND", "cross-layer -> layer-compact",
               "cross-layer block 16 -> layer-compact block 32", "CPU attention block 32 -> 64",
               "CPU attention block 64 -> 32", "TP 2 -> 1", "TP 2 -> 1, NHD", "TP 2 block 32 HND -> TP 1 block 16 NHD",
               "GQA 2 heads TP 4 (replicated) -> TP 1, block 16 -> 32", "CPU attention TP 2 -> 1",
               "CPU attention TP 2 block 32 -> TP 1 block 64", "MLA TP 2 -> TP 1", "MLA TP 2 -> TP 1, block 32 -> 16"]
"""Pairs where each prefill rank is read by at most one decode rank (one destination per stream): straight
into the decode rank's blocks where the pages only stride differently (cross-layer against layer-compact) or
are the same (MLA's latent, read from one prefill rank), or, head-major with one block size, each prefill
rank's heads into their slice of the decode rank's pages (``head_slice``); else into staging (another block
size, HND/NHD)."""

FAN_OUT_ROWS = ["TP 1 -> 2", "GQA 2 heads TP 1 -> TP 4 (replicated), HND", "CPU attention TP 1 -> 2"]
"""Pairs where several decode ranks read one prefill rank, head-major with one block size: each decode rank's
stream WRITEs its slice of the prefill rank's heads straight into its pages (``head_slice``)."""


@dataclass(frozen=True)
class GrantedStream:
    """One granted stream of prefill request ``p-req`` into decode request ``d-req``: the grant, the prefill's
    step (one chunk, the whole prompt) and the decode leg's remote."""

    grant: str
    step: P2pKvMetadata
    remote: RemotePrefill


def granted_stream(remote_ids: list[int], tokens: int, port: int, tp_size: int,
                   group_blocks: tuple[GroupBlocks, ...] = (), pp_size: int = 1) -> GrantedStream:
    """A grant for any decode engine, for a ``tokens``-token prompt in prefill blocks ``remote_ids`` (and, for a
    model with several KV cache groups, ``group_blocks`` of groups 1 ..), from the prefill engine of ``pp_size``
    stages whose rank 0 serves ``port``; the decode engine loads all but the last token."""
    loaded = tokens - 1
    grant = make_stream_grant("prefill", ANY_DECODE, SECRET.encode(), time.time() + 60, pp_size=pp_size)
    stream_id = check_stream_grant(grant, SECRET.encode(), prefill_engine_id="prefill", decode_engine_id="decode",
                                   now=time.time(), pp_size=pp_size).stream_id
    digest = prompt_digest(list(range(loaded)))
    step = P2pKvMetadata(streams=[StreamChunk("p-req", stream_id, 0, tuple(remote_ids), tokens, True, digest,
                                              loaded, group_blocks)])
    remote = RemotePrefill("prefill", stream_id, "127.0.0.1", port, (), tp_size, num_tokens=loaded,
                           prompt_digest=digest, transfer_mode="stream", pp_size=pp_size)
    return GrantedStream(grant, step, remote)


def forward_streamed(prefills: list[tuple[Any, Any, dict[str, Any]]], step: P2pKvMetadata) -> None:
    """The forward of ``step`` (already begun: ``start_load_kv``) on every prefill worker ``(worker, _, its KV
    views)``, as vLLM runs it: every layer saved (each streamed as it comes), then the step's end."""
    for prefill, _, views in prefills:
        for name in views:
            prefill.save_kv_layer(name, step)
        prefill.wait_for_save()


def _direct(row: str) -> bool:
    """Whether the row's stream lands in the decode blocks (whole blocks, or each page's slice of heads), not
    through staging."""
    return ROWS[row][2] in ("direct", "paged")


def _stream_and_check(row: str, tokens: int, first_token: int, device: str = "cpu", late: bool = False,
                      verify_kv: bool = False) -> None:
    """Stream a ``tokens``-token prompt from the row's prefill engine into every rank of its decode engine, which
    has the first ``first_token`` tokens cached (a multiple of its block size), both caches on ``device``, and
    compare each decode rank's blocks. ``late``: the decode ranks after the first start their loads only once
    the prefill has computed every layer and the first rank's load has landed (their streams replay it all).
    ``verify_kv``: the decode ranks check every part against its prefill rank's digest, each part verified."""
    prefill_side, decode_side, how = ROWS[row]
    loaded = tokens - 1  # the decode engine computes the last prompt token itself
    rng = np.random.default_rng(len(row) + tokens)
    remote_ids = block_ids(rng, -(-tokens // prefill_side.block_size))
    cached = first_token // decode_side.block_size
    all_local = block_ids(rng, -(-loaded // decode_side.block_size))
    local_ids = all_local[cached:]
    port = free_ports(1, run=prefill_side.tp_size)[0]
    prefills = make_workers("prefill", prefill_side, port, device, remote_ids, tokens, secret=SECRET,
                            stream_min_tokens=0)
    decodes = make_workers("decode", decode_side, free_ports(1, run=decode_side.tp_size)[0], device, secret=SECRET,
                           verify_kv=verify_kv)
    deadline = time.monotonic() + 20
    try:
        granted = granted_stream(remote_ids, tokens, port, prefill_side.tp_size)
        load = P2pKvMetadata(loads=[LoadSpec("d-req", tuple(local_ids), (), granted.remote, first_token=first_token,
                                             num_tokens=loaded, stream_grant=granted.grant)])
        for prefill, _, _ in prefills:
            prefill.start_load_kv(granted.step)
        for decode, _, _ in decodes[:1] if late else decodes:
            decode.start_load_kv(load)
        forward_streamed(prefills, granted.step)
        for rank, (decode, base, _) in enumerate(decodes):
            if late and rank > 0:
                decode.start_load_kv(load)
            stats = streamed_stats(decode, rank, how, deadline)
            checks = stats.get("kv_checks", {})
            assert set(checks) == ({"stream:verified"} if verify_kv else set()), f"decode rank {rank}: {checks}"
            if _direct(row):  # this rank's blocks, or its heads' slice of the prefill's pages, and nothing more
                assert stats.get("pull_bytes") == [len(local_ids) * decode.receiver.rank.layout.block_bytes]
            # A stream into the decode blocks moves whole blocks, the last prompt token's slot too (the decode
            # engine writes the same values there when it computes that token); a fixup moves only those loaded.
            want, _ = make_cache(decode_side, rank, "cpu", all_local, tokens if _direct(row) else loaded)
            _zero_cached(want, decode_side, all_local[:cached])
            assert torch.equal(base.cpu(), want), f"decode rank {rank}'s blocks differ from the tokens' codes"
            while not decode.receiver.stager.idle:  # on a GPU: given back once the fixup kernel has run
                assert time.monotonic() < deadline, "the stream's staging was not given back"
                decode.get_finished()
                time.sleep(0.002)
        release_prefills(prefills, remote_ids, deadline)  # streamed or declined, every prefill rank frees it
    finally:
        for worker, _, _ in (*decodes, *prefills):
            worker.shutdown()


def streamed_stats(decode: Any, rank: int, how: str, deadline: float) -> dict[str, Any]:
    """Decode rank ``rank``'s stats once its streamed load of ``d-req`` finished (by ``deadline``,
    ``time.monotonic()``): landed without a load error, placed ``how`` (``"paged"``, ``"staged"``...), one stream."""
    while "d-req" not in decode.get_finished()[1]:
        assert time.monotonic() < deadline, f"the streamed load of decode rank {rank} never finished"
        time.sleep(0.002)
    assert decode.get_block_ids_with_load_errors() == set()
    assert mode(decode) == {how}
    stats = decode.take_stats() or {}
    assert stats.get("directions") == {"stream": 1}
    return stats


def release_prefills(prefills: list, block_ids: list[int], deadline: float) -> None:
    """Hold request ``p-req`` in ``block_ids`` on every prefill rank of ``prefills`` (its step was streamed) and
    wait until each has sent it (freed), by ``deadline`` (``time.monotonic()`` seconds)."""
    for rank, (prefill, _, _) in enumerate(prefills):
        prefill.start_load_kv(P2pKvMetadata(send_leases={"p-req": time.monotonic() + 60},
                                            send_blocks={"p-req": tuple(block_ids)}))
        sent: set[str] = set()
        while "p-req" not in sent:
            assert time.monotonic() < deadline, f"prefill rank {rank} still holds the streamed request"
            sent |= prefill.get_finished()[0]
            time.sleep(0.005)


def _zero_cached(cache: torch.Tensor, side: object, cached: list[int]) -> None:
    """Zero the blocks the decode engine had cached (a stream does not write them)."""
    for b in cached:
        if side.cross_layer:
            cache[b] = 0
        else:
            cache[:, b] = 0


@pytest.mark.parametrize("row", STREAM_ROWS)
def test_a_stream_between_engines_whose_pages_differ_lands_every_token_in_its_slot(row: str) -> None:
    _stream_and_check(row, tokens=150, first_token=0)


@pytest.mark.parametrize("row", ["block 16 -> 32", "block 64 -> 16", "HND -> NHD", "cross-layer -> layer-compact",
                                 "CPU attention block 32 -> 64", "TP 2 -> 1", "TP 2 -> 1, NHD", "TP 1 -> 2"])
def test_a_verified_stream_lands_checked_in_every_placement(row: str) -> None:
    """``verify_kv`` on streams that land in staging (before its fixup), in a slice of heads of each page, or in
    pages whole from two prefill ranks: every part's digest of what landed equals its prefill rank's."""
    _stream_and_check(row, tokens=150, first_token=0, verify_kv=True)


GPU_STREAM_ROWS = ["block 16 -> 64", "HND -> NHD", "TP 2 -> 1, NHD", "cross-layer -> layer-compact",
                   "MLA TP 2 -> TP 1, block 32 -> 16", "TP 1 -> 2", "TP 2 -> 1"]


@pytest.mark.gpu
@pytest.mark.parametrize("row", GPU_STREAM_ROWS)
def test_a_stream_between_engines_whose_pages_differ_lands_every_token_in_its_slot_on_cuda(row: str) -> None:
    """The same in GPU memory: each layer WRITTEN once a CUDA event recorded after it completes, staging on the
    GPU, the CUDA fixup."""
    _stream_and_check(row, tokens=150, first_token=0, device="cuda")


@pytest.mark.parametrize("late", [False, True], ids=["together", "late"])
@pytest.mark.parametrize("row", FAN_OUT_ROWS)
def test_a_stream_that_several_decode_ranks_read_from_one_prefill_rank_reaches_each(row: str, late: bool) -> None:
    """A decode engine of a larger TP size: each of its ranks sends its own destination, the prefill rank streams
    to each (a rank whose destination comes after the prefill has ended gets every layer replayed), and holds the
    request until every one has ended."""
    _stream_and_check(row, tokens=150, first_token=0, late=late)


@pytest.mark.parametrize("row", ["block 16 -> 32", "block 64 -> 16", "HND -> NHD", "TP 2 -> 1, NHD"])
def test_a_staged_stream_after_a_cached_prefix_moves_only_the_tokens_past_it(row: str) -> None:
    """The decode engine has its first two blocks cached: the prefill block holding their end is streamed whole
    into staging, and only the tokens past them are fixed up into the decode blocks."""
    _, decode_side, _ = ROWS[row]
    _stream_and_check(row, tokens=150, first_token=2 * decode_side.block_size)


@pytest.mark.parametrize("row", ["TP 2 -> 1", "TP 1 -> 2"])
def test_a_sliced_stream_after_a_cached_prefix_writes_only_the_blocks_past_it(row: str) -> None:
    """The decode engine has its first two blocks cached: each prefill rank WRITEs its heads' slice of the
    blocks past them only, and the cached blocks stay as they were."""
    _, decode_side, _ = ROWS[row]
    _stream_and_check(row, tokens=150, first_token=2 * decode_side.block_size)


MODEL = ModelInfo("BLHNC", "float32", SHAPE["num_heads"], SHAPE["head_dim"], SHAPE["block_size"])


def _check(agents: Agents, staging_addrs: list[int], block_ids: list[int], attn_layout: str = "HND",
           declared: list[KVRegion] | None = None,
           group_blocks: list[GroupBlocks] | None = None) -> CheckedStream | str:
    """:func:`check_stream_request` on the prefill rank of ``agents`` for a stream request from its decode rank,
    whose staging (``declared``; default: the decode rank's spare memory) and pages (``attn_layout``) are given;
    ``group_blocks``: a model of ``1 + len(group_blocks)`` KV cache groups on both engines."""
    spare = agents.spare
    if declared is None:
        declared = [KVRegion(base_addr=spare.data_ptr(), length=spare.numel(), device_id=0)]
    info = msgspec.structs.replace(agents.info(declared), layout=layout_desc(agents.decode_layout, MODEL, attn_layout,
                                                                             mem_type="DRAM"))
    grant = make_stream_grant(ENGINE, DECODE, KEY, time.time() + 60, secrets.token_hex(16))
    msg = StreamRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=ENGINE, to_rank=0, sent_at=time.time(),
                        nonce=os.urandom(16), requester_engine_id=DECODE, grant=grant, block_ids=block_ids,
                        first_block=0, num_tokens=31, prompt_digest=prompt_digest(list(range(31))),
                        push_id=bytes(range(16)), agent=info, window_s=30.0, staging_addrs=staging_addrs,
                        group_blocks=group_blocks or [])
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    return check_stream_request(msg, source, KEY, ENGINE, time.time(), kv_groups=1 + len(group_blocks or []))


def test_a_staging_destination_mirrors_the_prefill_ranks_regions_inside_the_declared_staging(agents: Agents) -> None:
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    base = agents.spare.data_ptr()
    addrs = [base + i * 4 * seg.length for i, seg in enumerate(source.segments)]
    checked = _check(agents, addrs, [0, 1, 2, 3])
    assert isinstance(checked, CheckedStream), checked
    assert checked.side.num_blocks == 4
    assert [(p.length, p.layer_start, p.kv_index) for p in checked.side.pages] == [
        (p.length, p.layer_start, p.kv_index) for p in source.pages]
    page_bytes = source.pages[0].length
    want = [(addr + q * page_bytes, seg.length) for addr, seg in zip(addrs, source.segments, strict=True)
            for q in range(seg.length // page_bytes)]  # each region's pages, its blocks back to back
    assert [(p.addr, p.block_stride) for p in checked.side.pages] == want


@pytest.mark.parametrize("why", ["count", "outside", "kv_cache", "undeclared", "block_ids"])
def test_a_staging_destination_outside_the_declared_staging_or_past_its_blocks_is_refused(agents: Agents,
                                                                                         why: str) -> None:
    """A requester chooses every address: staging_addrs must be one per prefill region and lie, blocks and all,
    inside the staging its agent declares (not its KV cache, not memory it never declared); block ids stay below
    the staging's block count."""
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    base, n = agents.spare.data_ptr(), len(source.segments)
    addrs, ids, declared = [base] * n, [0, 1], None
    if why == "count":
        addrs = [base] * (n + 1)
    elif why == "outside":
        addrs = [base + agents.spare.numel() - source.segments[0].length] * n  # the second block runs past the end
    elif why == "kv_cache":
        addrs = [agents.target.data_ptr()] * n
    elif why == "undeclared":
        declared = []
    else:
        ids = [0, 2]
    got = _check(agents, addrs, ids, declared=declared)
    assert isinstance(got, str), f"{why}: accepted"
    assert got.startswith("block_ids" if why == "block_ids" else "staging_addrs"), got


@pytest.mark.parametrize("why", ["", "group id", "room"])
def test_a_staging_destination_of_several_groups_holds_every_groups_blocks(agents: Agents, why: str) -> None:
    """A model of two KV cache groups stages group 1's blocks after group 0's: the staging must hold both lists'
    blocks inside the declared staging, and each list's ids stay below their total."""
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    spare, n = agents.spare, len(source.segments)
    block = max(seg.length for seg in source.segments)
    room = spare.numel() // block  # staging blocks the declared staging holds
    addrs = [spare.data_ptr() + (room - 5) * block] * n  # room for 5 blocks from there, not 6
    groups = [GroupBlocks(2, [3, 4])]
    if why == "group id":
        groups = [GroupBlocks(2, [3, 5])]
    elif why == "room":
        groups = [GroupBlocks(2, [3, 4, 5])]  # 6 staging blocks: the last runs past the declared staging
    got = _check(agents, addrs, [0, 1, 2], group_blocks=groups)
    if not why:
        assert isinstance(got, CheckedStream), got
        assert got.side.num_blocks == 5
        return
    assert isinstance(got, str), f"{why}: accepted"
    assert got.startswith("group_blocks[0].block_ids" if why == "group id" else "staging_addrs"), got


def test_pages_of_the_same_sizes_in_another_order_are_refused_without_staging(agents: Agents) -> None:
    """HND against NHD pages have the same sizes: moved as they are they would be silently wrong."""
    got = _check(agents, [], [0, 1], attn_layout="NHD")
    assert isinstance(got, str) and "attn_layout=NHD" in got and "staging_addrs" in got, got
    assert isinstance(_check(agents, [], [0, 1]), CheckedStream)


def test_a_staged_stream_given_up_mid_way_gives_its_staging_back_once_the_prefill_stopped() -> None:
    """A decode request aborted while its stream lands in staging: the prefill rank stops the stream and says so
    once no WRITE is in flight, and the staging goes back then, not after the stream's whole window (60 s here);
    no block of the decode rank was written."""
    prefill_side, decode_side, _ = ROWS["block 16 -> 32"]
    tokens = 150
    loaded = tokens - 1
    remote_ids = list(range(-(-tokens // prefill_side.block_size)))
    local_ids = list(range(20, 20 + -(-loaded // decode_side.block_size)))
    port = free_ports(1, run=1)[0]
    (prefill, _, views), = make_workers("prefill", prefill_side, port, "cpu", remote_ids, tokens, secret=SECRET,
                                        stream_min_tokens=0)
    (decode, base, _), = make_workers("decode", decode_side, free_ports(1, run=1)[0], "cpu", secret=SECRET)
    try:
        granted = granted_stream(remote_ids, tokens, port, 1)
        step = granted.step
        prefill.start_load_kv(step)
        decode.start_load_kv(P2pKvMetadata(loads=[LoadSpec("d-req", tuple(local_ids), (), granted.remote,
                                                           num_tokens=loaded, stream_grant=granted.grant)]))
        names = list(views)
        prefill.save_kv_layer(names[0], step)  # one layer lands in staging
        deadline = time.monotonic() + 10
        while decode.receiver.stager.idle:
            assert time.monotonic() < deadline, "the stream never took its staging"
            decode.get_finished()
            time.sleep(0.002)
        time.sleep(0.2)
        decode.start_load_kv(P2pKvMetadata(ended_streams=["d-req"]))  # vLLM aborted the request
        finished: set[str] = set()
        while not (decode.receiver.stager.idle and "d-req" in finished):
            assert time.monotonic() < deadline, "the given-up stream's staging was held beyond the prefill's word"
            finished |= decode.get_finished()[1]
            time.sleep(0.002)
        for name in names[1:]:
            prefill.save_kv_layer(name, step)
        prefill.wait_for_save()
        assert not base.any(), "a given-up stream wrote into the decode blocks"
    finally:
        decode.shutdown()
        prefill.shutdown()
