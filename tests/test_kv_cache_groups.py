"""Several KV cache groups (vLLM's hybrid KV cache manager, HMA): the connector's scheduler side with real vLLM objects.

A model whose layers mix full and sliding-window attention keeps one KV cache
group per attention type; a request has a block list per group, and a
sliding-window group's blocks behind the window are vLLM's null block (id 0).
A hybrid attention + Mamba model adds a state group (one block per request).
The end-to-end pairs run in ``tests/test_e2e_models.py`` (kinds ``interleaved-window``, ``hybrid``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from p2pkv.config import P2pKvConfig
from p2pkv.connector import P2pKvConnector
from p2pkv.dataplane.negotiate import ModelInfo, PairRefused, Placement, plan_peer
from p2pkv.engine_facts import (
    UnsupportedKVCacheError,
    check_kv_cache_supported,
    has_state_groups,
    recompute_tokens,
    state_layer_names,
)
from p2pkv.scheduler import SchedulerSide
from tests.workers import one_layer_desc

BLOCK = 16


def _sched(kv_groups: int = 2) -> SchedulerSide:
    config = P2pKvConfig(lease_s=30.0)
    return SchedulerSide("engine", config, BLOCK, "127.0.0.1", 5600, 1, recompute_tokens=1, kv_groups=kv_groups)


def _request(rid: str, prompt: int, params: dict) -> Request:
    req = Request(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=16), None)
    req.kv_transfer_params = params
    return req


def _finished_prefill(sched: SchedulerSide, block_ids: tuple[list[int], ...]) -> dict:
    req = _request("p", 100, {"do_remote_decode": True})
    sched.on_new_request(req)  # the last prompt token is left to the decode engine: 99 tokens
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, params = sched.request_finished_all_groups(req, block_ids)
    assert hold and params is not None
    return params


def test_the_connector_declares_hma_support() -> None:
    """vLLM keeps its hybrid KV cache manager on for p2pkv engines (no "Turning off hybrid kv cache manager")."""
    assert supports_hma(P2pKvConnector)


def test_prefill_holds_every_group_and_sends_a_list_per_group() -> None:
    """99 tokens in 7 blocks of 16 per group; the window group (40 tokens) has its first 3 blocks freed."""
    sched = _sched()
    full, window = list(range(10, 17)), [0, 0, 0, 30, 31, 32, 33]
    params = _finished_prefill(sched, (full, window))
    assert params["remote_block_ids"] == [full, window] and params["remote_num_tokens"] == 99
    meta = sched.build_connector_meta()
    assert meta.send_blocks["p"] == (*full, *window)  # what the fence checks a pull against
    sched.shutdown()


def test_decode_pairs_each_group_and_skips_the_window_groups_freed_blocks() -> None:
    """Decode has the prompt's first block cached (hashed) in both groups; the window group reads 4 blocks only."""
    sched = _sched()
    remote = ([*range(10, 17)], [0, 0, 0, 30, 31, 32, 33])
    params = _finished_prefill(sched, remote)
    sched.build_connector_meta()
    req = _request("d", 100, params)
    assert sched.get_num_new_matched_tokens(req, BLOCK) == (99 - BLOCK, True)
    cached = [KVCacheBlock(40), KVCacheBlock(41)]
    for i, b in enumerate(cached):
        b._block_hash = make_block_hash_with_group_id(b"h", i)
    full = [cached[0], *(KVCacheBlock(i) for i in range(50, 57))]  # 8 blocks: the 100th token needs one more
    window = [cached[1], *(KVCacheBlock(i) for i in range(60, 67))]
    sched.update_state_after_alloc(req, KVCacheBlocks((full, window)), 99 - BLOCK)
    (spec,) = sched.build_connector_meta().loads
    assert spec.num_tokens == -1 and spec.first_token == 0  # the lists pair block for block
    assert spec.local_block_ids == (50, 51, 52, 53, 54, 55, 62, 63, 64, 65)
    assert spec.remote_block_ids == (11, 12, 13, 14, 15, 16, 30, 31, 32, 33)
    assert spec.remote.groups() == tuple(tuple(g) for g in remote)
    sched.shutdown()


def test_params_with_another_group_count_are_refused_and_prefilled_locally(caplog) -> None:
    """Prefill with HMA (2 groups), decode without it (1 group): no pull, a log line naming both counts and the fix."""
    prefill = _sched(2)
    params = _finished_prefill(prefill, ([*range(10, 17)], [0, 0, 0, 30, 31, 32, 33]))
    decode = _sched(1)
    req = _request("d", 100, params)
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert "has 2 KV cache group(s), this engine has 1" in caplog.text
    assert "--disable-hybrid-kv-cache-manager" in caplog.text
    prefill.shutdown()
    decode.shutdown()


def test_a_failed_set_up_marks_every_groups_blocks() -> None:
    sched = _sched()
    req = _request("d", 100, {"do_remote_prefill": True})
    blocks = KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6)], [KVCacheBlock(0, is_null=True), KVCacheBlock(7)]))
    sched.fail_load(req, blocks, 99)
    assert sched.build_connector_meta().failed == {"d": (5, 6, 7)}
    sched.shutdown()


