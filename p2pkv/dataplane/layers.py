"""A transfer cut by layer: the descriptor rows that move one layer's pages of a request's blocks.

Layer-streamed transfer WRITEs each layer's KV as soon as the prefill has
computed it, so its rows must be grouped by layer. A *page* is one block of
one layer (or one layer's K or V when a backend keeps them apart); a
:class:`~p2pkv.dataplane.layout.Segment` covering several layers (a
cross-layer ``BLHNC`` block, or per-layer tensors merged because they touch)
holds its layers' pages one after the other, in ascending layer order, so it
cuts into one segment per page. Layouts whose layers interleave *inside* a
page (``BHLNC`` and the like, :data:`p2pkv.dataplane.negotiate.INTERLEAVED_LAYOUTS`)
have no per-layer page and cannot be cut: the caller refuses them by their
layout name before calling here.

Cost, in descriptors: a per-layer cache (``LBHNC``) keeps each layer's blocks
contiguous, so a run of consecutive block ids is one row per page; a
cross-layer cache strides each layer's page by the whole block, so every
block is one row per page. Vectorised with numpy: no Python loop per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from handshake import KVLayoutDesc
from p2pkv.dataplane.layout import LayoutError, Segment
from p2pkv.dataplane.negotiate import page_bytes, remote_segments
from p2pkv.dataplane.plan import PlanError, build_descriptors, coalesce_runs


@dataclass(frozen=True)
class LayerRows:
    """One layer's share of a transfer: rows that pair up one for one.

    Attributes:
        layer: the layer (0-based).
        source: uint64 [n, 3] ``(addr, len, device_id)`` rows on the side that sends.
        target: uint64 [n, 3] rows on the side that receives, the same lengths row by row.
    """

    layer: int
    source: np.ndarray
    target: np.ndarray

    @property
    def num_bytes(self) -> int:
        """Bytes this layer's rows move."""
        return int(self.source[:, 1].sum())


def page_segments(segments: Sequence[Segment], page_bytes: int) -> list[Segment]:
    """Each segment cut into one segment per page, in the order peers agree on (ascending layer, K before V).

    Args:
        segments: a KV layout's segments (:attr:`p2pkv.dataplane.layout.KVLayout.segments`,
            or a peer's from its handshake), in that order.
        page_bytes: bytes of one page (one block of one layer, or of its K or V).

    Returns:
        One :class:`Segment` per page: ``length == page_bytes``, ``num_layers == 1``,
        the block stride of the segment it came from.

    Raises:
        LayoutError: ``page_bytes`` is not positive, a segment is not a whole
            number of pages, or a segment's pages are not one per layer it covers.
    """
    if page_bytes <= 0:
        raise LayoutError(f"page size must be > 0 bytes, got {page_bytes}")
    out: list[Segment] = []
    for seg in segments:
        pages, rest = divmod(seg.length, page_bytes)
        if rest or pages != seg.num_layers:
            raise LayoutError(f"a segment of {seg.length} B over {seg.num_layers} layers is not one "
                              f"{page_bytes}-B page per layer; it cannot be moved layer by layer")
        out.extend(Segment(seg.addr + q * page_bytes, page_bytes, seg.block_stride, seg.layer_start + q, 1,
                           seg.kv_index) for q in range(pages))
    return out


def pages_of(desc: KVLayoutDesc) -> list[Segment]:
    """A rank's pages (:func:`page_segments`) from its :class:`handshake.KVLayoutDesc` (the segments it declares,
    never its bytes), as a layer stream sees that rank.

    Raises:
        LayoutError: its segments are not one page per layer (an interleaved layout).
    """
    return page_segments(remote_segments(desc), page_bytes(desc))


def groups_by_layer(layer_of: Mapping[str, int], group_of: Mapping[str, int],
                 state_groups: frozenset[int]) -> dict[int, tuple[int, ...]]:
    """Layer index → the KV cache groups whose blocks a layer stream WRITEs into that layer's pages: the groups of
    the attention layers sharing its tensor (vLLM's hybrid KV cache: tensor ``i`` holds layer ``i`` of each
    attention group), and every state (Mamba/SSM) group, whose blocks are pages of every tensor
    (:class:`p2pkv.prefill.prefill_streams.PrefillStreams` WRITEs them so).

    Args:
        layer_of: attention layer name → its layer index (:func:`p2pkv.prefill.prefill_streams.layer_indices`).
        group_of: layer name → its KV cache group (a name not in it: group 0).
        state_groups: the indices of the groups that hold Mamba/SSM state.

    Example: ``{"full.0": 0, "window.0": 0}``, ``{"full.0": 0, "window.0": 1}``, ``{2}`` → ``{0: (0, 1, 2)}``.
    """
    out: dict[int, set[int]] = {}
    for name, layer in layer_of.items():
        out.setdefault(layer, set(state_groups)).add(group_of.get(name, 0))
    return {layer: tuple(sorted(groups)) for layer, groups in out.items()}


