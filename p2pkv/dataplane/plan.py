"""Block ids → NIXL descriptors, coalescing runs of consecutive blocks.

A pull copies remote block ``remote_ids[i]`` into local block
``local_ids[i]``. Where both sides' ids advance by one together and a
segment's blocks are contiguous in memory, the whole run moves as one
descriptor. Vectorised with numpy: no Python loop per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from p2pkv.dataplane.layout import Segment


class PlanError(ValueError):
    """Block id lists that cannot be pulled; the message names the problem."""


def check_block_ids(ids: Sequence[int] | np.ndarray, num_blocks: int, side: str) -> None:
    """Check block ids against the KV cache that holds them, before any arithmetic on them.

    Ids come from ``kv_transfer_params`` (anyone's choice, any size): an id
    beyond int64 would overflow numpy, one beyond ``num_blocks`` would address
    memory past the cache. Ints are compared as Python ints (``min``/``max``,
    no conversion).

    Args:
        ids: block ids, flat.
        num_blocks: blocks in that side's KV cache (ids must be below it).
        side: ``"local"`` or ``"remote"``, for the message.

    Raises:
        PlanError: not a flat list of ints, or an id outside ``[0, num_blocks)``
            (the message names the first such id and the bound).
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise PlanError(f"{side} block ids must be a flat list, got shape {ids.shape}")
        if not ids.size or (ids.min() >= 0 and ids.max() < num_blocks):
            return
    elif not ids:
        return
    else:
        try:
            if min(ids) >= 0 and max(ids) < num_blocks:
                return
        except TypeError as exc:
            raise PlanError(f"{side} block ids must be a flat list of ints: {exc}") from None
    bad = next(int(b) for b in ids if not 0 <= b < num_blocks)
    raise PlanError(f"{side} block id {bad} outside [0, {num_blocks}): that KV cache has {num_blocks} blocks")


def _as_ids(ids: Sequence[int] | np.ndarray, num_blocks: int, side: str) -> np.ndarray:
    check_block_ids(ids, num_blocks, side)
    return np.asarray(ids, dtype=np.int64)


def coalesce_runs(
    local_ids: Sequence[int] | np.ndarray,
    remote_ids: Sequence[int] | np.ndarray,
    local_num_blocks: int,
    remote_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired block id lists into runs where both advance by one.

    Args:
        local_ids: destination block ids, shape [n].
        remote_ids: source block ids, shape [n].
        local_num_blocks: blocks in the local cache (ids must be below it).
        remote_num_blocks: blocks in the remote cache.

    Returns:
        ``(local_starts, remote_starts, lengths)``: int64 arrays of shape
        [runs]; run ``k`` covers ``lengths[k]`` blocks.

    Raises:
        PlanError: lengths differ, ids out of range, or a local block id
            repeats (two sources for one destination).
    """
    local = _as_ids(local_ids, local_num_blocks, "local")
    remote = _as_ids(remote_ids, remote_num_blocks, "remote")
    if local.size != remote.size:
        raise PlanError(
            f"{local.size} local block ids for {remote.size} remote block ids; they must pair up"
        )
    if local.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if np.unique(local).size != local.size:
        raise PlanError("local block ids repeat: one destination block would get two sources")
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, local.size))
    return local[starts], remote[starts], lengths


def _segment_descs(seg: Segment, starts: np.ndarray, lengths: np.ndarray, dev: int) -> np.ndarray:
    if seg.blocks_contiguous:
        addrs = seg.addr + starts * seg.block_stride
        sizes = lengths * seg.length
    else:
        # Expand runs back to blocks: the segment's blocks do not touch.
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        blocks = np.repeat(starts, lengths) + (np.arange(int(lengths.sum())) - first)
        addrs = seg.addr + blocks * seg.block_stride
        sizes = np.full(blocks.size, seg.length, dtype=np.int64)
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = sizes
    out[:, 2] = dev
    return out


def build_descriptors(
    segments: Sequence[Segment],
    starts: np.ndarray,
    lengths: np.ndarray,
    device_id: int = 0,
) -> np.ndarray:
    """NIXL descriptors (``addr, len, device_id`` rows, uint64 [n, 3]) for runs.

    Segment-major order (all runs of segment 0, then segment 1, ...) so the
    local and remote lists built from the same runs pair up row by row.
    """
    if starts.size == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    return np.concatenate([_segment_descs(s, starts, lengths, device_id) for s in segments])


def split_rows(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut descriptor rows longer than ``max_bytes`` into pieces of at most ``max_bytes``.

    So a READ has enough rows of similar size for NIXL's UCX thread pool to
    spread them over its threads (it splits a READ by row count).

    Args:
        local / remote: uint64 ``[n, 3]`` ``(addr, len, device_id)`` rows, equal lengths row by row.
        max_bytes: the longest piece (> 0).

    Returns:
        ``(local, remote)`` uint64 ``[m, 3]``, ``m >= n``, covering the same bytes in the same order.
    """
    lens = local[:, 1].astype(np.int64)
    pieces = np.maximum(1, -(-lens // max_bytes))
    if int(pieces.max(initial=1)) == 1:
        return local, remote
    row = np.repeat(np.arange(lens.size), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(row.size) - np.repeat(first, pieces)  # piece index within its row
    off = k * max_bytes
    size = np.minimum(max_bytes, lens[row] - off)
    out = []
    for rows in (local, remote):
        d = np.empty((row.size, 3), dtype=np.uint64)
        d[:, 0] = rows[row, 0] + off.astype(np.uint64)
        d[:, 1] = size.astype(np.uint64)
        d[:, 2] = rows[row, 2]
        out.append(d)
    return out[0], out[1]


def check_rows_in_blocks(rows: np.ndarray, segments: Sequence[Segment], num_blocks: int,
                         block_ids: Sequence[int]) -> None:
    """Check that every byte descriptor rows name lies in blocks ``block_ids`` of this rank's KV segments.

    What a prefill rank checks before it WRITEs rows a decode rank sent (push):
    only the held request's blocks may leave. Block ``b`` of a segment owns
    ``[seg.addr + b * block_stride, + seg.length)``; a row must lie inside one
    block's range of one segment, or, where a segment's blocks touch
    (``block_stride == length``), inside a run of consecutive blocks, every
    one of them in ``block_ids``. Vectorised over rows (numpy), one pass per
    segment.

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``.
        segments: this rank's KV segments (:class:`p2pkv.dataplane.layout.Segment`).
        num_blocks: blocks per segment.
        block_ids: the held blocks (already checked below ``num_blocks``).

    Raises:
        PlanError: a row of zero bytes, or one with a byte outside every
            segment's blocks or in a block not in ``block_ids`` (the first such row is named).
    """
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise PlanError(f"descriptor rows must be [n, 3], got shape {rows.shape}")
    if not rows.shape[0]:
        return
    if int(rows[:, :2].max()) >= 1 << 62 or int(rows[:, 1].min()) == 0:
        raise PlanError("a descriptor row has zero bytes or an address/length beyond 2**62")
    addr, length = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    held = np.zeros(num_blocks + 1, dtype=np.int64)
    held[1:][np.asarray(block_ids, dtype=np.int64)] = 1
    held_before = np.cumsum(held)  # held blocks among ids < b: held_before[b]
    inside = np.zeros(addr.size, dtype=bool)
    for seg in segments:
        offset = addr - seg.addr
        first = offset // seg.block_stride
        if seg.blocks_contiguous:
            last = (offset + length - 1) // seg.block_stride
            fits = offset >= 0
        else:
            last = first
            fits = (offset >= 0) & (offset - first * seg.block_stride + length <= seg.length)
        fits &= last < num_blocks
        lo, hi = np.clip(first, 0, num_blocks - 1), np.clip(last, 0, num_blocks - 1)
        inside |= fits & (held_before[hi + 1] - held_before[lo] == hi - lo + 1)
    if not inside.all():
        bad = int(np.argmin(inside))
        raise PlanError(f"descriptor row {bad} ({int(addr[bad]):#x}, {int(length[bad])} B) is not inside the held "
                        f"blocks of this rank's KV cache")


def check_rows_in_regions(rows: np.ndarray, regions: Sequence[tuple[int, int, int]]) -> None:
    """Check that every byte descriptor rows name lies inside one of ``regions``, on its device.

    What a prefill rank checks before it WRITEs into a decode rank (push):
    the target rows must lie in memory the decode rank's :class:`handshake.AgentInfo`
    declares (its KV cache regions and staging), so a request cannot aim a
    WRITE anywhere else that agent registered. Overlapping or touching
    regions of one device count as one. Vectorised over rows (numpy).

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``.
        regions: ``(base address, length in bytes, device id)`` of each declared region.

    Raises:
        PlanError: a row of zero bytes, beyond 2**62, or with a byte outside every region of its device (the
            first such row is named).
    """
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise PlanError(f"descriptor rows must be [n, 3], got shape {rows.shape}")
    if not rows.shape[0]:
        return
    if int(rows.max()) >= 1 << 62 or int(rows[:, 1].min()) == 0:
        raise PlanError("a descriptor row has zero bytes or an address/length/device beyond 2**62")
    addr, length, device = (rows[:, i].astype(np.int64) for i in range(3))
    inside = np.zeros(addr.size, dtype=bool)
    devices = [int(device[0])] if (device == device[0]).all() else np.unique(device).tolist()
    for dev in devices:
        spans: list[list[int]] = []  # merged [start, end) of this device's regions, in address order
        for base, size, _ in sorted(r for r in regions if r[2] == dev and r[1] > 0 and 0 <= r[0] < 1 << 62):
            end = min(base + size, 1 << 62)
            if spans and base <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([base, end])
        if not spans:
            continue
        starts = np.array([s for s, _ in spans], dtype=np.int64)
        ends = np.array([e for _, e in spans], dtype=np.int64)
        on = device == dev
        idx = np.searchsorted(starts, addr[on], side="right") - 1
        ok = idx >= 0
        ok[ok] &= addr[on][ok] + length[on][ok] <= ends[idx[ok]]
        inside[on] = ok
    if not inside.all():
        bad = int(np.argmin(inside))
        raise PlanError(f"descriptor row {bad} ({int(addr[bad]):#x}, {int(length[bad])} B, device "
                        f"{int(device[bad])}) is not inside the memory the agent declares (KV cache regions and "
                        "staging)")
