"""The parts of a layer-streamed load: one per prefill rank, with no rows (the prefill rank plans them).

A streamed load (:attr:`p2pkv.metadata.LoadSpec.stream_grant`) names no
prefill blocks: the prefill rank learns its own step by step and WRITEs each
layer into this rank's memory (:class:`p2pkv.decode.movers.StreamMover`).
Its part therefore carries no descriptor rows to post, only one row counting
the bytes that will land (``local_descs``: address 0, the bytes), for the
pull's statistics. A decode rank may read several prefill ranks (a smaller
TP size), one part each; several decode ranks may read one prefill rank (a
larger TP size): each sends its own destination, saying how many they are
(``readers``), and the prefill rank streams to each.
Where a prefill rank's pages can land in this rank's blocks as they are
(:attr:`p2pkv.dataplane.negotiate.Placement.DIRECT`, or ``PAGED`` with all
of its heads), the stream WRITEs into them; where they are head-major on
both ranks with one block size (``PAGED``) but the TP sizes differ, it
WRITEs the slice of heads this rank reads of each page straight into that
slice of this rank's page (``head_slice``, as a ``PAGED`` pull READs it;
every KV cache group's blocks into its own); otherwise (another block size,
HND/NHD)
it WRITEs into staging in the prefill rank's geometry, fixed up into this
rank's blocks when its notification lands (as a staged push's). A model
with several KV cache groups (one block size on both engines) stages each
group's blocks after the previous group's
(:func:`p2pkv.dataplane.blockmap.grouped_streamed_read`).
"""

from __future__ import annotations

import numpy as np

from p2pkv.dataplane.blockmap import grouped_streamed_read, streamed_read
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.negotiate import Placement
from p2pkv.dataplane.stager import Stager
from p2pkv.decode.peers import Peer, PeerId
from p2pkv.decode.reads import release_unposted
from p2pkv.decode.transfer import Part, Transfer

_NO_ROWS = np.zeros((0, 3), dtype=np.uint64)


def plan_streams(transfer: Transfer, ranks: list[int], readers: list[int], peers: dict[PeerId, Peer],
                 layout: KVLayout, block_size: int, device_id: int, stager: Stager) -> bool:
    """Put ``transfer``'s stream parts, one per prefill rank this rank reads, in ``transfer.parts``.

    Args:
        transfer: a streamed load.
        ranks: the prefill ranks this rank reads (:meth:`p2pkv.dataplane.rank.LocalRank.topology`).
        readers: for each of ``ranks``, how many decode ranks read it (its stream request says so).
        peers: the handshaken prefill ranks.
        layout: this rank's KV layout (``block_bytes``: bytes of one block over every layer).
        block_size: tokens per block here.
        device_id: this rank's device id.
        stager: this rank's staging (a stream into staging takes its room now).

    Returns:
        True when planned (no part when nothing is loaded); False when staging has no room yet (nothing stays
        reserved: plan again once other loads gave theirs back).

    Raises:
        p2pkv.dataplane.staging.StagingFull: the stream can never fit in staging.
        p2pkv.dataplane.blockmap.BlockCountError: the local blocks do not cover the load (or, with several KV
            cache groups, are not the groups' blocks one group after the other).
    """
    spec = transfer.spec
    if not spec.local_block_ids:
        return True
    for rank, count in zip(ranks, readers, strict=True):
        pid = PeerId.of(spec.remote, rank)
        peer = peers[pid]
        # One prefill rank's every head, and nothing else, makes this rank's page: its pages land as they are.
        same_heads = peer.info.layout.is_mla or (len(ranks) == 1 and peer.plan.read.num_heads
                                                 == peer.info.layout.num_kv_heads)
        if peer.plan.placement is Placement.DIRECT or (peer.plan.placement is Placement.PAGED and same_heads):
            counted = np.array([[0, len(spec.local_block_ids) * layout.block_bytes, device_id]], dtype=np.uint64)
            transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, readers=count))
            continue
        if peer.plan.placement is Placement.PAGED and peer.local_slices:
            sliced = sum(page.length for page in peer.local_slices)  # bytes of this rank's heads, per block
            counted = np.array([[0, len(spec.local_block_ids) * sliced, device_id]], dtype=np.uint64)
            transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, readers=count,
                                       head_slice=peer.plan.read))
            continue
        if spec.stream_groups:  # one block size on both engines: whole blocks, each group's into its own
            read = grouped_streamed_read(spec, block_size)
        else:
            read = streamed_read(spec, block_size, peer.info.layout.block_size)
        if not read.remote_block_ids:
            continue
        stage = stager.reserve(read, peer.segments)
        if stage is None:
            release_unposted(transfer, stager)
            return False
        counted = np.array([[0, stage.size, device_id]], dtype=np.uint64)
        transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, stage, readers=count))
    return True
