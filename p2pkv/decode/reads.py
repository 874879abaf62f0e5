"""A pull's parts: planning which remote bytes land where (each placement), landing and giving them up.

The mechanics shared by every way a part moves; what differs by way is its
mover's (:mod:`p2pkv.decode.movers`), and what its pull does about each
outcome (retry, fail, fence) is :class:`p2pkv.decode.receiver.Receiver`'s.
"""

from __future__ import annotations

import enum
import logging

import numpy as np

from handshake import KVLayoutDesc
from p2pkv.dataplane.blockmap import direct_pairs, staged_read
from p2pkv.dataplane.digest import DigestError
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.negotiate import Placement
from p2pkv.dataplane.plan import build_descriptors, check_block_ids, coalesce_runs
from p2pkv.dataplane.stager import Stage, Stager
from p2pkv.dataplane.staging import StagingFull
from p2pkv.decode.peers import Peer, PeerId
from p2pkv.decode.transfer import Part, Transfer
from p2pkv.decode.verify import landed, landed_rows
from p2pkv.faults import Faults
from p2pkv.metadata import LoadSpec

Descriptors = tuple[np.ndarray, np.ndarray, Stage | None]
"""``(local_descs, remote_descs, stage)``: uint64 ``[n, 3]`` rows each, and the staging READ into (or None)."""

_EMPTY = np.zeros((0, 3), dtype=np.uint64)

logger = logging.getLogger("p2pkv.decode")


def plan_read(spec: LoadSpec, peer: Peer, layout: KVLayout, desc: KVLayoutDesc, device_id: int,
              stager: Stager) -> Descriptors | None:
    """Descriptors for ``peer``'s share of ``spec`` (None: no room in staging yet).

    ``DIRECT``: coalesced runs of whole blocks, local ← remote (a pipeline stage's: of its layers' pages). ``PAGED``:
    per-page head slices. Runs coalesce only where every segment on both sides is block-contiguous; else one
    row per block.
    ``STAGED``: whole remote blocks into a reserved range of staging.

    Every block id is first checked against its cache's ``num_blocks`` (the
    peer's from its handshake, ours), before any arithmetic on it: all of
    ``remote_block_ids`` (every KV cache group: the fence names them all to
    the prefill rank), and the local blocks.

    Raises:
        p2pkv.dataplane.plan.PlanError: bad block ids (one at or past a
            cache's ``num_blocks`` is named with that bound).
        p2pkv.dataplane.staging.StagingFull: the READ can never fit in staging.
    """
    remote = peer.info.layout
    check_block_ids(spec.remote.block_ids, remote.num_blocks, "remote")
    check_block_ids(spec.remote_block_ids, remote.num_blocks, "remote")
    check_block_ids(spec.local_block_ids, layout.num_blocks, "local")
    if peer.plan.placement is not Placement.STAGED:
        local_ids, remote_ids = direct_pairs(spec, desc.block_size)
        loc, rem, lengths = coalesce_runs(local_ids, remote_ids, layout.num_blocks, remote.num_blocks)
        if peer.plan.placement is Placement.DIRECT:
            mine, theirs = peer.local_segments, peer.segments
        else:
            mine, theirs = peer.local_slices, peer.remote_slices
        if not all(seg.blocks_contiguous for seg in (*mine, *theirs)):  # a page slice, or a stage's layers
            loc, rem = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
            lengths = np.ones(loc.size, dtype=np.int64)  # one row per block on both sides
        return (build_descriptors(mine, loc, lengths, device_id),
                build_descriptors(theirs, rem, lengths, peer.device_id), None)
    read = staged_read(spec, desc.block_size, remote.block_size)
    n = len(read.remote_block_ids)
    coalesce_runs(read.dst_block_ids, read.dst_block_ids, layout.num_blocks, layout.num_blocks)  # validates ids
    if not n:
        return _EMPTY, _EMPTY, None
    loc, rem, lengths = coalesce_runs(np.arange(n), read.remote_block_ids, n, remote.num_blocks)
    stage = stager.reserve(read, peer.segments)
    if stage is None:
        return None
    return (build_descriptors(stage.segments, loc, lengths, device_id),
            build_descriptors(peer.segments, rem, lengths, peer.device_id), stage)


