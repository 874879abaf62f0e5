"""layout and plan: block ids map to exactly the bytes torch indexing selects."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.dataplane.layout import (
    KVLayout,
    LayoutError,
    check_state_views,
    describe_kv_caches,
    describe_torch_kv_caches,
    tensor_info,
)
from p2pkv.dataplane.plan import PlanError, build_descriptors, coalesce_runs, split_rows
from p2pkv.testing import KV_LAYOUTS, block_bytes, make_kv_caches


def _block_rows(kv: KVLayout, block: int) -> list[tuple[int, int]]:
    """``(addr, length)`` of the descriptor rows a pull of one block moves, planned as pulls plan them."""
    starts, _, lengths = coalesce_runs([block], [block], kv.num_blocks, kv.num_blocks)
    return [(int(a), int(n)) for a, n, _ in build_descriptors(kv.segments, starts, lengths)]


def _read(base: torch.Tensor, addr: int, length: int) -> bytes:
    raw = base.view(-1).view(torch.uint8).numpy()
    off = addr - base.data_ptr()
    assert off >= 0 and off + length <= raw.size
    return raw[off:off + length].tobytes()


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(KV_LAYOUTS), layers=st.integers(1, 5), blocks=st.integers(3, 12),
       heads=st.integers(1, 3), block_size=st.sampled_from([1, 4, 16]), head_dim=st.sampled_from([2, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
def test_block_rows_equal_torch_indexing(layout, layers, blocks, heads, block_size, head_dim, dtype) -> None:
    base, views = make_kv_caches(layout, layers, blocks, heads, block_size, head_dim, dtype)
    kv = describe_torch_kv_caches(views, blocks)
    assert kv.cross_layer == (layout == "BLHNC" or (layers == 1 and layout != "KV_SPLIT"))
    expected_segments = 1 if layout == "BLHNC" else layers * (2 if layout == "KV_SPLIT" else 1)
    assert len(kv.segments) == expected_segments
    for b in range(blocks):
        got = b"".join(_read(base, addr, n) for addr, n in _block_rows(kv, b))
        assert got == block_bytes(views, layout, b)
    assert kv.regions[0].addr == base.untyped_storage().data_ptr()


def test_layouts_refused_with_a_reason() -> None:
    t = torch.zeros(4, 3, 8)[:, :, ::2]  # pages not contiguous
    with pytest.raises(LayoutError, match="not contiguous"):
        describe_kv_caches([tensor_info("l0", t)], 4)
    with pytest.raises(LayoutError, match="no block dim"):
        describe_kv_caches([tensor_info("l0", torch.zeros(3, 5, 8))], 4)
    with pytest.raises(LayoutError, match="different page sizes"):
        describe_kv_caches([tensor_info("a", torch.zeros(4, 8)), tensor_info("b", torch.zeros(4, 16))], 4)
    with pytest.raises(LayoutError, match="no KV cache"):
        describe_kv_caches([], 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), max_size=40, unique_by=lambda t: t[0]))
def test_coalescing_covers_exactly_the_blocks(pairs) -> None:
    local = [p[0] for p in pairs]
    remote = [p[1] for p in pairs]
    ls, rs, lengths = coalesce_runs(local, remote, 64, 64)
    got = [(int(l0) + k, int(r0) + k) for l0, r0, n in zip(ls, rs, lengths, strict=True) for k in range(n)]
    assert got == list(zip(local, remote, strict=True))
    runs = 1 + sum(1 for i in range(1, len(local)) if local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1)
    assert len(lengths) == (runs if local else 0)


def test_plan_rejects_bad_ids() -> None:
    with pytest.raises(PlanError, match="outside"):
        coalesce_runs([0, 64], [0, 1], 64, 64)
    with pytest.raises(PlanError, match="remote block id -1"):
        coalesce_runs([0], [-1], 64, 64)
    with pytest.raises(PlanError, match="repeat"):
        coalesce_runs([3, 3], [1, 2], 64, 64)
    with pytest.raises(PlanError, match="pair up"):
        coalesce_runs([1, 2], [1], 64, 64)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_descriptors_cover_the_same_bytes_as_blocks(layout) -> None:
    base, views = make_kv_caches(layout, 3, 16, 2, 4, 8)
    kv = describe_torch_kv_caches(views, 16)
    local = [2, 3, 4, 9, 15]
    ls, _, lengths = coalesce_runs(local, [0, 1, 2, 5, 6], 16, 16)
    descs = build_descriptors(kv.segments, ls, lengths)
    assert descs.dtype == np.uint64 and descs.shape[1] == 3
    # Cross-layer and layer-compact layouts coalesce runs; one descriptor per run per segment.
    assert descs.shape[0] == len(kv.segments) * len(lengths)
    got = sorted(_read(base, int(a), int(n)) for a, n, _ in descs)
    want = []
    for seg in kv.segments:
        for l0, n in zip(ls, lengths, strict=True):
            want.append(_read(base, seg.addr + int(l0) * seg.block_stride, int(n) * seg.length))
    assert got == sorted(want)
    total = sum(len(block_bytes(views, layout, b)) for b in local)
    assert int(descs[:, 1].sum()) == total


# vLLM 0.32's KVCacheLayout family: stride permutations over logical [L, B, H, N, C].
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def _logical(order: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor allocated in physical ``order``, viewed as logical ``shape``; plus the
    same view over each element's physical index."""
    phys_shape = [shape[d] for d in order]
    inverse = [order.index(d) for d in range(len(order))]
    phys = torch.zeros(phys_shape, dtype=dtype)
    index = torch.arange(phys.numel()).view(phys_shape)
    return phys.permute(inverse), index.permute(inverse)


