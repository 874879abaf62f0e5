"""A decode worker's staging area: registered memory for whole remote blocks, and the fixup into local blocks.

Used only for peers whose blocks differ from ours (block size, HND/NHD
order, TP head split; see :func:`p2pkv.dataplane.negotiate.plan_peer`). The area is
allocated and registered with NIXL on first use, on the KV cache's device,
``staging_mib`` large. A staged pull takes a byte range of it
(:class:`p2pkv.dataplane.staging.StagingArena`), READs the remote blocks there, and
once the READ is done :func:`p2pkv.dataplane.fixup.fixup_pages` moves every token
into its local block in one pass on the device. On CUDA the range is given
back once the fixup kernel has run (a CUDA event), so a later READ cannot
overwrite staging the kernel still reads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handshake import KVLayoutDesc, KVRegion
from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.blockmap import StagedRead
from p2pkv.dataplane.layout import KVLayout, Region, Segment
from p2pkv.dataplane.negotiate import head_bytes, page_bytes
from p2pkv.dataplane.staging import PageGroup, StagingArena, page_groups, page_view, staging_segments
from p2pkv.dataplane.topology import RankRead

_VIEW_DTYPES = ((4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _elem_dtype(*sizes: int) -> torch.dtype:
    """The widest integer dtype whose size divides every byte count (a bitwise copy in fewer, wider elements)."""
    return next(dt for isz, dt in _VIEW_DTYPES if all(s % isz == 0 for s in sizes))


@dataclass
class Stage:
    """One staged READ's share of the staging area.

    Attributes:
        offset: byte offset in the area.
        size: bytes taken.
        read: which remote blocks are staged and where their tokens go.
        segments: where each remote segment's blocks land (see :func:`p2pkv.dataplane.staging.staging_segments`).
    """

    offset: int
    size: int
    read: StagedRead
    segments: list[Segment]


class Stager:
    """Staging memory and the fixup for one decode worker.

    Args:
        agent: the worker's NIXL agent (the area is registered with it).
        kv_caches: layer name → KV tensor (to find the cache memory and device).
        layout: the local :class:`KVLayout`.
        desc: the local layout description.
        capacity: staging bytes (``staging_mib`` × 2**20).
    """

    def __init__(self, agent: NixlTransferAgent, kv_caches: dict[str, Any], layout: KVLayout,
                 desc: KVLayoutDesc, capacity: int) -> None:
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self.cache_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[first.element_size()]
        self.agent, self.layout, self.desc = agent, layout, desc
        self.arena = StagingArena(capacity)
        self._buffer: torch.Tensor | None = None
        self._releases: list[tuple[Any, int, int]] = []
        self._quarantined: list[tuple[float, int, int]] = []
        self._bases: dict[int, torch.Tensor] = {}
        for t in kv_caches.values():
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._bases:
                self._bases[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self._local_groups = page_groups(layout.segments, page_bytes(desc))

    @property
    def device_id(self) -> int:
        """NIXL device id of the staging area (the GPU index; 0 for DRAM)."""
        return (self.device.index or 0) if self.device.type == "cuda" else 0

    def regions(self) -> list[KVRegion]:
        """The staging area as :class:`handshake.AgentInfo` declares it (``staging``): one region once
        registered (on first use), none before."""
        if self._buffer is None:
            return []
        return [KVRegion(base_addr=self._buffer.data_ptr(), length=self._buffer.numel(), device_id=self.device_id)]

    def _area(self) -> torch.Tensor:
        if self._buffer is None:
            buf = torch.empty(self.arena.capacity, dtype=torch.uint8, device=self.device)
            self.agent.register([Region(buf.data_ptr(), buf.numel())], self.agent.mem_type, self.device_id)
            self._buffer = buf
        return self._buffer

    def reserve(self, read: StagedRead, remote: Sequence[Segment]) -> Stage | None:
        """Take staging for ``read`` (None while the area is too full; retry after others finish).

        Raises:
            p2pkv.dataplane.staging.StagingFull: the read alone needs more than ``staging_mib``.
        """
        n = len(read.remote_block_ids)
        size = n * sum(s.length for s in remote)
        offset = self.arena.alloc(size)
        if offset is None:
            return None
        base = self._area().data_ptr() + offset
        return Stage(offset, size, read, staging_segments(remote, base, n))

    @property
    def idle(self) -> bool:
        """True when no stage is handed out or waiting to come back."""
        return self.arena.free_bytes == self.arena.capacity

    def release(self, stage: Stage) -> None:
        """Give a stage's bytes back (after the fixup kernel on CUDA has run)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._releases.append((event, stage.offset, stage.size))
        else:
            self.arena.release(stage.offset, stage.size)

    def quarantine(self, stage: Stage, seconds: float) -> None:
        """Hold a stage whose READ was cancelled in flight for ``seconds`` before reuse.

        NIXL cannot always stop a posted READ: its bytes may still land, and
        must not land in another pull's staging.
        """
        self._quarantined.append((time.monotonic() + seconds, stage.offset, stage.size))

    def poll_releases(self) -> None:
        """Give back stages whose fixup kernels have finished, and quarantined stages whose time is up."""
        now = time.monotonic()
        for item in [q for q in self._quarantined if q[0] <= now]:
            self._quarantined.remove(item)
            self.arena.release(item[1], item[2])
        keep = []
        for event, offset, size in self._releases:
            if event.query():
                self.arena.release(offset, size)
            else:
                keep.append((event, offset, size))
        self._releases = keep

    def fixup(self, stage: Stage, remote: KVLayoutDesc, read: RankRead,
              local_segments: Sequence[Segment] | None = None) -> None:
        """Move a finished staged READ's tokens into the local blocks (in place, on the device).

        Args:
            stage: the READ's staging (``stage.segments``: where each remote segment's blocks landed).
            remote: the prefill rank's layout (its pages' geometry).
            read: which heads go where (:class:`p2pkv.dataplane.topology.RankRead`).
            local_segments: the local segments the remote pages pair with, page ``i`` with page ``i``: a
                pipeline stage's view of this rank (:func:`p2pkv.dataplane.stages.stage_view`, its layers
                only); None: every local segment.

        Raises:
            ValueError: shapes that do not fit (a bug: negotiation checked them).
        """
        from p2pkv.dataplane.fixup import PageFormat, fixup_pages

        rp, lp = page_bytes(remote), page_bytes(self.desc)
        local_groups = self._local_groups if local_segments is None else page_groups(list(local_segments), lp)
        if self.desc.attn_layout == "CPU":  # rows of one element: the view must be the cache's own dtype
            dtype = self.cache_dtype
        else:
            dtype = _elem_dtype(head_bytes(self.desc), rp, lp, *(g.page_stride for g in local_groups),
                                *(g.block_stride for g in local_groups), *(s.length for s in stage.segments))
        isz = torch.empty(0, dtype=dtype).element_size()
        buf = self._area().view(dtype)
        src_groups = page_groups(stage.segments, rp)
        n_src = len(stage.read.remote_block_ids)
        ids = torch.tensor(stage.read.dst_block_ids, dtype=torch.int64, device=self.device)
        moves = _moves(remote, self.desc, read, isz, PageFormat)
        for lo, hi, sg, lg in _overlaps(src_groups, local_groups):
            src = page_view(buf, self._buffer.data_ptr(), sg, n_src, rp)[lo - sg.start:hi - sg.start]
            base_ptr, base = self._base_for(lg)
            dst = page_view(base.view(dtype), base_ptr, lg, self.layout.num_blocks, lp)[lo - lg.start:hi - lg.start]
            for (s0, s1, src_fmt), (d0, d1, dst_fmt), heads in moves:
                fixup_pages(src[..., s0:s1], src_fmt, dst[..., d0:d1], dst_fmt, ids, stage.read.num_tokens,
                            src_token_offset=stage.read.src_token_offset, src_head_start=heads[0],
                            dst_head_start=heads[1], num_heads=heads[2])

    def _base_for(self, group: PageGroup) -> tuple[int, torch.Tensor]:
        for ptr, base in self._bases.items():
            if ptr <= group.addr < ptr + base.numel():
                return ptr, base
        raise ValueError(f"no KV cache allocation holds address {group.addr:#x}")


