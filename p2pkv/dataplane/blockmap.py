"""Which tokens a pull moves, and which remote and local blocks hold them.

A :class:`~p2pkv.metadata.LoadSpec` names local blocks for prompt tokens
``[first_token, ...)`` in the decode engine's block size and remote blocks
for the prompt from token 0 in the prefill engine's block size. The pull
moves tokens ``[first_token, end)`` where ``end`` is the least of the prompt
length and what each side's block list covers. Pure functions over ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from handshake import GroupBlocks
from p2pkv.dataplane.plan import PlanError
from p2pkv.metadata import LoadSpec


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockCountError(PlanError):
    """The block ids do not cover the prompt tokens the pull must move."""


def token_end(spec: LoadSpec, local_block_size: int, remote_block_size: int) -> int:
    """One past the last prompt token the pull moves (tokens).

    Raises:
        BlockCountError: ``remote_block_ids`` (or the local blocks) end before
            the prompt does (``num_tokens``): a pull never moves part of a prompt.
    """
    if spec.num_tokens >= 0 and spec.local_block_ids:
        for side, ids, size, start in (("remote_block_ids", spec.remote_block_ids, remote_block_size, 0),
                                       ("local blocks", spec.local_block_ids, local_block_size, spec.first_token)):
            if start + len(ids) * size < spec.num_tokens:
                raise BlockCountError(
                    f"{side} cover {start + len(ids) * size} prompt tokens ({len(ids)} blocks of {size}), the "
                    f"prompt has {spec.num_tokens}; pass kv_transfer_params unchanged from the prefill engine")
    end = min(spec.first_token + len(spec.local_block_ids) * local_block_size,
              len(spec.remote_block_ids) * remote_block_size)
    return min(end, spec.num_tokens) if spec.num_tokens >= 0 else end


def streamed_read(spec: LoadSpec, local_block_size: int, remote_block_size: int) -> StagedRead:
    """The :class:`StagedRead` of a layer-streamed load into staging, between engines of any two block sizes.

    A streamed load names no prefill blocks (the prefill rank learns its own
    step by step), so ``remote_block_ids`` are the prompt's block indexes in
    the prefill engine's block size: staging block ``k`` holds prompt block
    ``remote_block_ids[0] + k``. The load moves tokens ``[first_token, end)``,
    ``end`` the least of ``num_tokens`` and what the local blocks cover.

    Example: prefill block 64, decode block 16, ``first_token`` 32, 100 tokens
    loaded, 5 local blocks → prompt blocks 0 and 1 into staging, 68 tokens
    from staging token 32 into the 5 local blocks.

    Raises:
        BlockCountError: the local blocks end before ``num_tokens`` (a stream never moves part of a prompt).
    """
    covered = spec.first_token + len(spec.local_block_ids) * local_block_size
    if covered < spec.num_tokens:
        raise BlockCountError(f"local blocks cover {covered} prompt tokens ({len(spec.local_block_ids)} blocks of "
                              f"{local_block_size} from token {spec.first_token}), the load has {spec.num_tokens}")
    end = min(covered, spec.num_tokens) if spec.num_tokens >= 0 else covered
    n = max(0, end - spec.first_token)
    if n == 0:
        return StagedRead((), 0, 0, ())
    first_remote = spec.first_token // remote_block_size
    return StagedRead(
        remote_block_ids=tuple(range(first_remote, _ceil_div(end, remote_block_size))),
        src_token_offset=spec.first_token - first_remote * remote_block_size,
        num_tokens=n,
        dst_block_ids=spec.local_block_ids[:_ceil_div(n, local_block_size)],
    )


def grouped_streamed_read(spec: LoadSpec, block_size: int) -> StagedRead:
    """The :class:`StagedRead` of a layer-streamed load into staging of a model with several KV cache groups.

    Such a pair uses one block size on both engines
    (:func:`p2pkv.dataplane.negotiate.plan_peer` refuses others) and moves
    whole blocks, each group's into its own: the groups' blocks are staged
    one group after the other (:func:`staged_groups`), so staging block ``k``
    lands whole in ``local_block_ids[k]`` (the groups' blocks concatenated,
    :attr:`p2pkv.metadata.LoadSpec.stream_groups`). ``remote_block_ids`` are
    then staging block indexes ``0 .. n-1`` (only their count is read).

    Example: group 0 blocks ``[10, 11, 12]``, group 1 (a sliding window)
    ``[8, 9]`` → 5 staging blocks, 5 × ``block_size`` tokens from staging
    token 0 into ``[10, 11, 12, 8, 9]``.

    Raises:
        BlockCountError: ``local_block_ids`` are not the groups' blocks concatenated.
    """
    local = tuple(i for group in spec.stream_groups for i in group.block_ids)
    if local != tuple(spec.local_block_ids):
        raise BlockCountError(f"local blocks ({len(spec.local_block_ids)}) are not the {len(spec.stream_groups)} "
                              f"KV cache groups' blocks ({len(local)}) one group after the other")
    n = len(local)
    return StagedRead(tuple(range(n)), 0, n * block_size, local)


def staged_groups(groups: Sequence[GroupBlocks]) -> tuple[GroupBlocks, ...]:
    """Each KV cache group's staging blocks in :func:`grouped_streamed_read`'s staging: group ``g``'s after
    those of groups ``0 .. g-1``, each group's ``first_block`` kept (a stream request's destination).

    Example: ``[GroupBlocks(0, [10, 11, 12]), GroupBlocks(2, [8, 9])]`` →
    ``(GroupBlocks(0, [0, 1, 2]), GroupBlocks(2, [3, 4]))``.
    """
    out = []
    start = 0
    for group in groups:
        out.append(GroupBlocks(group.first_block, list(range(start, start + len(group.block_ids)))))
        start += len(group.block_ids)
    return tuple(out)


def direct_pairs(spec: LoadSpec, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_ids, remote_ids)`` paired block for block, for peers with the same block size.

    Tasks with ``num_tokens == -1`` already pair up and are returned as they are.
    """
    if spec.num_tokens < 0:
        return spec.local_block_ids, spec.remote_block_ids
    first_block = spec.first_token // block_size
    count = max(0, _ceil_div(token_end(spec, block_size, block_size) - spec.first_token, block_size))
    return spec.local_block_ids[:count], spec.remote_block_ids[first_block:first_block + count]


