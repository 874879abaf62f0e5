"""KV memory layout: tensors' shapes and strides → registered regions and block byte ranges.

vLLM hands the connector one tensor per attention layer (``kv_caches``). In
vLLM 0.32 these are views into one allocation whose physical order is a
``KVCacheLayout`` over logical ``[L, B, H, N, C]``: layer-compact layouts
(``LBHNC``: every layer's pages in its own contiguous span) or block-outermost
ones (``BLHNC``: all layers of one block side by side, "cross-layer blocks").
Some backends also split K and V (a leading dim of 2 before the block dim).

This module describes any of them the same way, from the tensors' real
pointers, shapes and strides, never from assumptions:

* a *segment* is a byte range that every block owns once: for block ``b``
  it starts at ``base + offset + b * block_stride`` and is ``length`` bytes
  long. A layer-compact cache has one segment per layer (×2 when K and V
  are split); a cross-layer cache has ONE segment per block for all layers,
  because adjacent segments that are contiguous for every block are merged.
* a *region* is one allocation to register with NIXL.

Everything here is pure Python over integers; :func:`describe_torch_kv_caches`
reads the integers off torch tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """A KV cache layout p2pkv cannot describe; the message says what and why."""


@dataclass(frozen=True)
class TensorInfo:
    """What p2pkv needs to know about one layer's KV tensor.

    Attributes:
        name: the layer name vLLM gave.
        data_ptr: address of element 0 (bytes).
        shape: tensor shape (elements per dim).
        strides: tensor strides (elements per dim).
        itemsize: bytes per element.
        storage_ptr: address of the underlying allocation (bytes).
        storage_nbytes: size of the underlying allocation (bytes).
    """

    name: str
    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    storage_ptr: int
    storage_nbytes: int


@dataclass(frozen=True)
class Region:
    """One allocation to register with NIXL: ``[addr, addr + length)`` bytes."""

    addr: int
    length: int


@dataclass(frozen=True)
class Segment:
    """A per-block byte range: block ``b`` owns ``[addr + b * block_stride, + length)``.

    Attributes:
        addr: absolute address of block 0's range (bytes).
        length: bytes per block in this segment.
        block_stride: bytes between consecutive blocks.
        layer_start: first layer covered.
        num_layers: layers covered (all of them for a cross-layer segment).
        kv_index: 0 (K), 1 (V) or -1 (K and V together).
    """

    addr: int
    length: int
    block_stride: int
    layer_start: int
    num_layers: int
    kv_index: int = -1

    @property
    def blocks_contiguous(self) -> bool:
        """True when consecutive blocks' ranges touch, so runs coalesce."""
        return self.block_stride == self.length


@dataclass(frozen=True)
class KVLayout:
    """The whole KV cache of one worker.

    Attributes:
        num_blocks: blocks per layer.
        num_layers: attention layers.
        regions: allocations to register.
        segments: per-block byte ranges in the order peers agree on
            (ascending layer, K before V).
        block_bytes: bytes of one block over all segments.
    """

    num_blocks: int
    num_layers: int
    regions: tuple[Region, ...]
    segments: tuple[Segment, ...]

    @property
    def block_bytes(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def cross_layer(self) -> bool:
        """True when one segment covers all layers (one descriptor per block)."""
        return len(self.segments) == 1 and self.segments[0].num_layers == self.num_layers


def _page_bytes(info: TensorInfo, block_dim: int) -> int:
    """Bytes of one block's page: the dims after ``block_dim`` must be dense."""
    inner = sorted(
        ((info.strides[d], info.shape[d]) for d in range(block_dim + 1, len(info.shape))),
        key=lambda x: x[0],
    )
    expected = 1
    for stride, size in inner:
        if size == 1:
            continue
        if stride != expected:
            raise LayoutError(
                f"layer {info.name}: one block's page is not contiguous in memory "
                f"(shape {info.shape}, strides {info.strides}); p2pkv needs the "
                "dims after the block dim to be dense"
            )
        expected *= size
    return expected * info.itemsize


def _tensor_segments(info: TensorInfo, layer: int, num_blocks: int) -> list[Segment]:
    """Segments of one layer tensor: 1, or 2 when a leading K/V dim of 2 precedes blocks."""
    if num_blocks == 2 and info.shape[:2] == (2, 2):
        raise LayoutError(
            f"layer {info.name}: shape {info.shape} is ambiguous with num_blocks=2 (K/V dim or "
            "block dim first?); give the KV cache more blocks"
        )
    if len(info.shape) >= 2 and info.shape[0] == num_blocks:
        return [
            Segment(
                addr=info.data_ptr,
                length=_page_bytes(info, 0),
                block_stride=info.strides[0] * info.itemsize,
                layer_start=layer,
                num_layers=1,
            )
        ]
    if len(info.shape) >= 3 and info.shape[0] == 2 and info.shape[1] == num_blocks:
        page = _page_bytes(info, 1)
        return [
            Segment(
                addr=info.data_ptr + kv * info.strides[0] * info.itemsize,
                length=page,
                block_stride=info.strides[1] * info.itemsize,
                layer_start=layer,
                num_layers=1,
                kv_index=kv,
            )
            for kv in (0, 1)
        ]
    raise LayoutError(
        f"layer {info.name}: shape {info.shape} has no block dim of size {num_blocks} "
        "in position 0 (or 1 after a K/V dim of 2); p2pkv cannot describe this layout"
    )


def _merge(segments: list[Segment]) -> list[Segment]:
    """Merge neighbours that are contiguous for every block (same stride, touching)."""
    out: list[Segment] = []
    for seg in segments:
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.block_stride == seg.block_stride
            and prev.addr + prev.length == seg.addr
            and prev.kv_index == seg.kv_index
            and prev.layer_start + prev.num_layers == seg.layer_start
            and prev.length + seg.length <= seg.block_stride
        ):
            out[-1] = Segment(
                addr=prev.addr,
                length=prev.length + seg.length,
                block_stride=prev.block_stride,
                layer_start=prev.layer_start,
                num_layers=prev.num_layers + seg.num_layers,
                kv_index=prev.kv_index,
            )
        else:
            out.append(seg)
    return out


