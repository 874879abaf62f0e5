"""The parts of a layer-streamed load: one per prefill rank, with no rows (the prefill rank plans them).

A streamed load (:attr:`p2pkv.metadata.LoadSpec.stream_grant`) names no
prefill blocks: the prefill rank learns its own step by step and WRITEs each
layer into this rank's blocks (:class:`p2pkv.decode.movers.StreamMover`).
Its part therefore carries no descriptor rows to post, only one row counting
the bytes that will land (``local_descs``: address 0, the blocks' bytes),
for the pull's statistics. Streams pair ranks one to one: both engines must
run the same TP size and block size (other pairs are sent without a grant,
and pushed).
"""

from __future__ import annotations

import numpy as np

from p2pkv.dataplane.layout import KVLayout
from p2pkv.decode.peers import Peer, PeerId
from p2pkv.decode.transfer import Part, Transfer


def plan_streams(transfer: Transfer, tp_rank: int, tp_size: int, peers: dict[PeerId, Peer], layout: KVLayout,
                 block_size: int, device_id: int) -> str | None:
    """Put ``transfer``'s stream part (from prefill rank ``tp_rank``) in ``transfer.parts``; or why it cannot
    stream (nothing is planned then).

    Args:
        transfer: a streamed load.
        tp_rank / tp_size: this decode rank and its engine's TP size.
        peers: the handshaken prefill ranks.
        layout: this rank's KV layout (``block_bytes``: bytes of one block over every layer).
        block_size: tokens per block here.
        device_id: this rank's device id.
    """
    spec = transfer.spec
    if spec.remote.tp_size != tp_size:
        return (f"a stream pairs ranks one to one, but the prefill engine runs tp_size={spec.remote.tp_size} and "
                f"this one {tp_size}: send such pairs without a stream grant (push)")
    pid = PeerId.of(spec.remote, tp_rank)
    peer = peers[pid]
    if peer.info.layout.block_size != block_size:
        return (f"a stream moves blocks as they are, but the prefill engine's block size is "
                f"{peer.info.layout.block_size} and this one's {block_size}: send such pairs without a stream "
                "grant (push)")
    if spec.local_block_ids:
        nbytes = len(spec.local_block_ids) * layout.block_bytes
        counted = np.array([[0, nbytes, device_id]], dtype=np.uint64)
        transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, np.zeros((0, 3), dtype=np.uint64)))
    return None

