"""Staging memory for pulls that need a fixup, and torch page views of KV memory.

A decode worker that pulls from a peer with another block size, HND/NHD
order or TP size READs whole remote blocks into a staging area registered
with NIXL (on the KV cache's device), then :func:`p2pkv.dataplane.fixup.fixup_pages`
moves every token into its local block. :class:`StagingArena` hands out
byte ranges of that area, first fit, and takes them back when the fixup is
done; a pull that does not fit yet waits for one that finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p2pkv.dataplane.layout import Segment

ALIGN = 256
"""Allocation granularity of the arena (bytes)."""


class StagingFull(RuntimeError):
    """A pull needs more staging bytes than the whole arena has; the message names ``staging_mib``."""


class StagingArena:
    """First-fit allocator of byte ranges ``[offset, offset + size)`` inside ``capacity`` bytes.

    Args:
        capacity: arena size (bytes).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted, non-adjacent (offset, size)

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out."""
        return sum(size for _, size in self._free)

    def alloc(self, size: int) -> int | None:
        """Offset of ``size`` bytes (rounded up to :data:`ALIGN`), or None when no free range is big enough now.

        Raises:
            StagingFull: ``size`` exceeds the whole arena.
        """
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        if size > self.capacity:
            raise StagingFull(f"a pull needs {size / 2**20:.1f} MiB of staging but staging_mib is "
                              f"{self.capacity / 2**20:.1f} MiB; raise staging_mib in kv_connector_extra_config")
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                return off
        return None

    def release(self, offset: int, size: int) -> None:
        """Give back a range from :meth:`alloc` (same ``size``)."""
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, sz in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._free = merged


def staging_segments(remote: Sequence[Segment], base: int, num_blocks: int) -> list[Segment]:
    """Where ``num_blocks`` remote blocks land in staging, mirroring the remote segments.

    Staging holds, for each remote segment in order, ``num_blocks`` pages of
    it back to back, so runs of remote blocks stay runs in staging (one
    descriptor per run per segment).
    """
    out, addr = [], base
    for seg in remote:
        out.append(Segment(addr, seg.length, seg.length, seg.layer_start, seg.num_layers, seg.kv_index))
        addr += num_blocks * seg.length
    return out


@dataclass(frozen=True)
class PageGroup:
    """Consecutive pages that one strided view covers: pages ``[start, start + count)``.

    Attributes:
        start: first page index (in the order both peers agree on).
        count: pages in the group.
        page_stride: bytes between consecutive pages of one block.
        block_stride: bytes between consecutive blocks of one page.
        addr: address of page ``start`` of block 0 (bytes).
    """

    start: int
    count: int
    page_stride: int
    block_stride: int
    addr: int


def page_groups(segments: Sequence[Segment], page_bytes: int) -> list[PageGroup]:
    """Group a cache's pages into as few uniformly strided ``[pages, blocks, page]`` views as possible.

    A cross-layer segment is one group (pages ``page_bytes`` apart); per-layer
    segments at a constant, increasing distance (one allocation) merge into
    one group.
    """
    pages = [(seg.addr + q * page_bytes, seg.block_stride) for seg in segments
             for q in range(seg.length // page_bytes)]
    groups: list[PageGroup] = []
    for index, (addr, block_stride) in enumerate(pages):
        g = groups[-1] if groups else None
        if g is not None and g.block_stride == block_stride:
            if g.count == 1 and addr > g.addr:
                groups[-1] = PageGroup(g.start, 2, addr - g.addr, block_stride, g.addr)
                continue
            if g.count > 1 and addr == g.addr + g.count * g.page_stride:
                groups[-1] = PageGroup(g.start, g.count + 1, g.page_stride, block_stride, g.addr)
                continue
        groups.append(PageGroup(index, 1, page_bytes, block_stride, addr))
    return groups


def page_view(base: Any, base_addr: int, group: PageGroup, num_blocks: int, page_bytes: int) -> Any:
    """A ``[group.count, num_blocks, page_bytes / itemsize]`` view into ``base`` (no copy).

    Args:
        base: 1-D tensor over the allocation that holds the group.
        base_addr: address of ``base``'s element 0 (bytes).
        group: the pages to view.
        num_blocks: blocks in the view.
        page_bytes: bytes per page.

    Raises:
        ValueError: addresses or strides not multiples of ``base``'s element size.
    """
    isz = base.element_size()
    parts = (group.addr - base_addr, group.page_stride, group.block_stride, page_bytes)
    if any(p % isz for p in parts):
        raise ValueError(f"page offsets/strides {parts} are not multiples of {isz}-byte elements")
    return base.as_strided((group.count, num_blocks, page_bytes // isz),
                           (group.page_stride // isz, group.block_stride // isz, 1),
                           base.storage_offset() + (group.addr - base_addr) // isz)