def describe_kv_caches(tensors: list[TensorInfo], num_blocks: int) -> KVLayout:
    """Describe a worker's KV cache from its per-layer tensors.

    Args:
        tensors: one :class:`TensorInfo` per attention layer, in layer order.
        num_blocks: blocks per layer (``kv_cache_config.num_blocks``).

    Returns:
        The :class:`KVLayout`; adjacent segments that are contiguous for
        every block are merged (cross-layer blocks become one segment).

    Raises:
        LayoutError: no tensors, pages that are not contiguous, no block dim,
            layers of different page sizes, or blocks that overlap each other
            or fall outside their allocation.
    """
    if not tensors:
        raise LayoutError("no KV cache tensors to register (is the model attention-free?)")
    if num_blocks <= 0:
        raise LayoutError(f"num_blocks must be > 0, got {num_blocks}")
    try:
        return _describe_per_layer(tensors, num_blocks)
    except LayoutError as per_layer_error:
        union = _block_union(tensors, num_blocks)
        if union is None:
            raise per_layer_error from None
        return union


def _block_union(tensors: list[TensorInfo], num_blocks: int) -> KVLayout | None:
    """Block-outermost layouts whose per-layer pages interleave (e.g. ``BHLNC``).

    Each layer's page of a block is not contiguous on its own, but all layers'
    pages of one block together tile one contiguous range: that range is one
    segment. Returns None when they do not.
    """
    if any(t.shape[0] != num_blocks for t in tensors) or len({t.strides[0] for t in tensors}) != 1:
        return None
    itemsize = tensors[0].itemsize
    block_stride = tensors[0].strides[0] * itemsize
    lo = min(t.data_ptr for t in tensors)
    hi = max(t.data_ptr + (sum((n - 1) * st for n, st in zip(t.shape[1:], t.strides[1:], strict=True)) + 1)
             * t.itemsize for t in tensors)
    total = sum(math.prod(t.shape[1:]) * t.itemsize for t in tensors)
    if hi - lo != total or total > block_stride or len({t.storage_ptr for t in tensors}) != 1:
        return None
    info = tensors[0]
    if lo < info.storage_ptr or lo + (num_blocks - 1) * block_stride + total > info.storage_ptr + info.storage_nbytes:
        return None
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=len(tensors),
        regions=(Region(info.storage_ptr, info.storage_nbytes),),
        segments=(Segment(lo, total, block_stride, 0, len(tensors)),),
    )


def _describe_per_layer(tensors: list[TensorInfo], num_blocks: int) -> KVLayout:
    """Every layer's page of a block is contiguous: one segment per layer (then merged)."""
    raw: list[Segment] = []
    regions: dict[int, Region] = {}
    for layer, info in enumerate(tensors):
        segs = _tensor_segments(info, layer, num_blocks)
        for seg in segs:
            if seg.block_stride < seg.length:
                raise LayoutError(
                    f"layer {info.name}: blocks overlap (stride {seg.block_stride} B < "
                    f"page {seg.length} B)"
                )
            end = seg.addr + (num_blocks - 1) * seg.block_stride + seg.length
            if seg.addr < info.storage_ptr or end > info.storage_ptr + info.storage_nbytes:
                raise LayoutError(f"layer {info.name}: blocks fall outside their allocation")
        raw.extend(segs)
        regions.setdefault(info.storage_ptr, Region(info.storage_ptr, info.storage_nbytes))
    if len({s.length for s in raw}) != 1:
        raise LayoutError(
            f"layers have different page sizes {sorted({s.length for s in raw})}; "
            "p2pkv supports models whose attention layers share one KV shape"
        )
    # K before V inside each layer, layers ascending: the order both peers agree on.
    raw.sort(key=lambda s: (s.layer_start, s.kv_index))
    if all(s.kv_index == -1 for s in raw):
        merged = _merge(sorted(raw, key=lambda s: s.addr))
        merged.sort(key=lambda s: s.layer_start)
    else:
        merged = raw
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=len(tensors),
        regions=tuple(sorted(regions.values(), key=lambda r: r.addr)),
        segments=tuple(merged),
    )


