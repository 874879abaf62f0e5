"""Token ranges and block lists of a pull between engines of any two block sizes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.dataplane.blockmap import direct_pairs, staged_read
from p2pkv.metadata import LoadSpec
from p2pkv.params import RemotePrefill

REMOTE = RemotePrefill("p", "r", "127.0.0.1", 1, (), 1)


def task(local: list[int], remote: list[int], first: int, num_tokens: int) -> LoadSpec:
    return LoadSpec("d", tuple(local), tuple(remote), REMOTE, first_token=first, num_tokens=num_tokens)


def test_example_from_the_docstring() -> None:
    read = staged_read(task(list(range(10, 20)), [7, 8, 9], 32, 100), 16, 64)
    assert read.remote_block_ids == (7, 8) and read.src_token_offset == 32 and read.num_tokens == 68
    assert read.dst_block_ids == (10, 11, 12, 13, 14)


@settings(max_examples=300, deadline=None)
@given(bs_l=st.sampled_from([16, 32, 64]), bs_r=st.sampled_from([16, 32, 64]), prompt=st.integers(1, 400),
       cached_blocks=st.integers(0, 6))
def test_every_token_maps_to_its_remote_and_local_slot(bs_l: int, bs_r: int, prompt: int, cached_blocks: int) -> None:
    first = min(cached_blocks * bs_l, (prompt - 1) // bs_l * bs_l)
    remote = [1000 + i for i in range(-(-prompt // bs_r))]
    local = [2000 + i for i in range(first // bs_l, -(-prompt // bs_l))]
    read = staged_read(task(local, remote, first, prompt), bs_l, bs_r)
    assert read.num_tokens == prompt - first
    for k in range(read.num_tokens):
        t = first + k
        staged = read.src_token_offset + k
        assert read.remote_block_ids[staged // bs_r] == remote[t // bs_r]
        assert read.dst_block_ids[k // bs_l] == 2000 + t // bs_l
    if bs_l == bs_r:
        loc, rem = direct_pairs(task(local, remote, first, prompt), bs_l)
        assert [r - 1000 for r in rem] == [x - 2000 for x in loc] and len(loc) == len(local)


def test_paired_lists_pass_through_and_nothing_to_move() -> None:
    assert direct_pairs(task([1, 2], [5, 6], 0, -1), 16) == ((1, 2), (5, 6))
    assert staged_read(task([], [5], 0, 10), 16, 32).num_tokens == 0
