"""The parts of a layer-streamed load: one per prefill rank, with no rows (the prefill rank plans them).

A streamed load (:attr:`p2pkv.metadata.LoadSpec.stream_grant`) names no
prefill blocks: the prefill rank learns its own step by step and WRITEs each
layer into this rank's memory (:class:`p2pkv.decode.movers.StreamMover`).
Its part therefore carries no descriptor rows to post, only one row counting
the bytes that will land (``local_descs``: address 0, the bytes), for the
pull's statistics. Streams pair ranks one to one: both engines must run the
same TP size (other pairs are sent without a grant, and pushed). Where the
prefill rank's pages can land in this rank's blocks as they are
(:attr:`p2pkv.dataplane.negotiate.Placement.DIRECT` or ``PAGED``), the
stream WRITEs into them; otherwise (another block size, HND/NHD) it WRITEs
into staging in the prefill rank's geometry, fixed up into this rank's blocks
when its notification lands (as a staged push's).
"""

from __future__ import annotations

import numpy as np

from p2pkv.dataplane.blockmap import streamed_read
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.negotiate import Placement
from p2pkv.dataplane.stager import Stager
from p2pkv.decode.peers import Peer, PeerId
from p2pkv.decode.transfer import Part, Transfer

_NO_ROWS = np.zeros((0, 3), dtype=np.uint64)


def plan_streams(transfer: Transfer, tp_rank: int, tp_size: int, peers: dict[PeerId, Peer], layout: KVLayout,
                 block_size: int, device_id: int, stager: Stager) -> bool | str:
    """Put ``transfer``'s stream part (from prefill rank ``tp_rank``) in ``transfer.parts``.

    Args:
        transfer: a streamed load.
        tp_rank / tp_size: this decode rank and its engine's TP size.
        peers: the handshaken prefill ranks.
        layout: this rank's KV layout (``block_bytes``: bytes of one block over every layer).
        block_size: tokens per block here.
        device_id: this rank's device id.
        stager: this rank's staging (a stream into staging takes its room now).

    Returns:
        True when planned (no part when nothing is loaded); False when staging has no room yet (nothing is
        reserved: plan again once other loads gave theirs back); else why it cannot stream.

    Raises:
        p2pkv.dataplane.staging.StagingFull: the stream can never fit in staging.
        p2pkv.dataplane.blockmap.BlockCountError: the local blocks do not cover the load.
    """
    spec = transfer.spec
    if spec.remote.tp_size != tp_size:
        return (f"a stream pairs ranks one to one, but the prefill engine runs tp_size={spec.remote.tp_size} and "
                f"this one {tp_size}: send such pairs without a stream grant (push)")
    pid = PeerId.of(spec.remote, tp_rank)
    peer = peers[pid]
    if not spec.local_block_ids:
        return True
    if peer.plan.placement is not Placement.STAGED:
        if peer.info.layout.block_size != block_size:  # a placement other than STAGED has one block size
            return f"the prefill engine's block size {peer.info.layout.block_size} is not this one's {block_size}"
        counted = np.array([[0, len(spec.local_block_ids) * layout.block_bytes, device_id]], dtype=np.uint64)
        transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS))
        return True
    read = streamed_read(spec, block_size, peer.info.layout.block_size)
    if not read.remote_block_ids:
        return True
    stage = stager.reserve(read, peer.segments)
    if stage is None:
        return False
    counted = np.array([[0, stage.size, device_id]], dtype=np.uint64)
    transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, stage))
    return True