def tensor_info(name: str, tensor: Any) -> TensorInfo:
    """Read a :class:`TensorInfo` off a torch tensor (CPU or CUDA)."""
    storage = tensor.untyped_storage()
    return TensorInfo(
        name=name,
        data_ptr=int(tensor.data_ptr()),
        shape=tuple(int(s) for s in tensor.shape),
        strides=tuple(int(s) for s in tensor.stride()),
        itemsize=int(tensor.element_size()),
        storage_ptr=int(storage.data_ptr()),
        storage_nbytes=int(storage.nbytes()),
    )


def describe_torch_kv_caches(kv_caches: dict[str, Any], num_blocks: int) -> KVLayout:
    """:func:`describe_kv_caches` for vLLM's ``kv_caches`` dict (layer name → tensor).

    Tensors that are views of one another (layers sharing a cache) are
    described once.
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    infos = []
    for name, tensor in kv_caches.items():
        info = tensor_info(name, tensor)
        key = (info.data_ptr, info.shape)
        if key in seen:
            continue
        seen.add(key)
        infos.append(info)
    return describe_kv_caches(infos, num_blocks)


def check_state_views(layout: KVLayout, views: list[TensorInfo]) -> None:
    """Check that per-block state views (a Mamba layer's conv and SSM state) lie inside the layout's pages.

    vLLM's hybrid KV cache gives a Mamba layer and an attention layer one
    tensor: block ``b`` of the Mamba group is page ``b`` of that tensor, and
    its state views (``[num_blocks, ...]``, block stride = the page's) start
    inside it. A pull moves the whole page of every segment, so a view
    inside a segment's page moves with its block id.

    Raises:
        LayoutError: a view whose first dim is not the block dim, whose block
            stride differs from every segment's, or whose bytes of one block
            leave the segment's page (names the layer).
    """
    for info in views:
        if not info.shape or info.shape[0] != layout.num_blocks:
            raise LayoutError(f"layer {info.name}: state view of shape {info.shape} has no leading block dim of "
                              f"size {layout.num_blocks}")
        stride = info.strides[0] * info.itemsize
        span = (sum((n - 1) * st for n, st in zip(info.shape[1:], info.strides[1:], strict=True)) + 1) * info.itemsize
        inside = any(seg.block_stride == stride and info.data_ptr - seg.addr >= 0
                     and info.data_ptr - seg.addr + span <= seg.length for seg in layout.segments)
        if not inside:
            raise LayoutError(
                f"layer {info.name}: its Mamba/SSM state (block stride {stride} B, {span} B per block) is not "
                "inside an attention layer's KV page; p2pkv moves state only where vLLM's hybrid KV cache "
                "shares the attention tensors")


def detect_attn_layout(tensor: Any, num_heads: int, block_size: int) -> str | None:
    """``"HND"`` or ``"NHD"`` read off a KV tensor's strides, or None when they cannot tell.

    The dims after the block dim that have ``num_heads`` and ``block_size``
    elements are found by size; the one with the larger stride is outer.
    None when the sizes are equal, a size is 1, or either dim is missing.
    """
    if num_heads == block_size or num_heads <= 1 or block_size <= 1:
        return None
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    heads = [d for d in range(1, len(shape)) if shape[d] == num_heads]
    tokens = [d for d in range(1, len(shape)) if shape[d] == block_size]
    if len(heads) != 1 or len(tokens) != 1:
        return None
    return "HND" if strides[heads[0]] > strides[tokens[0]] else "NHD"


def attn_layout_of(tensor: Any, num_heads: int, block_size: int, kv_layout: str, fixed: str | None = None) -> str:
    """The page order of a KV tensor: ``"HND"``, ``"NHD"`` or ``"CPU"``, decided in this one place.

    ``fixed`` (what the platform dictates, e.g. ``"CPU"`` for vLLM's CPU
    attention, whose pages strides cannot tell apart) wins; else the
    tensor's strides (:func:`detect_attn_layout`); else the layout name
    (``...NHC`` → NHD, anything else HND).
    """
    if fixed:
        return fixed
    return detect_attn_layout(tensor, num_heads, block_size) or ("NHD" if kv_layout.endswith("NHC") else "HND")