def _selected_bytes(index: torch.Tensor, itemsize: int, base_ptr: int) -> set[int]:
    idx = index.reshape(-1).tolist()
    return {base_ptr + i * itemsize + k for i in idx for k in range(itemsize)}


def _range_bytes(ranges: list[tuple[int, int]]) -> set[int]:
    return {a + k for a, n in ranges for k in range(n)}


@pytest.mark.parametrize("name", list(KV_CACHE_LAYOUTS))
def test_kv_cache_layout_family(name) -> None:
    L, B, H, N, C = 3, 5, 2, 4, 6
    logical, index = _logical(KV_CACHE_LAYOUTS[name], (L, B, H, N, C), torch.bfloat16)
    views = {f"l{i}": logical[i] for i in range(L)}
    if name == "LHBNC":  # a block's bytes are spread over H separate runs per layer
        with pytest.raises(LayoutError, match="not contiguous"):
            describe_torch_kv_caches(views, B)
        return
    kv = describe_torch_kv_caches(views, B)
    assert len(kv.segments) == (1 if name.startswith("B") else L)
    assert kv.cross_layer == name.startswith("B")
    base = logical.untyped_storage().data_ptr()
    for b in range(B):
        assert _range_bytes(_block_rows(kv, b)) == _selected_bytes(index[:, b], 2, base)


def test_mla_latent_cache() -> None:
    """MLA: one latent vector per token, no heads: per-layer [B, N, C]."""
    L, B, N, C = 4, 6, 8, 10
    base = torch.zeros(L, B, N, C, dtype=torch.float16)
    index = torch.arange(base.numel()).view(L, B, N, C)
    kv = describe_torch_kv_caches({f"l{i}": base[i] for i in range(L)}, B)
    assert len(kv.segments) == L
    for b in range(B):
        assert _range_bytes(_block_rows(kv, b)) == _selected_bytes(index[:, b], 2, base.data_ptr())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 17))
def test_split_rows_cover_the_same_bytes_in_pieces(lengths, max_bytes) -> None:
    local = np.array([[1000 * i, n, 0] for i, n in enumerate(lengths)], dtype=np.uint64)
    remote = np.array([[500_000 + 997 * i, n, 3] for i, n in enumerate(lengths)], dtype=np.uint64)
    ls, rs = split_rows(local, remote, max_bytes)
    assert ls[:, 1].max() <= max_bytes and np.array_equal(ls[:, 1], rs[:, 1]) and (rs[:, 2] == 3).all()

    def byte_addrs(rows: np.ndarray) -> list[int]:
        return [int(a) + k for a, n, _ in rows.tolist() for k in range(n)]

    assert byte_addrs(ls) == byte_addrs(local) and byte_addrs(rs) == byte_addrs(remote)
    assert len(ls) == sum(-(-n // max_bytes) for n in lengths)


def _hybrid_cache(num_blocks: int = 6, page: int = 4096, state: int = 1500):
    """vLLM's hybrid KV cache: per tensor, an attention layer's pages and a Mamba layer's state share one buffer.

    Returns ``(attention tensors, state views)``: attention ``[num_blocks, 2, 16, 32]`` float32 (one 4 KiB page per
    block), state ``[num_blocks, 1, 1, state]`` int8 views at the start of the same pages.
    """
    buf = torch.zeros(2 * num_blocks * page, dtype=torch.int8)
    attn, states = {}, {}
    for layer in range(2):
        off = layer * num_blocks * page
        attn[f"attn.{layer}"] = buf[off:off + num_blocks * page].view(torch.float32).view(num_blocks, 2, 16, 32)
        states[f"mamba.{layer}"] = torch.as_strided(buf, (num_blocks, 1, 1, state), (page, state, state, 1), off)
    return attn, states


def test_state_views_inside_the_attention_pages_move_with_their_block() -> None:
    """A Mamba layer's state of block ``b`` lies in page ``b`` of an attention tensor, which a pull of ``b`` moves."""
    attn, states = _hybrid_cache()
    layout = describe_torch_kv_caches(attn, 6)
    check_state_views(layout, [tensor_info(n, v) for n, v in states.items()])
    for block in range(6):
        moved = _range_bytes(_block_rows(layout, block))
        for view in states.values():
            start = view.data_ptr() + block * view.stride(0)
            assert set(range(start, start + view.shape[-1])) <= moved


def test_state_views_outside_the_attention_pages_are_refused() -> None:
    attn, states = _hybrid_cache()
    layout = describe_torch_kv_caches(attn, 6)
    apart = torch.zeros(6, 1, 1, 1500, dtype=torch.int8)  # its own allocation: no attention page holds it
    too_long = torch.as_strided(states["mamba.0"], (6, 1, 1, 5000), (4096, 5000, 5000, 1))
    for name, view in (("apart", apart), ("too_long", too_long)):
        with pytest.raises(LayoutError, match=f"layer {name}: its Mamba/SSM state .* is not inside an attention"):
            check_state_views(layout, [tensor_info(name, view)])
    with pytest.raises(LayoutError, match="has no leading block dim of size 6"):
        check_state_views(layout, [tensor_info("short", states["mamba.0"][:3])])
