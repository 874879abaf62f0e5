"""Tensor-parallel mapping between a prefill and a decode engine of different TP sizes.

vLLM splits a model's KV heads over tensor-parallel ranks: with ``H`` KV
heads and TP size ``tp``, rank ``r`` holds heads ``[r * H/tp, (r+1) * H/tp)``
when ``H >= tp``; when ``H < tp`` (GQA with few KV heads) every rank holds
one head, rank ``r`` head ``r * H // tp``, so ``tp / H`` ranks replicate each
head. An MLA latent cache has no head split: every rank holds all of it,
which is the replicated case with ``H = 1``.

For one decode rank this module answers which prefill ranks to read, which
head slice of each prefill rank's block to read, and where it goes in the
local block; and which prefill ranks each decode rank notifies so that every
prefill rank learns, from a known number of decode ranks, that its blocks
may be freed. Both TP directions are covered (decode TP smaller or larger
than prefill TP). The semantics follow vLLM's ``TpKVTopology`` (its NIXL
connector), extended to reading from several prefill ranks.

All functions are pure; heads are counted in KV heads, ranks are 0-based.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A TP pairing that cannot be mapped; the message names both sides' values."""


@dataclass(frozen=True)
class RankRead:
    """One contiguous head slice a decode rank reads from one prefill rank.

    Attributes:
        remote_rank: the prefill tp_rank to read from.
        remote_head_start: first head to read, counted within the prefill
            rank's own heads.
        local_head_start: where the slice starts within the decode rank's heads.
        num_heads: heads in the slice.
    """

    remote_rank: int
    remote_head_start: int
    local_head_start: int
    num_heads: int


def _check(num_kv_heads: int, tp_size: int, side: str) -> None:
    if num_kv_heads <= 0:
        raise TopologyError(f"{side} num_kv_heads={num_kv_heads} must be > 0")
    if tp_size <= 0:
        raise TopologyError(f"{side} tp_size={tp_size} must be > 0")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise TopologyError(
            f"{side}: {num_kv_heads} KV heads cannot be split over tp_size={tp_size} (one must divide "
            "the other); choose a tensor-parallel size that divides the KV heads or is a multiple of them"
        )


def heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds (1 when ranks replicate heads).

    Raises:
        TopologyError: neither of ``num_kv_heads`` and ``tp_size`` divides the other.
    """
    _check(num_kv_heads, tp_size, "engine")
    return max(1, num_kv_heads // tp_size)


def rank_first_head(rank: int, num_kv_heads: int, tp_size: int) -> int:
    """Global index of the first KV head held by ``rank``.

    Raises:
        TopologyError: bad sizes, or ``rank`` outside ``[0, tp_size)``.
    """
    _check(num_kv_heads, tp_size, "engine")
    if not 0 <= rank < tp_size:
        raise TopologyError(f"tp_rank={rank} outside [0, tp_size={tp_size})")
    if num_kv_heads >= tp_size:
        return rank * (num_kv_heads // tp_size)
    return rank * num_kv_heads // tp_size


def read_plan(local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int,
              is_mla: bool = False) -> list[RankRead]:
    """The head slices decode rank ``local_rank`` reads, one per prefill rank, in head order.

    Args:
        local_rank: this decode worker's tp_rank.
        local_tp: decode TP size.
        remote_tp: prefill TP size.
        num_kv_heads: the model's total KV heads (ignored for MLA).
        is_mla: MLA latent cache: one replicated "head" on every rank.

    Returns:
        One :class:`RankRead` per prefill rank to read, covering each of the
        decode rank's heads exactly once. Where prefill ranks replicate a
        head, decode ranks spread their reads over the replicas.

    Raises:
        TopologyError: a side's heads cannot be split over its TP size, or
            ``local_rank`` is out of range.
    """
    heads = 1 if is_mla else num_kv_heads
    _check(heads, local_tp, "decode")
    _check(heads, remote_tp, "prefill")
    first = rank_first_head(local_rank, heads, local_tp)
    count = heads_per_rank(heads, local_tp)
    reads: list[RankRead] = []
    for i in range(count):
        h = first + i
        if heads >= remote_tp:
            per = heads // remote_tp
            rank, within = h // per, h % per
        else:
            replicas = remote_tp // heads
            rank, within = h * replicas + local_rank % replicas, 0
        last = reads[-1] if reads else None
        if (last is not None and last.remote_rank == rank
                and last.remote_head_start + last.num_heads == within):
            reads[-1] = RankRead(rank, last.remote_head_start, last.local_head_start, last.num_heads + 1)
        else:
            reads.append(RankRead(rank, within, i, 1))
    return reads


def notify_ranks(local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int,
                 is_mla: bool = False) -> list[int]:
    """Prefill ranks decode rank ``local_rank`` notifies when a pull is done.

    The ranks it reads from, plus the prefill ranks no decode rank reads
    (replicas nobody needed), spread round-robin over decode ranks so that
    every prefill rank is notified by at least one decode rank.

    Raises:
        TopologyError: as :func:`read_plan`.
    """
    read_by: dict[int, set[int]] = {r: set() for r in range(remote_tp)}
    for d in range(local_tp):
        for rr in read_plan(d, local_tp, remote_tp, num_kv_heads, is_mla):
            read_by[rr.remote_rank].add(d)
    return sorted(r for r, readers in read_by.items()
                  if local_rank in readers or (not readers and r % local_tp == local_rank))


def notifiers_of(remote_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int,
                 is_mla: bool = False) -> int:
    """How many decode ranks notify prefill rank ``remote_rank`` about each request.

    The prefill rank frees a request's blocks once this many distinct decode
    ranks have notified it (or its lease expires).

    Raises:
        TopologyError: as :func:`read_plan`.
    """
    return sum(remote_rank in notify_ranks(d, local_tp, remote_tp, num_kv_heads, is_mla)
               for d in range(local_tp))