def plan_reads(transfer: Transfer, ranks: list[int], peers: dict[PeerId, Peer], layout: KVLayout, desc: KVLayoutDesc,
               device_id: int, stager: Stager) -> bool:
    """Plan ``pull``'s READ from each prefill rank in ``ranks`` into ``pull.parts`` (empty shares skipped).

    Returns:
        False when staging has no room yet (the pull waits; nothing stays reserved).

    Raises:
        p2pkv.dataplane.plan.PlanError: bad block ids.
        p2pkv.dataplane.staging.StagingFull: the pull can never fit in staging.
    """
    for rank in ranks:
        pid = PeerId.of(transfer.spec.remote, rank)
        planned = plan_read(transfer.spec, peers[pid], layout, desc, device_id, stager)
        if planned is None:  # no room yet: wait for pulls in flight to finish
            release_unposted(transfer, stager)
            if stager.idle:  # nothing else holds staging: this pull can never fit
                raise StagingFull(f"a pull from {len(ranks)} prefill ranks needs more staging than "
                                  "staging_mib holds; raise staging_mib in kv_connector_extra_config")
            return False
        if planned[0].size:
            transfer.parts.append(Part(transfer, transfer.attempt, pid, peers[pid], *planned))
    return True


def release_unposted(transfer: Transfer, stager: Stager) -> None:
    """Give back the staging of ``pull``'s parts not yet posted."""
    for read in [r for r in transfer.parts if r.stage is not None and r.direction is None]:
        stager.release(read.stage)
        read.stage = None


class ReadEvent(str, enum.Enum):
    """What polling a part in flight found."""

    IN_FLIGHT = "in_flight"
    """Not done yet."""
    DONE = "done"
    """Done: its bytes counted in its pull, a staged READ fixed up into the local blocks."""
    FAILED = "failed"
    """It failed (NIXL failed the READ, or the prefill rank reported its WRITE failed); its staging given back."""
    FIXUP_FAILED = "fixup_failed"
    """Done, but the fixup of its staging into the local blocks raised (its staging given back)."""


def release_stage(stager: Stager, read: Part) -> None:
    """Give back ``read``'s staging (if any)."""
    if read.stage is not None:
        stager.release(read.stage)
        read.stage = None


def land(stager: Stager, read: Part, now: float, num_bytes: int, num_descriptors: int,
         faults: Faults | None = None) -> tuple[ReadEvent, Exception | None]:
    """A READ (or push) whose bytes arrived at ``now``: count them in its pull, digest what landed where its
    transfer is verified (:func:`p2pkv.decode.verify.landed`), fix up staging into the local blocks.

    ``faults``: an operator's injected faults (:mod:`p2pkv.faults`), applied to what landed before the digest.
    """
    read.done = now
    read.transfer.num_bytes += num_bytes
    read.transfer.num_descriptors += num_descriptors
    if faults is not None and faults.any and faults.corrupt(landed_rows(read, stager.desc), read.transfer.request_id):
        logger.warning("p2pkv: fault injected (P2PKV_FAULT_CORRUPT_LANDED): request %s's KV overwritten as it "
                       "landed", read.transfer.request_id)
    if read.transfer.verify:
        try:
            landed(read, stager.desc)
        except DigestError as exc:
            release_stage(stager, read)
            return ReadEvent.FIXUP_FAILED, exc
    if read.stage is not None:
        try:
            stage_pages = read.peer.local_segments if read.peer.info.pp_size > 1 else None  # a stage's layers
            stager.fixup(read.stage, read.peer.info.layout, read.peer.plan.read, stage_pages)
        except Exception as exc:  # never let one request's fixup take the engine down
            return ReadEvent.FIXUP_FAILED, exc
        finally:
            release_stage(stager, read)
    return ReadEvent.DONE, None
