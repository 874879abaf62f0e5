"""Layer streams of a model with several KV cache groups between engines whose pages differ, with real NIXL.

Such a pair of HND and NHD pages (one block size on both engines, as for a
pull of such a model) streams into the decode rank's staging: each group's
blocks staged after the previous group's, each staging block fixed up whole
into the decode block of the same group and position. A pair of another TP
size over head-major pages streams each prefill rank's heads of every
group's blocks straight into their slice of the decode blocks of the same
group and position (``head_slice``). Both
engines' workers run in this process, their caches filled as in
:mod:`tests.test_hetero` (a unique int32 code per layer, token, global head
and element), the sliding-window group's blocks with codes of their own so
that a block landing in the other group's block is seen.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from handshake import GroupBlocks
from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.blockmap import BlockCountError, StagedRead, grouped_streamed_read, staged_groups
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.worker import WorkerSide
from tests.conftest import free_ports
from tests.test_hetero import NUM_BLOCKS, ROWS, Side, block_ids, fill, make_cache, model_info
from tests.test_stream_hetero import SECRET, forward_streamed, granted_stream, release_prefills, streamed_stats

WINDOW_FIRST = 2
"""The window group's first prompt block on both engines (vLLM's null block before it: behind the window)."""
WINDOW_CODE = 2048
"""Token offset of the window group's codes (its layers' KV differs from the full-attention layers')."""

GROUPED_ROWS = ["HND -> NHD", "TP 2 -> 1", "TP 1 -> 2"]
"""Pairs of one block size whose pages differ: page order (staged), a decode rank reading two prefill ranks' heads,
two decode ranks each taking half of one prefill rank's heads (sliced)."""

Workers = list[tuple[WorkerSide, torch.Tensor, dict[str, torch.Tensor]]]


def _workers(engine: str, side: Side, port: int, full: list[int] | None = None, window: list[int] | None = None,
             tokens: int = 0) -> Workers:
    """One worker per rank of ``side`` for a model of two KV cache groups sharing each tensor (``full.i`` and
    ``window.i``), its cache holding the codes of ``tokens`` prompt tokens: the full group's in ``full``, the
    window group's from prompt block :data:`WINDOW_FIRST` in ``window``; a decode engine verifies what lands
    (``verify_kv``)."""
    out = []
    for rank in range(side.tp_size):
        config = P2pKvConfig(side_channel_host="127.0.0.1", side_channel_port=port, staging_mib=4, secret=SECRET,
                             stream_min_tokens=0, verify_kv=engine == "decode")
        info = dataclasses.replace(model_info(side, rank), kv_groups=2)
        worker = WorkerSide(engine, config, rank, side.tp_size, "127.0.0.1", port + rank, "compat", info)
        base, views = make_cache(side, rank, "cpu", full, tokens)
        if window is not None:
            first = WINDOW_FIRST * side.block_size
            fill(side, rank, views, window, tokens - first, first=WINDOW_CODE + first)
        named = {f"{group}.{i}": view for group in ("full", "window") for i, view in enumerate(views.values())}
        worker.register_kv_caches(named, NUM_BLOCKS, layer_groups={n: int(n.startswith("window")) for n in named})
        out.append((worker, base, named))
    return out


@pytest.mark.parametrize("row", GROUPED_ROWS)
def test_a_grouped_stream_between_engines_whose_pages_differ_lands_each_group_in_its_own_blocks(row: str) -> None:
    """A 60-token prompt (4 blocks of 16): the full group's 4 blocks and the window group's blocks of prompt
    blocks 2 and 3 stream from every prefill rank into every decode rank's staging, then into its blocks of the
    same group, or, across TP sizes, each rank's heads straight into its blocks of the same group; whole blocks
    either way (as a pull of such a model moves them). Every part is verified (``verify_kv``): each page's
    digests of both groups' blocks, taken apart, agree on both sides."""
    prefill_side, decode_side, how = ROWS[row]
    tokens = 60
    loaded = tokens - 1
    n = -(-tokens // prefill_side.block_size)
    rng = np.random.default_rng(len(row))
    ids = block_ids(rng, 2 * n)
    full_remote, window_remote = ids[:n], ids[n + WINDOW_FIRST:]
    ids = block_ids(rng, 2 * n)
    full_local, window_local = ids[:n], ids[n + WINDOW_FIRST:]
    port = free_ports(1, run=prefill_side.tp_size)[0]
    prefills = _workers("prefill", prefill_side, port, full_remote, window_remote, tokens)
    decodes = _workers("decode", decode_side, free_ports(1, run=decode_side.tp_size)[0])
    deadline = time.monotonic() + 20
    try:
        granted = granted_stream(full_remote, tokens, port, prefill_side.tp_size,
                                 (GroupBlocks(WINDOW_FIRST, window_remote),))
        groups = (GroupBlocks(0, full_local), GroupBlocks(WINDOW_FIRST, window_local))
        load = P2pKvMetadata(loads=[LoadSpec("d-req", tuple(full_local + window_local), (), granted.remote,
                                             num_tokens=loaded, stream_grant=granted.grant, stream_groups=groups)])
        for prefill, _, _ in prefills:
            prefill.start_load_kv(granted.step)
        for decode, _, _ in decodes:
            decode.start_load_kv(load)
        forward_streamed(prefills, granted.step)
        for rank, (decode, base, _) in enumerate(decodes):
            stats = streamed_stats(decode, rank, how, deadline)
            assert set(stats.get("kv_checks", {})) == {"stream:verified"}, f"decode rank {rank}"
            if how == "paged":  # sliced: this rank's blocks of both groups, and nothing more
                block_bytes = decode.receiver.rank.layout.block_bytes
                assert stats.get("pull_bytes") == [len(full_local + window_local) * block_bytes]
            want, views = make_cache(decode_side, rank, "cpu", full_local, tokens)
            first = WINDOW_FIRST * decode_side.block_size
            fill(decode_side, rank, views, window_local, tokens - first, first=WINDOW_CODE + first)
            assert torch.equal(base, want), f"decode rank {rank}'s blocks differ from each group's codes"
        release_prefills(prefills, full_remote + window_remote, deadline)
    finally:
        for worker, _, _ in (*decodes, *prefills):
            worker.shutdown()


def test_each_group_is_staged_after_the_previous_groups_blocks_and_lands_whole_in_its_own() -> None:
    spec = LoadSpec("d", (10, 11, 12, 8, 9), (), None, num_tokens=40,  # type: ignore[arg-type]
                    stream_groups=(GroupBlocks(0, [10, 11, 12]), GroupBlocks(2, [8, 9])))
    assert grouped_streamed_read(spec, 16) == StagedRead((0, 1, 2, 3, 4), 0, 80, (10, 11, 12, 8, 9))
    assert staged_groups(spec.stream_groups) == (GroupBlocks(0, [0, 1, 2]), GroupBlocks(2, [3, 4]))
    with pytest.raises(BlockCountError, match="not the 2 KV cache groups' blocks"):
        grouped_streamed_read(dataclasses.replace(spec, local_block_ids=(10, 11, 12, 8)), 16)
