"""TP mapping between prefill and decode ranks, against a head-by-head reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.dataplane.topology import (
    TopologyError,
    heads_per_rank,
    notifiers_of,
    notify_ranks,
    rank_first_head,
    read_plan,
)


def holders(head: int, heads: int, tp: int) -> set[int]:
    """Reference: the ranks that hold ``head`` (vLLM's split: blocks of heads, or replicas)."""
    return {r for r in range(tp) if head in range(rank_first_head(r, heads, tp),
                                                  rank_first_head(r, heads, tp) + heads_per_rank(heads, tp))}


sizes = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=200, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8, 16]), tp_d=sizes, tp_p=sizes, mla=st.booleans())
def test_every_decode_head_is_read_once_from_a_rank_that_holds_it(heads: int, tp_d: int, tp_p: int,
                                                                 mla: bool) -> None:
    h = 1 if mla else heads
    for d in range(tp_d):
        first, count = rank_first_head(d, h, tp_d), heads_per_rank(h, tp_d)
        covered = []
        for rr in read_plan(d, tp_d, tp_p, heads, mla):
            assert rr.remote_head_start >= 0 and rr.remote_head_start + rr.num_heads <= heads_per_rank(h, tp_p)
            for i in range(rr.num_heads):
                local, global_head = rr.local_head_start + i, first + rr.local_head_start + i
                remote_global = rank_first_head(rr.remote_rank, h, tp_p) + rr.remote_head_start + i
                assert remote_global == global_head
                assert rr.remote_rank in holders(global_head, h, tp_p)
                covered.append(local)
        assert sorted(covered) == list(range(count))
    # Every prefill rank is notified by at least one decode rank, and the counts add up.
    total = sum(len(notify_ranks(d, tp_d, tp_p, heads, mla)) for d in range(tp_d))
    counts = [notifiers_of(r, tp_d, tp_p, heads, mla) for r in range(tp_p)]
    assert min(counts) >= 1 and sum(counts) == total
    for d in range(tp_d):
        read = {rr.remote_rank for rr in read_plan(d, tp_d, tp_p, heads, mla)}
        assert read <= set(notify_ranks(d, tp_d, tp_p, heads, mla))


def test_examples() -> None:
    # Decode TP 1 reads both halves from prefill TP 2.
    assert [(r.remote_rank, r.remote_head_start, r.local_head_start, r.num_heads)
            for r in read_plan(0, 1, 2, 8)] == [(0, 0, 0, 4), (1, 0, 4, 4)]
    # Decode TP 2 rank 1 reads the upper half of prefill TP 1's heads.
    assert [(r.remote_rank, r.remote_head_start, r.local_head_start, r.num_heads)
            for r in read_plan(1, 2, 1, 8)] == [(0, 4, 0, 4)]
    # GQA: 2 heads over prefill TP 4 replicate each head twice; decode TP 1 reads ranks 0 and 2
    # and notifies the replicas 1 and 3 as well.
    assert [r.remote_rank for r in read_plan(0, 1, 4, 2)] == [0, 2]
    assert notify_ranks(0, 1, 4, 2) == [0, 1, 2, 3]
    # Decode TP 4 over prefill TP 1: four decode ranks notify the one prefill rank.
    assert notifiers_of(0, 4, 1, 8) == 4


def test_unsplittable_heads_are_refused_naming_both_values() -> None:
    with pytest.raises(TopologyError, match="6 KV heads cannot be split over tp_size=4"):
        read_plan(0, 4, 1, 6)
    with pytest.raises(TopologyError, match=r"tp_rank=2 outside \[0, tp_size=2\)"):
        rank_first_head(2, 4, 2)


@settings(max_examples=200, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8, 16]), tp_d=sizes, tp_p=sizes, mla=st.booleans())
def test_a_streams_readers_are_the_decode_ranks_that_send_it_a_destination(heads: int, tp_d: int, tp_p: int,
                                                                          mla: bool) -> None:
    """A layer stream's ``readers`` (``notifiers_of``, what each decode rank tells a prefill rank it reads) are
    exactly the decode ranks that read that prefill rank, each sending it a destination; a prefill rank nobody
    reads is told by exactly one decode rank, whose release declines its stream."""
    read_by = {r: {d for d in range(tp_d) if r in {rr.remote_rank for rr in read_plan(d, tp_d, tp_p, heads, mla)}}
               for r in range(tp_p)}
    for r, readers in read_by.items():
        told_by = [d for d in range(tp_d) if r in notify_ranks(d, tp_d, tp_p, heads, mla)]
        if readers:
            assert set(told_by) == readers and notifiers_of(r, tp_d, tp_p, heads, mla) == len(readers)
        else:
            assert len(told_by) == 1 and notifiers_of(r, tp_d, tp_p, heads, mla) == 1


@settings(max_examples=100, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8]), tp_d=sizes, tp_p=sizes, pp=st.sampled_from([1, 2, 3]))
def test_each_stage_is_read_and_notified_as_a_whole_model_prefill_engine_is(heads: int, tp_d: int, tp_p: int,
                                                                             pp: int) -> None:
    """A decode rank reads the same head slices from every stage, whose workers are ranks ``stage * tp + r``;
    every prefill worker of every stage is notified, each by as many decode ranks as without stages."""
    from p2pkv.dataplane.rank import LocalRank

    def local(rank: int) -> LocalRank:
        desc = SimpleNamespace(is_mla=False, num_kv_heads=max(1, heads // tp_d), total_num_kv_heads=heads)
        return LocalRank("decode", rank, tp_d, None, desc)  # type: ignore[arg-type]

    notified: dict[int, int] = {}
    for d in range(tp_d):
        rank = local(d)
        reads, notify = rank.topology(tp_p, pp)
        one_stage = read_plan(d, tp_d, tp_p, heads)
        assert [(r.remote_rank, r.remote_head_start, r.local_head_start, r.num_heads) for r in reads] == [
            (s * tp_p + r.remote_rank, r.remote_head_start, r.local_head_start, r.num_heads)
            for s in range(pp) for r in one_stage]
        for r, n in zip(notify, rank.notifiers(tp_p, notify), strict=True):
            assert n == notifiers_of(r % tp_p, tp_d, tp_p, heads)
            notified[r] = notified.get(r, 0) + 1
        assert rank.answered_ranks(tp_p, pp) == notify
    assert notified == {r: notifiers_of(r % tp_p, tp_d, tp_p, heads) for r in range(tp_p * pp)}