def test_groups_need_one_block_size_on_both_sides() -> None:
    groups = ModelInfo("LBHNC", "float32", 2, 16, 16, local_attention=True, kv_groups=2)
    assert plan_peer(one_layer_desc(16), 0, 1, one_layer_desc(16), 0, 1, groups).placement is Placement.DIRECT
    for local, remote in ((16, 32), (32, 16)):
        with pytest.raises(PairRefused, match=f"prefill block_size={remote}, decode block_size={local}; start both "
                                              "engines with the same --block-size"):
            plan_peer(one_layer_desc(local), 0, 1, one_layer_desc(remote), 0, 1, groups)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def _specs(mamba_cache_mode: str = "none"):
    import torch

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32,
                               sliding_window=40)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64), (8, 16, 16)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode=mamba_cache_mode)
    return full, window, mamba


def test_a_hybrid_attention_and_mamba_cache_is_moved() -> None:
    """Attention + Mamba (Granite-4, Jamba): started; the decode engine computes the last prompt token."""
    full, window, mamba = _specs()
    check_kv_cache_supported(_config(full, window))
    check_kv_cache_supported(None)
    check_kv_cache_supported(_config(full, mamba))
    assert has_state_groups(_config(full, mamba)) and not has_state_groups(_config(full, window))
    assert recompute_tokens(_config(full, mamba)) == recompute_tokens(_config(window)) == 1
    assert recompute_tokens(_config(full)) == recompute_tokens(None) == 0
    assert state_layer_names(_config(full, mamba)) == {"layer.1"} and not state_layer_names(_config(full, window))


@pytest.mark.parametrize(("specs", "message"), [
    ("mamba", "KV cache group 0 is MambaSpec and the model has no attention layers"),
    ("full+align", "mamba_cache_mode='align': p2pkv moves one SSM state per request; start both engines with "
                   "--no-enable-prefix-caching"),
])
def test_a_mamba_group_p2pkv_cannot_move_is_refused_at_engine_start(specs, message) -> None:
    """A pure SSM model, or Mamba prefix caching (a state per block): a clear error at start, not wrong KV."""
    full, _, mamba = _specs("align" if "align" in specs else "none")
    config = _config(mamba) if specs == "mamba" else _config(full, mamba)
    with pytest.raises(UnsupportedKVCacheError, match=re.escape(message)):
        check_kv_cache_supported(config)


def test_a_hybrid_model_pulls_only_direct() -> None:
    """Mamba state pages move whole: another block size or page order is refused, naming the difference."""
    hybrid = ModelInfo("LBHNC", "float32", 2, 16, 16, kv_groups=2, state_groups=True)
    assert plan_peer(one_layer_desc(16), 0, 1, one_layer_desc(16), 0, 1, hybrid).placement is Placement.DIRECT
    same_size = ModelInfo("LBHNC", "float32", 2, 16, 16, state_groups=True)
    with pytest.raises(PairRefused, match="Mamba/SSM state, whose pages p2pkv moves whole, but the engines differ in "
                                          "block_size 32→16"):
        plan_peer(one_layer_desc(16), 0, 1, one_layer_desc(32), 0, 1, same_size)


def test_a_load_restores_every_transfer_group_so_vllm_zeroes_none_of_them() -> None:
    """vLLM zeroes a loading request's new blocks in the groups the connector does not name as restored; its
    base names only the prefix-cacheable ones, which leaves out a spec that is not (``CircularBufferSpec``) and
    would zero its loaded blocks. p2pkv moves the request's own blocks of every group, and names them all."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    full, window, _ = _specs()
    ring = CircularBufferSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    connector = SimpleNamespace(_kv_cache_config=_config(full, ring, window))
    request = _request("r", 40, {})
    assert KVConnectorBase_V1.get_loaded_kv_cache_group_ids(connector, request) == (0, 2)  # the base's
    assert P2pKvConnector.get_loaded_kv_cache_group_ids(connector, request) == (0, 1, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("model", "by_request"), [
    (ModelInfo("LBHNC", "float32", 2, 16, 16), False),
    (ModelInfo("LBHNC", "float32", 2, 16, 16, local_attention=True), True),
    (ModelInfo("LBHNC", "float32", 2, 16, 16, kv_groups=2), True),
])
def test_a_failed_load_is_told_to_vllm_by_request_where_blocks_cannot_say_it(model: ModelInfo,
                                                                             by_request: bool) -> None:
    """vLLM recomputes a block-level load failure from the first failed block on, with the KV before it: right for a
    load from the prompt's first token, wrong behind an attention window (the load starts later), refused with
    several KV cache groups. There a failed load goes as the request (``failed_recving``: the whole prompt is
    recomputed), and no block id; elsewhere as its blocks."""
    class Worker:
        def __init__(self) -> None:
            self.model = model
            self.receiver = SimpleNamespace(take_load_errors=lambda: {4, 5})

        def get_finished(self) -> tuple[set[str], set[str]]:
            return set(), {"req-1"}

        def take_failed(self) -> set[str]:
            return {"req-1"}

    from p2pkv.worker import WorkerSide

    connector = P2pKvConnector.__new__(P2pKvConnector)
    connector.worker = Worker()  # type: ignore[assignment]
    results = connector.get_transfer_results(set())
    assert results.finished_recving == {"req-1"}
    assert results.failed_recving == ({"req-1"} if by_request else set())
    blocks = WorkerSide.get_block_ids_with_load_errors(connector.worker)  # type: ignore[arg-type]
    assert blocks == (set() if by_request else {4, 5})