@dataclass(frozen=True)
class StagedRead:
    """A pull through staging: which remote blocks to READ and where their tokens go.

    Attributes:
        remote_block_ids: remote blocks to READ into staging, in token order.
        src_token_offset: staging token (0-based over the staged blocks) of
            the first token to move.
        num_tokens: tokens to move.
        dst_block_ids: local blocks that receive them, from slot 0 of the first.
    """

    remote_block_ids: tuple[int, ...]
    src_token_offset: int
    num_tokens: int
    dst_block_ids: tuple[int, ...]


def staged_read(spec: LoadSpec, local_block_size: int, remote_block_size: int) -> StagedRead:
    """The :class:`StagedRead` of a spec between engines of any two block sizes.

    Example: prefill block 64, decode block 16, ``first_token`` 32, 100 prompt
    tokens → READ remote blocks 0 and 1, move 68 tokens starting at staging
    token 32 into the first 5 local blocks.
    """
    end = token_end(spec, local_block_size, remote_block_size)
    n = max(0, end - spec.first_token)
    if n == 0:
        return StagedRead((), 0, 0, ())
    first_remote = spec.first_token // remote_block_size
    last_remote = _ceil_div(end, remote_block_size)
    return StagedRead(
        remote_block_ids=spec.remote_block_ids[first_remote:last_remote],
        src_token_offset=spec.first_token - first_remote * remote_block_size,
        num_tokens=n,
        dst_block_ids=spec.local_block_ids[:_ceil_div(n, local_block_size)],
    )
