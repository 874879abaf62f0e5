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

Its request (:func:`post_stream`): a :class:`handshake.StreamRequest` with
the grant, this rank's blocks (or staging), the prompt's digest and, when
the load is verified (``verify_kv``), a request for the digest of what it
WROTE, sent on
the prefill rank's lane as a push request is (:meth:`p2pkv.decode.pushes.Pushes.send`);
everything after it is a push's.
"""

from __future__ import annotations

import time

import numpy as np

from handshake import AgentInfo, Destination, HeadSlice, PushReply, request_stream
from p2pkv.dataplane.blockmap import grouped_streamed_read, staged_groups, streamed_read
from p2pkv.dataplane.negotiate import Placement
from p2pkv.dataplane.rank import LocalRank
from p2pkv.dataplane.stager import Stager
from p2pkv.decode.peers import Peer, PeerId
from p2pkv.decode.pushes import Pushes, PushNotSent
from p2pkv.decode.reads import release_unposted
from p2pkv.decode.transfer import Part, Transfer

_NO_ROWS = np.zeros((0, 3), dtype=np.uint64)


def plan_streams(transfer: Transfer, ranks: list[int], readers: list[int], peers: dict[PeerId, Peer],
                 local: LocalRank, stager: Stager) -> bool:
    """Put ``transfer``'s stream parts, one per prefill rank this rank reads, in ``transfer.parts``.

    Args:
        transfer: a streamed load.
        ranks: the prefill ranks this rank reads (:meth:`p2pkv.dataplane.rank.LocalRank.topology`).
        readers: for each of ``ranks``, how many decode ranks read it (its stream request says so).
        peers: the handshaken prefill ranks.
        local: this rank (its layout's ``block_bytes``: bytes of one block over every layer; its block size,
            device id, and which KV cache groups' blocks lie in each layer's pages, for verified KV).
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
    block_size, device_id, groups = local.desc.block_size, local.device_id, local.layer_groups
    for rank, count in zip(ranks, readers, strict=True):
        pid = PeerId.of(spec.remote, rank)
        peer = peers[pid]
        # One prefill rank's every head, and nothing else, makes this rank's page: its pages land as they are.
        same_heads = peer.info.layout.is_mla or (len(ranks) == 1 and peer.plan.read.num_heads
                                                 == peer.info.layout.num_kv_heads)
        if peer.plan.placement is Placement.DIRECT or (peer.plan.placement is Placement.PAGED and same_heads):
            per_block = sum(seg.length for seg in peer.local_segments)  # a stage's: its layers' pages
            counted = np.array([[0, len(spec.local_block_ids) * per_block, device_id]], dtype=np.uint64)
            transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, readers=count,
                                       layer_groups=groups))
            continue
        if peer.plan.placement is Placement.PAGED and peer.local_slices:
            sliced = sum(page.length for page in peer.local_slices)  # bytes of this rank's heads, per block
            counted = np.array([[0, len(spec.local_block_ids) * sliced, device_id]], dtype=np.uint64)
            transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, readers=count,
                                       head_slice=peer.plan.read, layer_groups=groups))
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
        transfer.parts.append(Part(transfer, transfer.attempt, pid, peer, counted, _NO_ROWS, stage, readers=count,
                                   layer_groups=groups))
    return True


def post_stream(pushes: Pushes, part: Part) -> None:
    """Send ``part``'s stream request: this rank's blocks of a layer-streamed load (or, for a part with a
    stage, its staging: one address per prefill region, staging blocks ``0 ..``, with several KV cache
    groups each group's after the previous group's), its grant and digest
    (the prefill rank WRITEs each layer into them; one "pushed" notification follows, as for a push).

    Raises:
        RuntimeError: the worker has not set :attr:`p2pkv.decode.pushes.Pushes.make_info`.
    """
    info = pushes.open(part)
    spec = part.transfer.spec
    first_block = spec.first_token // max(1, part.peer.info.layout.block_size)
    block_ids = list(spec.local_block_ids)
    group_blocks = list(spec.stream_groups[1:])
    if spec.stream_groups:  # several KV cache groups: group 0's blocks here, the others' beside them
        first_block, block_ids = spec.stream_groups[0].first_block, list(spec.stream_groups[0].block_ids)
    staging_addrs: list[int] = []
    if part.stage is not None:
        block_ids = list(range(len(part.stage.read.remote_block_ids)))
        staging_addrs = [seg.addr for seg in part.stage.segments]
        if spec.stream_groups:  # each group's staging blocks after the previous group's
            staged = staged_groups(spec.stream_groups)
            block_ids = list(staged[0].block_ids)
            group_blocks = list(staged[1:])
    pushes.send(part, _send_stream, spec.stream_grant, block_ids, first_block, spec.remote.num_tokens,
                spec.remote.prompt_digest, part.push_id, info, pushes.engine_id, staging_addrs=staging_addrs,
                readers=part.readers, group_blocks=group_blocks, head_slice=_head_slice(part),
                kv_digest=part.transfer.verify)


def _head_slice(part: Part) -> HeadSlice | None:
    """``part``'s slice of heads as its stream request names it (None: its prefill rank's pages whole)."""
    r = part.head_slice
    return None if r is None else HeadSlice(r.remote_head_start, r.local_head_start, r.num_heads)


def _send_stream(deadline: float, to: Destination, grant: str, block_ids: list[int], first_block: int,
                 num_tokens: int, digest: str, push_id: bytes, agent: AgentInfo, requester_engine_id: str,
                 **kwargs: object) -> PushReply:
    """:func:`handshake.request_stream` (on the lane's thread) with what is left of its window, as
    :func:`p2pkv.decode.pushes._send_push`.

    Raises:
        PushNotSent: nothing is left; nothing was sent.
        The errors of :func:`handshake.request_stream`.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise PushNotSent("not sent: its window passed while it waited behind earlier requests to that prefill rank")
    return request_stream(to, grant, block_ids, first_block, num_tokens, digest, push_id, agent, left,
                          requester_engine_id, **kwargs)  # type: ignore[arg-type]
