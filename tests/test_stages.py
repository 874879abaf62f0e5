"""A decode rank's KV seen as one pipeline stage's (``p2pkv.dataplane.stages``).

A prefill stage's cache here is a copy of layers ``[first, first + n)`` of the decode rank's cache, in the same
vLLM layout. The decode rank's stage view must pair with the stage's own description as two whole-model ranks
pair (direct placement), and every descriptor row built on the view must address, in the decode rank's memory,
the same bytes as the paired row in the stage's memory: the stage's layers land in the matching layers, none
elsewhere. Stage sets that leave a layer out, overlap or repeat a stage are refused naming the ranges.
"""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest
import torch

from handshake import AgentInfo
from p2pkv.dataplane.layout import LayoutError, describe_torch_kv_caches
from p2pkv.dataplane.negotiate import ModelInfo, PairRefused, Placement, layout_desc, plan_peer, remote_segments
from p2pkv.dataplane.plan import build_descriptors
from p2pkv.dataplane.stages import (
    StageLayers,
    check_peer_stages,
    check_stages,
    first_layer_of,
    stage_desc,
    stage_view,
)
from p2pkv.testing import make_kv_caches

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 8, 2, 4, 4
PAGE_ORDER = {"LBHNC": "HND", "BLHNC": "HND", "KV_SPLIT": "NHD"}


def _describe(views: dict[str, torch.Tensor], layout: str):
    kv = describe_torch_kv_caches(views, BLOCKS)
    model = ModelInfo(layout if layout != "KV_SPLIT" else "LBHNC", "float32", HEADS, HEAD_DIM, BLOCK_SIZE)
    return kv, layout_desc(kv, model, PAGE_ORDER[layout], mem_type="DRAM")


def _stage_cache(layout: str, decode_base: torch.Tensor, first: int, n: int) -> tuple[torch.Tensor, dict]:
    """A stage's own cache of ``n`` layers in ``layout``, holding the decode cache's layers ``first..``."""
    base, views = make_kv_caches(layout, n, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill=0.0)
    if layout == "BLHNC":
        base.copy_(decode_base[:, first:first + n])
    else:
        base.copy_(decode_base[first:first + n])
    return base, views


def _rows_bytes(rows: np.ndarray) -> list[bytes]:
    return [ctypes.string_at(int(addr), int(length)) for addr, length, _ in rows]


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "KV_SPLIT"])
@pytest.mark.parametrize(("first", "n"), [(0, 2), (2, 2), (1, 3), (3, 1)])
def test_a_stage_pairs_directly_with_its_layers_of_the_decode_ranks_cache_and_only_those(layout: str, first: int,
                                                                                         n: int) -> None:
    decode_base, decode_views = make_kv_caches(layout, LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill="pattern")
    decode_kv, decode_desc = _describe(decode_views, layout)
    stage_base, stage_views = _stage_cache(layout, decode_base, first, n)
    _, stage_desc = _describe(stage_views, layout)

    view, segments = stage_view(decode_desc, list(decode_kv.segments), StageLayers(1, first, n))
    plan = plan_peer(view, 0, 1, stage_desc, 0, 1)

    assert plan.placement is Placement.DIRECT
    ids, ones = np.array([5, 0, 3]), np.ones(3, dtype=np.int64)
    local = build_descriptors(segments, ids, ones)
    remote = build_descriptors(remote_segments(stage_desc), ids, ones)
    assert _rows_bytes(local) == _rows_bytes(remote)
    assert int(local[:, 1].sum()) == 3 * n * decode_kv.block_bytes // LAYERS
    lo, hi = decode_base.data_ptr(), decode_base.data_ptr() + decode_base.numel() * decode_base.element_size()
    assert all(lo <= a and a + size <= hi for a, size, _ in local)
    other = StageLayers(0, (first + 1) % (LAYERS - n + 1), n)
    if other.first_layer != first:  # another stage's layers hold other bytes: the pairing is not by position
        other_view, other_segments = stage_view(decode_desc, list(decode_kv.segments), other)
        assert _rows_bytes(build_descriptors(other_segments, ids, ones)) != _rows_bytes(remote)
        assert other_view.num_layers == n
    del stage_base


def test_a_cross_layer_cache_cut_at_uneven_layers_keeps_one_segment_length() -> None:
    _, views = make_kv_caches("BLHNC", LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill=0.0)
    kv, desc = _describe(views, "BLHNC")
    assert len(kv.segments) == 1 and kv.segments[0].num_layers == LAYERS

    view, segments = stage_view(desc, list(kv.segments), StageLayers(1, 1, 2))

    page = kv.block_bytes // LAYERS
    assert [(s.addr - kv.segments[0].addr, s.length, s.layer_start, s.num_layers) for s in segments] == [
        (page, 2 * page, 0, 2)]
    assert view.block_len == 2 * page and view.block_stride == kv.segments[0].block_stride
    assert [(r.layer_start, r.num_layers) for r in view.regions] == [(0, 2)]


def test_layers_the_decode_rank_does_not_hold_are_refused_naming_the_stage() -> None:
    _, views = make_kv_caches("LBHNC", LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill=0.0)
    kv, desc = _describe(views, "LBHNC")
    with pytest.raises(PairRefused, match=r"stage 1 holds layers 3\.\.4"):
        stage_view(desc, list(kv.segments), StageLayers(1, 3, 2))


