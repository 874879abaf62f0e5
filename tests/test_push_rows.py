"""Push mode, prefill side: ``check_rows_in_blocks``, the check that every byte a decode rank asks a prefill rank
to WRITE lies in the held request's blocks (the rows come from the decode rank: anyone's choice)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.dataplane.layout import Segment
from p2pkv.dataplane.plan import PlanError, build_descriptors, check_rows_in_blocks, coalesce_runs

NUM_BLOCKS = 8
PAGE = 256
BASE = 0x10_0000
K = Segment(BASE, PAGE, PAGE, 0, 1, kv_index=0)  # [2, num_blocks, ...]: K's blocks, then V's
V = Segment(BASE + NUM_BLOCKS * PAGE, PAGE, PAGE, 0, 1, kv_index=1)
SPLIT = (K, V)


def rows(*triples: tuple[int, int]) -> np.ndarray:
    """uint64 ``[n, 3]`` rows ``(addr, bytes, 0)``."""
    out = np.zeros((len(triples), 3), dtype=np.uint64)
    for i, (addr, length) in enumerate(triples):
        out[i, 0], out[i, 1] = addr, length
    return out


def ok(r: np.ndarray, held: list[int], segments: tuple[Segment, ...] = SPLIT) -> bool:
    """True when the rows pass; False when refused (PlanError, never anything else)."""
    try:
        check_rows_in_blocks(r, segments, NUM_BLOCKS, held)
    except PlanError:
        return False
    return True


def block(seg: Segment, b: int) -> int:
    """Address of block ``b`` in ``seg``."""
    return seg.addr + b * seg.block_stride


def test_rows_inside_held_blocks_pass() -> None:
    assert ok(rows((block(K, 2), PAGE), (block(V, 2), PAGE)), [2])
    assert ok(rows((block(K, 2) + 16, 32)), [2]), "a slice of a page (a head slice)"
    assert ok(rows((block(K, 2), 3 * PAGE), (block(V, 2), 3 * PAGE)), [2, 3, 4]), "a run of consecutive held blocks"
    assert ok(rows((block(K, 7), PAGE), (block(V, 0), PAGE)), [0, 7]), "the first and last block of each segment"
    assert ok(rows(), [1]), "nothing to write"
    assert ok(rows((block(K, 2), PAGE)), [5, 2, 7]), "held ids in any order"


def test_the_rows_that_the_decode_side_plans_for_a_pull_pass() -> None:
    """What a decode rank sends: its READ's remote rows for a pull of held blocks (coalesced runs)."""
    _, remote, lengths = coalesce_runs([0, 1, 2, 5], [3, 4, 5, 7], NUM_BLOCKS, NUM_BLOCKS)
    source = build_descriptors(SPLIT, remote, lengths)
    assert ok(source, [3, 4, 5, 7])
    assert not ok(source, [3, 4, 7]), "one block of a coalesced run not held"


OUTSIDE = [
    (rows((block(K, 3), PAGE)), [2], "a block not held"),
    (rows((block(K, 2), PAGE + 1)), [2], "one byte into the next (not held) block"),
    (rows((block(K, 2) - 1, PAGE)), [2], "one byte before, in the previous (not held) block"),
    (rows((block(K, 2), 2 * PAGE)), [2, 4], "spanning a block not held between held ones"),
    (rows((block(K, 2), PAGE), (block(V, 3), PAGE)), [2], "the second row in a block not held"),
    (rows((BASE - 1, 1)), list(range(NUM_BLOCKS)), "below every segment"),
    (rows((BASE - 8, 16)), list(range(NUM_BLOCKS)), "straddling the start of the first segment"),
    (rows((block(V, 7), PAGE + 1)), list(range(NUM_BLOCKS)), "one byte past the last block"),
    (rows((block(V, NUM_BLOCKS), PAGE)), list(range(NUM_BLOCKS)), "right after the cache"),
    (rows((block(K, 7), 2 * PAGE)), list(range(NUM_BLOCKS)), "from K's last block into V's first"),
    (rows((block(K, 2), 0)), [2], "a row of zero bytes"),
    (rows((block(K, 2), PAGE), (block(K, 3), 0)), [2, 3], "a zero-byte row after a good one"),
]


@pytest.mark.parametrize(("r", "held", "what"), OUTSIDE,
                         ids=[re.sub(r"\W+", "_", w).strip("_") for _, _, w in OUTSIDE])
def test_rows_reaching_outside_the_held_blocks_are_refused(r: np.ndarray, held: list[int], what: str) -> None:
    assert not ok(r, held), what


def test_the_refusal_names_the_first_bad_row() -> None:
    r = rows((block(K, 2), PAGE), (block(K, 2), PAGE), (block(K, 6), PAGE), (block(K, 7), PAGE))
    with pytest.raises(PlanError, match=rf"descriptor row 2 \({block(K, 6):#x}, {PAGE} B\)"):
        check_rows_in_blocks(r, SPLIT, NUM_BLOCKS, [2])


