"""A decode rank's stream request (:class:`handshake.StreamRequest`) checked on a prefill rank, in a fixed order.

Each check refuses with a message naming the field, and nothing is loaded
or kept for a refused request (:func:`check_stream_request`): the rank can
stream at all (its pages cut one per layer, a secret to check grants); the
agent is the requester's own (:func:`p2pkv.prefill.push_requests.requester_identity`);
the grant names this engine, its pipeline stages (``pp_size``) and the
requester (or any decode engine) and has not expired; the agent's metadata (on a pipeline stage: its pages of the
stage's layers) is well formed and its pages are this
rank's (same page size, layer and K/V order, heads, HND/NHD, dtype and block
size: a stream moves pages as they are), or, with ``head_slice``, both
ranks' pages are head-major with the same block size and bytes per head and
the slice lies within both ranks' heads (a stream moves that slice of each
page into the same slice of the decode rank's), or, with ``staging_addrs``, its
staging destination mirrors this rank's regions inside the staging the agent
declares (as many staging blocks as all of its groups' block lists hold);
it names one block list per KV cache group of this engine; its block ids
lie in its cache (or staging); the request's window has not passed.
What needs the rank's state (a stream id served once, room for pending
destinations) is checked by :class:`p2pkv.prefill.prefill_streams.PrefillStreams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from handshake import HeadSlice, KVLayoutDesc, KVRegion, StreamRequest
from p2pkv.dataplane.agent import check_peer_info
from p2pkv.dataplane.layers import heads_of, page_segments
from p2pkv.dataplane.layout import LayoutError, Segment
from p2pkv.dataplane.negotiate import HEAD_MAJOR, PairRefused, page_bytes, remote_segments
from p2pkv.dataplane.plan import PlanError, check_block_ids, check_rows_in_regions
from p2pkv.dataplane.stages import StageLayers, stage_view
from p2pkv.grant import StreamGrant, StreamGrantError, check_stream_grant
from p2pkv.prefill.agents import Identity
from p2pkv.prefill.layer_stream import StreamSide
from p2pkv.prefill.push_requests import requester_identity


def stream_side(desc: KVLayoutDesc) -> StreamSide:
    """A rank's :class:`StreamSide` from its :class:`handshake.KVLayoutDesc`.

    Raises:
        LayoutError: its pages cannot be cut one per layer (an interleaved layout).
    """
    segments = remote_segments(desc)
    pages = page_segments(segments, page_bytes(desc))
    geometry = (desc.attn_layout, desc.dtype, desc.num_kv_heads, desc.head_dim, desc.block_size, desc.is_mla)
    return StreamSide(tuple(pages), desc.num_blocks, desc.regions[0].device_id if desc.regions else 0,
                      tuple(segments), geometry)


def staging_side(source: StreamSide, addrs: Sequence[int], num_blocks: int, device_id: int,
                 declared: Sequence[KVRegion]) -> StreamSide | str:
    """A decode rank's staging destination as a stream moves this rank's pages into it.

    Staging mirrors this rank's regions (:func:`p2pkv.dataplane.staging.staging_segments`, where a decode
    rank lays out a staged READ): region ``r``'s ``num_blocks`` blocks lie back to back from ``addrs[r]``,
    each ``block_len`` bytes (this rank's), its pages in this rank's order.

    Args:
        source: this rank's pages (with their :attr:`StreamSide.segments`).
        addrs: the request's ``staging_addrs``, one per region of this rank.
        num_blocks: staging blocks (the request's ``block_ids`` and every list of its ``group_blocks``).
        device_id: the decode rank's device id (its KV cache's).
        declared: the staging regions the decode rank's :class:`handshake.AgentInfo` declares.

    Returns:
        The staging as a :class:`StreamSide`, or why it is refused (naming ``staging_addrs``).
    """
    if len(addrs) != len(source.segments):
        return (f"staging_addrs: {len(addrs)} addresses, but this rank's cache has {len(source.segments)} regions "
                "(one address per region, in its order)")
    segments = [Segment(addr, seg.length, seg.length, seg.layer_start, seg.num_layers, seg.kv_index)
                for addr, seg in zip(addrs, source.segments, strict=True)]
    rows = np.array([[s.addr, num_blocks * s.length, device_id] for s in segments], dtype=np.uint64)
    try:
        check_rows_in_regions(rows, [(r.base_addr, r.length, r.device_id) for r in declared])
    except PlanError as exc:
        return f"staging_addrs: {exc} (outside the staging the agent declares)"
    pages = page_segments(segments, source.pages[0].length)
    return StreamSide(tuple(pages), num_blocks, device_id, tuple(segments), source.geometry)


def slice_sides(source: StreamSide, side: StreamSide, cut: HeadSlice) -> tuple[StreamSide, StreamSide] | str:
    """This rank's pages and a decode rank's, each cut to ``cut``'s slice of heads: the pages a stream with a
    ``head_slice`` reads here and WRITEs there (page ``i`` of one into page ``i`` of the other).

    A page of a head-major cache (HND, or vLLM's CPU attention page) is ``[heads, block_size, ...]``, so a
    slice of heads is one contiguous run of ``num_heads`` × (the page's bytes / its heads) bytes.

    Args:
        source: this rank's pages (its :attr:`StreamSide.geometry` known).
        side: the decode rank's own pages.
        cut: the request's ``head_slice`` (heads counted within each rank's heads).

    Returns:
        ``(this rank's slices, the decode rank's slices)``, or why they cannot pair (naming ``head_slice``).
    """
    if not source.geometry or not side.geometry:
        return "head_slice: this rank's or the decode rank's page geometry is unknown"
    layout, dtype, heads, head_dim, block_size, mla = source.geometry
    their_layout, their_dtype, their_heads, their_head_dim, their_block_size, their_mla = side.geometry
    if mla or their_mla:
        return "head_slice: an MLA latent has no heads to slice; send it without head_slice"
    if layout != their_layout or layout not in HEAD_MAJOR:
        return (f"head_slice: pages must be head-major on both ranks (one of {sorted(HEAD_MAJOR)}), this rank's "
                f"are {layout}, the decode rank's {their_layout}; send staging_addrs (a staged stream)")
    if (dtype, head_dim, block_size) != (their_dtype, their_head_dim, their_block_size):
        return (f"head_slice: dtype, head_dim and block_size differ (this rank {dtype}, {head_dim}, {block_size}; "
                f"the decode rank {their_dtype}, {their_head_dim}, {their_block_size}); send staging_addrs")
    for name, start, count in (("prefill", cut.prefill_head_start, heads),
                               ("decode", cut.decode_head_start, their_heads)):
        if start + cut.num_heads > count:
            return (f"head_slice: heads {start}..{start + cut.num_heads - 1} lie outside the {name} rank's "
                    f"{count} heads")
    order = [(p.layer_start, p.kv_index) for p in source.pages]
    if order != [(p.layer_start, p.kv_index) for p in side.pages] or any(
            p.length % heads or q.length % their_heads or p.length // heads != q.length // their_heads
            for p, q in zip(source.pages, side.pages, strict=True)):
        return (f"head_slice: the decode rank's {len(side.pages)} pages per block are not this rank's "
                f"{len(order)} in the same layer and K/V order with the same bytes per head; send staging_addrs")
    mine = tuple(heads_of(p, heads, cut.prefill_head_start, cut.num_heads) for p in source.pages)
    theirs = tuple(heads_of(p, their_heads, cut.decode_head_start, cut.num_heads) for p in side.pages)
    return (StreamSide(mine, source.num_blocks, source.device_id, source.segments, source.geometry),
            StreamSide(theirs, side.num_blocks, side.device_id, side.segments, side.geometry))


@dataclass(frozen=True)
class CheckedStream:
    """A stream request that passed :func:`check_stream_request`.

    Attributes:
        identity: the requesting decode rank, ``(engine id, tp rank)``.
        grant: its checked grant.
        side: the decode rank's memory as the stream moves it.
        window_s: seconds from now within which the stream must end (the decode rank gives it up then).
        source_pages: this rank's pages the stream reads for it (a ``head_slice`` of each); empty: its pages
            whole.
    """

    identity: Identity
    grant: StreamGrant
    side: StreamSide
    window_s: float
    source_pages: tuple[Segment, ...] = ()


def check_stream_request(msg: StreamRequest, source: StreamSide | str, secret: bytes | None, engine_id: str,
                         now: float, kv_groups: int = 1, max_lifetime_s: float = 480.0,
                         stage: StageLayers | None = None, pp_size: int = 1) -> CheckedStream | str:
    """Check ``msg`` against this rank (see the module docstring for the order).

    Args:
        msg: the request, as the side channel decoded it (every field the sender's choice).
        source: this rank's pages, or why it cannot stream.
        secret: checks the grant (None: this rank streams nothing).
        engine_id: this engine's id (the grant must name it).
        now: ``time.time()`` seconds (the grant's expiry and the request's window).
        kv_groups: KV cache groups of this engine (``group_blocks`` names the ones after the first).
        max_lifetime_s: how far past ``now`` the grant's expiry may lie (seconds).
        stage: this rank's pipeline stage (None: it holds every layer): the decode rank's pages it streams into
            are those of the stage's layers (:func:`p2pkv.dataplane.stages.stage_view` of the agent's layout).
        pp_size: this engine's pipeline stages (the grant must name them).

    Returns:
        The checked request, or why it is refused (a message naming the field).
    """
    if isinstance(source, str) or not secret:
        return source if isinstance(source, str) else "this engine runs without a secret"
    identity, why = requester_identity(msg)
    if identity is None:
        return why
    try:
        grant = check_stream_grant(msg.grant, secret, prefill_engine_id=engine_id,
                                   decode_engine_id=msg.requester_engine_id, now=now, max_lifetime_s=max_lifetime_s,
                                   pp_size=pp_size)
    except StreamGrantError as exc:
        return str(exc)
    try:
        check_peer_info(msg.agent)
        layout = msg.agent.layout
        if stage is not None:  # a pipeline stage WRITEs its layers into the decode rank's matching layers
            layout = stage_view(layout, remote_segments(layout), stage)[0]
        side = stream_side(layout)
    except (LayoutError, PairRefused) as exc:
        return f"agent.layout: {exc}"
    except Exception as exc:
        return f"agent: {exc}"
    if len(msg.group_blocks) != kv_groups - 1:
        return (f"group_blocks: {len(msg.group_blocks)} KV cache group(s) after the first, but this engine has "
                f"{kv_groups} groups; run both engines with the same model and hybrid KV cache manager setting")
    source_pages: tuple[Segment, ...] = ()
    if msg.head_slice is not None:
        if msg.staging_addrs:
            return "head_slice: goes without staging_addrs (a slice lands in the decode rank's own blocks)"
        cut = slice_sides(source, side, msg.head_slice)
        if isinstance(cut, str):
            return cut
        source_pages, side = cut[0].pages, cut[1]
    elif msg.staging_addrs:
        num_blocks = len(msg.block_ids) + sum(len(named.block_ids) for named in msg.group_blocks)
        staged = staging_side(source, msg.staging_addrs, num_blocks, side.device_id, msg.agent.staging)
        if isinstance(staged, str):
            return staged
        side = staged
    elif (why := pages_differ(source, side)) is not None:
        return why
    try:
        check_block_ids(msg.block_ids, side.num_blocks, "staging" if msg.staging_addrs else "decode")
    except PlanError as exc:
        return f"block_ids: {exc}"
    for group, named in enumerate(msg.group_blocks, 1):
        try:
            check_block_ids(named.block_ids, side.num_blocks, "staging" if msg.staging_addrs else "decode")
        except PlanError as exc:
            return f"group_blocks[{group - 1}].block_ids: {exc}"
    window_s = min(float(msg.window_s), msg.sent_at + msg.window_s - now, max_lifetime_s)
    if window_s <= 0:
        return "window_s passed before the request was handled (a busy side channel)"
    return CheckedStream(identity, grant, side, window_s, source_pages)


def pages_differ(ours: StreamSide, theirs: StreamSide) -> str | None:
    """Why a decode rank's pages cannot take this rank's as they are (count, size, layer or K/V order, or the
    :attr:`StreamSide.geometry`: HND/NHD, dtype, heads, block size), or None. Such a decode rank streams into
    its staging (``staging_addrs``)."""
    mine = [(p.length, p.layer_start, p.kv_index) for p in ours.pages]
    if mine != [(p.length, p.layer_start, p.kv_index) for p in theirs.pages]:
        return (f"the decode rank's {len(theirs.pages)} pages per block differ from this rank's {len(mine)} "
                "(page size, layer or K/V order): send staging_addrs (a staged stream), or send such pairs "
                "without a grant (push)")
    if ours.geometry and theirs.geometry and ours.geometry != theirs.geometry:
        return (f"the decode rank's pages are {_geometry(theirs)}, this rank's {_geometry(ours)}: the same "
                "sizes in another order; send staging_addrs (a staged stream), or send such pairs without a "
                "grant (push)")
    return None


def _geometry(side: StreamSide) -> str:
    """``side.geometry`` named field by field."""
    names = ("attn_layout", "dtype", "num_kv_heads", "head_dim", "block_size", "is_mla")
    return ", ".join(f"{n}={v}" for n, v in zip(names, side.geometry, strict=True))