def heads_of(page: Segment, heads: int, start: int, count: int) -> Segment:
    """Heads ``start .. start + count - 1`` of a head-major ``page`` of ``heads`` heads (each ``page.length / heads``
    bytes, one contiguous run): the slice of it a stream between TP sizes moves."""
    per_head = page.length // heads
    return Segment(page.addr + start * per_head, count * per_head, page.block_stride, page.layer_start,
                   page.num_layers, page.kv_index)


def layer_rows(source_pages: Sequence[Segment], target_pages: Sequence[Segment],
               source_ids: Sequence[int] | np.ndarray, target_ids: Sequence[int] | np.ndarray, *,
               source_num_blocks: int, target_num_blocks: int, source_device: int = 0,
               target_device: int = 0) -> list[LayerRows]:
    """The rows moving page ``p`` of block ``source_ids[i]`` into page ``p`` of block ``target_ids[i]``, per layer.

    Both sides must hold the same pages (one per layer, or K and V apart, the
    same on both sides) of the same size: a homogeneous pair (block size, page
    order and heads equal), where a page moves as it is, or a slice of heads of
    each side's head-major pages
    (:func:`p2pkv.prefill.stream_requests.slice_sides`).

    Args:
        source_pages: the sending side's :func:`page_segments`.
        target_pages: the receiving side's :func:`page_segments`.
        source_ids: source block ids, int [n].
        target_ids: target block ids, int [n] (no id twice: one source per target block).
        source_num_blocks: blocks in the source cache (ids below it).
        target_num_blocks: blocks in the target cache.
        source_device: device id in the source rows.
        target_device: device id in the target rows.

    Returns:
        One :class:`LayerRows` per layer, ascending (empty rows when ``n`` is 0).
        A page pair whose blocks are contiguous on both sides moves runs of
        consecutive ids as one row; any other pair, one row per block.

    Raises:
        PlanError: the sides' pages differ (count, size, layer or K/V), or bad
            block ids (lengths differ, an id out of range, a target id repeated).
    """
    if len(source_pages) != len(target_pages):
        raise PlanError(f"the source has {len(source_pages)} pages per block, the target {len(target_pages)}")
    for src, dst in zip(source_pages, target_pages, strict=True):
        if (src.length, src.layer_start, src.kv_index) != (dst.length, dst.layer_start, dst.kv_index):
            raise PlanError(f"pages differ: source {src.length} B of layer {src.layer_start} (K/V {src.kv_index}), "
                            f"target {dst.length} B of layer {dst.layer_start} (K/V {dst.kv_index})")
    dst_starts, src_starts, lengths = coalesce_runs(target_ids, source_ids, target_num_blocks, source_num_blocks)
    dst_blocks, src_blocks, ones = _blocks(dst_starts, src_starts, lengths)
    by_layer: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for src, dst in zip(source_pages, target_pages, strict=True):
        if src.blocks_contiguous and dst.blocks_contiguous:
            s, d = (build_descriptors([src], src_starts, lengths, source_device),
                    build_descriptors([dst], dst_starts, lengths, target_device))
        else:
            s, d = (build_descriptors([src], src_blocks, ones, source_device),
                    build_descriptors([dst], dst_blocks, ones, target_device))
        rows = by_layer.setdefault(src.layer_start, ([], []))
        rows[0].append(s)
        rows[1].append(d)
    empty = np.zeros((0, 3), dtype=np.uint64)
    return [LayerRows(layer, np.concatenate(s) if s else empty, np.concatenate(d) if d else empty)
            for layer, (s, d) in sorted(by_layer.items())]


def _blocks(dst_starts: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs expanded back to one entry per block: ``(dst ids, src ids, ones)``, int64 [n]."""
    total = int(lengths.sum())
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    offsets = np.arange(total, dtype=np.int64) - first
    return (np.repeat(dst_starts, lengths) + offsets, np.repeat(src_starts, lengths) + offsets,
            np.ones(total, dtype=np.int64))