def _moves(remote: KVLayoutDesc, local: KVLayoutDesc, read: RankRead, isz: int,
           page_format: Any) -> list[tuple[tuple[int, int, Any], tuple[int, int, Any], tuple[int, int, int]]]:
    """The fixup calls one page pair needs: ``((src_lo, src_hi, src_fmt), (dst_lo, dst_hi, dst_fmt), heads)``.

    ``[lo, hi)`` are element ranges inside a page; ``heads`` is ``(src_head_start,
    dst_head_start, num_heads)``. One call for HND/NHD pages. vLLM's CPU pages
    hold, per head, K transposed (``[head_dim, block_size]``) then V
    (``[block_size, head_dim]``): two calls per head, K as ``head_dim`` rows of
    one element per token, V as one row of ``head_dim`` elements per token.
    """
    if local.attn_layout != "CPU":
        src_fmt = page_format(remote.attn_layout, remote.num_kv_heads if not remote.is_mla else 1,
                              remote.block_size, head_bytes(remote) // isz)
        dst_fmt = page_format(local.attn_layout, local.num_kv_heads if not local.is_mla else 1,
                              local.block_size, head_bytes(local) // isz)
        return [((0, src_fmt.page_elems, src_fmt), (0, dst_fmt.page_elems, dst_fmt),
                 (read.remote_head_start, read.local_head_start, read.num_heads))]
    dim = head_bytes(local) // isz // 2
    out = []
    for i in range(read.num_heads):
        hs, hd = read.remote_head_start + i, read.local_head_start + i
        for part in (0, 1):
            sides = []
            for head, n in ((hs, remote.block_size), (hd, local.block_size)):
                lo = head * 2 * n * dim + part * n * dim
                fmt = page_format("HND", dim, n, 1) if part == 0 else page_format("HND", 1, n, dim)
                sides.append((lo, lo + n * dim, fmt))
            out.append((sides[0], sides[1], (0, 0, None)))
    return out


def _overlaps(a: list[PageGroup], b: list[PageGroup]) -> list[tuple[int, int, PageGroup, PageGroup]]:
    """Page ranges ``[lo, hi)`` where one group of ``a`` and one of ``b`` both apply."""
    out = []
    for ga in a:
        for gb in b:
            lo, hi = max(ga.start, gb.start), min(ga.start + ga.count, gb.start + gb.count)
            if lo < hi:
                out.append((lo, hi, ga, gb))
    return out