@pytest.mark.parametrize(("stages", "pp_size", "layers", "match"), [
    ([StageLayers(0, 0, 2), StageLayers(1, 2, 2)], 2, 4, None),
    ([StageLayers(1, 2, 2), StageLayers(0, 0, 2)], 2, 4, None),
    ([StageLayers(0, 0, 2), StageLayers(1, 2, 2)], 2, 5, r"stage 1: layers 2\.\.3.*decode engine's 5 layers"),
    ([StageLayers(0, 0, 3), StageLayers(1, 2, 2)], 2, 4, r"do not tile"),
    ([StageLayers(0, 0, 2), StageLayers(1, 3, 1)], 2, 4, r"do not tile"),
    ([StageLayers(0, 2, 2), StageLayers(1, 0, 2)], 2, 4, r"in stage order"),
    ([StageLayers(0, 0, 2), StageLayers(0, 2, 2)], 2, 4, r"stages \[0, 0\] declared for pp_size=2"),
    ([StageLayers(0, 0, 4)], 2, 4, r"stages \[0\] declared for pp_size=2"),
    ([StageLayers(0, 0, 0), StageLayers(1, 0, 4)], 2, 4, r"do not tile"),
])
def test_stages_must_tile_the_decode_engines_layers_in_stage_order(stages, pp_size: int, layers: int,
                                                                   match: str | None) -> None:
    if match is None:
        assert check_stages(stages, pp_size, layers) is None
        return
    with pytest.raises(PairRefused, match=match):
        check_stages(stages, pp_size, layers)


@pytest.mark.parametrize(("names", "num_layers", "first"), [
    (["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], 2, 0),
    ([f"model.layers.{i}.self_attn.attn" for i in range(13, 26)], 13, 13),
    (["model.layers.7.attn"], 1, 7),
])
def test_a_stages_first_layer_is_read_from_its_layer_names(names: list[str], num_layers: int, first: int) -> None:
    assert first_layer_of(names, num_layers) == first


@pytest.mark.parametrize(("names", "num_layers", "match"), [
    (["model.layers.2.attn", "model.layers.4.attn"], 2, "not 2 consecutive model layers"),
    (["model.layers.3.attn", "model.layers.2.attn"], 2, "not 2 consecutive"),
    (["model.layers.2.attn", "model.layers.3.attn"], 3, "not 3 consecutive"),
    (["model.attn"], 1, "0 integer parts"),
    (["model.layers.2.experts.3.attn"], 1, "2 integer parts"),
])
def test_layer_names_that_do_not_place_a_stage_in_the_model_are_refused(names: list[str], num_layers: int,
                                                                        match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        first_layer_of(names, num_layers)


def _info(pp_rank: int, first: int, n: int, pp_size: int = 2, tp_rank: int = 0, tp_size: int = 1) -> AgentInfo:
    _, views = make_kv_caches("LBHNC", n, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill=0.0)
    _, desc = _describe(views, "LBHNC")
    return AgentInfo(engine_id="prefill", tp_rank=tp_rank, tp_size=tp_size, agent_name="a", agent_metadata=b"",
                     metadata_digest=b"", compat_hash="c", layout=msgspec.structs.replace(desc, first_layer=first),
                     pp_rank=pp_rank, pp_size=pp_size)


def test_a_stage_description_carries_its_first_layer_and_a_stage_with_ssm_state_is_refused() -> None:
    _, views = make_kv_caches("LBHNC", 2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, fill=0.0)
    _, desc = _describe(views, "LBHNC")
    names = ["model.layers.6.self_attn.attn", "model.layers.7.self_attn.attn"]
    assert stage_desc(desc, names).first_layer == 6
    assert stage_desc(desc, names) == msgspec.structs.replace(desc, first_layer=6)
    with pytest.raises(LayoutError, match="Mamba/SSM state"):
        stage_desc(desc, names, has_state=True)


def test_the_workers_a_pull_reads_must_be_the_stages_its_params_name() -> None:
    """Every TP rank of every stage; the params' pp_size; one layer range per stage; together the decode layers."""
    check_peer_stages([_info(0, 0, 2, tp_rank=0, tp_size=2), _info(0, 0, 2, tp_rank=1, tp_size=2),
                       _info(1, 2, 2, tp_rank=0, tp_size=2), _info(1, 2, 2, tp_rank=1, tp_size=2)], 2, LAYERS)
    check_peer_stages([_info(0, 0, 4, pp_size=1)], 1, LAYERS)
    with pytest.raises(PairRefused, match=r"pp_size=3, but prefill rank 0 of 'prefill' runs pp_size=2"):
        check_peer_stages([_info(0, 0, 2), _info(1, 2, 2)], 3, LAYERS)
    with pytest.raises(PairRefused, match=r"stage 1's ranks hold different layers \(2..3 and 1..3\)"):
        check_peer_stages([_info(0, 0, 2), _info(1, 2, 2, tp_rank=0, tp_size=2), _info(1, 1, 3, tp_rank=1,
                                                                                        tp_size=2)], 2, LAYERS)
    with pytest.raises(PairRefused, match="do not tile"):
        check_peer_stages([_info(0, 0, 2), _info(1, 2, 1)], 2, LAYERS)
    with pytest.raises(PairRefused, match=r"stages \[0\] declared for pp_size=2"):
        check_peer_stages([_info(0, 0, 2)], 2, LAYERS)