@pytest.mark.parametrize(("addr", "length"), [
    (2**64 - 1, 1), (block(K, 2), 2**64 - 1), (2**63, PAGE), (block(K, 2), 2**63), (2**62, 1),
    (2**64 - PAGE, 2 * PAGE),  # addr + length wraps around 2**64 into the held block
    (block(K, 3), 2**64 - PAGE),  # from a block not held, wrapping around 2**64 onto the held one
], ids=["max_addr", "max_len", "addr_2_63", "len_2_63", "addr_2_62", "wrapping_sum", "wrapping_len"])
def test_overflow_sized_values_are_refused_not_wrapped(addr: int, length: int) -> None:
    assert not ok(rows((addr, length % 2**64)), list(range(NUM_BLOCKS)))


def test_bad_row_shapes_are_refused() -> None:
    with pytest.raises(PlanError, match=r"\[n, 3\]"):
        check_rows_in_blocks(np.zeros((2, 2), dtype=np.uint64), SPLIT, NUM_BLOCKS, [1])
    with pytest.raises(PlanError, match=r"\[n, 3\]"):
        check_rows_in_blocks(np.zeros(6, dtype=np.uint64), SPLIT, NUM_BLOCKS, [1])


def test_segments_given_in_any_order() -> None:
    r = rows((block(V, 4), PAGE))
    assert ok(r, [4], (V, K)) and not ok(r, [3], (V, K))


def test_gap_between_segments_is_refused() -> None:
    far = Segment(BASE + 64 * PAGE, PAGE, PAGE, 1, 1)  # another layer's tensor, with a gap before it
    segments = (K, V, far)
    assert ok(rows((block(far, 1), PAGE)), [1], segments)
    gap = block(V, NUM_BLOCKS) + PAGE  # after V's last block, before ``far``
    assert not ok(rows((gap, PAGE)), list(range(NUM_BLOCKS)), segments)


# ---- segments whose blocks do not touch (a page shorter than the block stride) --------------------------
# A block-first buffer shared with other state: per block, [attention layer 0 | other state | attention layer 1];
# only the two attention pages are registered segments (they cannot merge: they do not touch).
STRIDE = 3 * PAGE
A0 = Segment(BASE, PAGE, STRIDE, 0, 1)
A1 = Segment(BASE + 2 * PAGE, PAGE, STRIDE, 1, 1)
SPARSE = (A0, A1)


def test_a_padded_segment_takes_rows_inside_its_pages() -> None:
    """One segment whose page is shorter than its block stride (a page padded to another layer kind's size)."""
    assert ok(rows((block(A0, 2), PAGE), (block(A0, 5) + 8, 64)), [2, 5], (A0,))
    assert not ok(rows((block(A0, 3), PAGE)), [2], (A0,))


def test_interleaved_segments_take_rows_inside_their_pages() -> None:
    assert ok(rows((block(A0, 2), PAGE)), [2], SPARSE), "A0's page of held block 2"
    assert ok(rows((block(A0, 2), PAGE), (block(A1, 2), PAGE), (block(A1, 5) + 8, 64)), [2, 5], SPARSE)


def test_a_row_may_not_run_from_a_held_page_into_the_next_block() -> None:
    """Held block 1 only. A row from A1's page of block 1, ``STRIDE`` bytes long, ends inside block 2
    (its A0 page: another request's KV)."""
    start = block(A1, 1)
    assert start + STRIDE > block(A0, 2), "the row reaches block 2"
    assert not ok(rows((start, STRIDE)), [1], SPARSE)


# ---- against a per-block reference -------------------------------------------------------------------------
def reference(addr: int, length: int, segments: tuple[Segment, ...], held: set[int]) -> bool:
    """The rule, one block at a time: the segment the row starts in (the last one starting at or before it)
    owns ``[addr + b * stride, + stride)`` for ``b < NUM_BLOCKS``; every block the row touches must be held."""
    if length == 0 or addr >= 2**62 or length >= 2**62:
        return False
    starts = [s for s in sorted(segments, key=lambda s: s.addr) if s.addr <= addr]
    if not starts:
        return False
    seg = starts[-1]
    first, last = (addr - seg.addr) // seg.block_stride, (addr + length - 1 - seg.addr) // seg.block_stride
    return last < NUM_BLOCKS and all(b in held for b in range(first, last + 1))


@settings(max_examples=400, deadline=None)
@given(held=st.sets(st.integers(0, NUM_BLOCKS - 1)),
       picks=st.lists(st.tuples(st.integers(-PAGE, 2 * NUM_BLOCKS * PAGE + PAGE), st.integers(0, 4 * PAGE)),
                      min_size=1, max_size=6))
def test_agrees_with_the_per_block_reference(held: set[int], picks: list[tuple[int, int]]) -> None:
    triples = [(BASE + off, length) for off, length in picks]
    expected = all(reference(a, n, SPLIT, held) for a, n in triples)
    assert ok(rows(*triples), sorted(held)) == expected
