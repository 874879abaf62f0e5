"""Models whose KV cache frees blocks behind an attention window (sliding window, chunked local attention).

vLLM replaces a request's blocks outside the window with its null block
(id 0) and computes the window from the tokens computed so far, also just
before ``request_finished``. p2pkv therefore has the prefill engine compute
all but the last prompt token, the decode engine load those and skip its
null blocks, and refuses a decode block larger than the prefill block.
Real vLLM ``Request``, ``KVCacheBlock`` and KV cache spec objects; the end
to end run is in ``test_e2e_models.py``.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request, RequestStatus

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import ModelInfo, PairRefused, Placement, plan_peer
from p2pkv.engine_facts import frees_blocks_behind_window
from p2pkv.params import make_prefill_response_params
from p2pkv.scheduler import SchedulerSide
from tests.workers import one_layer_desc

BLOCK = 16


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)


def _window() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=40)


def test_which_caches_free_blocks_behind_a_window() -> None:
    assert frees_blocks_behind_window(_config(_window()))
    assert frees_blocks_behind_window(_config(UniformTypeKVCacheSpecs(BLOCK, {"a": _window(), "b": _window()})))
    assert not frees_blocks_behind_window(_config(_full()))
    assert not frees_blocks_behind_window(None)


def _sched(recompute: int) -> SchedulerSide:
    config = P2pKvConfig(lease_s=30.0)
    return SchedulerSide("engine", config, BLOCK, "127.0.0.1", 5600, 1, recompute_tokens=recompute)


def _request(rid: str, prompt: int, params: dict, **sampling) -> Request:
    sp = SamplingParams(max_tokens=16, **sampling)
    req = Request(rid, list(range(3, 3 + prompt)), sp, None)
    req.kv_transfer_params = params
    return req


def test_prefill_engine_leaves_the_last_prompt_token_to_the_decode_engine() -> None:
    sched = _sched(1)
    req = _request("p", 100, {"do_remote_decode": True})
    sched.on_new_request(req)
    assert (len(req.prompt_token_ids), req.num_prompt_tokens, req.num_tokens, req.max_tokens) == (99, 99, 99, 1)
    plain = _request("plain", 100, {})  # not prefilled for a decode engine: untouched
    sched.on_new_request(plain)
    assert (plain.num_prompt_tokens, plain.max_tokens) == (100, 16)
    logprobs = _request("lp", 100, {"do_remote_decode": True}, prompt_logprobs=1)  # skips the prefix cache
    sched.on_new_request(logprobs)
    assert logprobs.num_prompt_tokens == 100
    full = _request("f", 100, {"do_remote_decode": True})
    _sched(0).on_new_request(full)  # a model without a window: the whole prompt
    assert full.num_prompt_tokens == 100
    sched.shutdown()


def _params(num_tokens: int, blocks: int) -> dict:
    return make_prefill_response_params(engine_id="p", request_id="prefill-1", host="127.0.0.1", port=5601,
                                        block_ids=[0, 0, *range(20, 20 + blocks - 2)], tp_size=1,
                                        num_tokens=num_tokens, expiry_time=None)


def test_decode_engine_loads_all_but_the_last_token_and_skips_null_blocks() -> None:
    """100-token prompt, window 40: the decode engine loads 99 tokens; vLLM left its first 3 blocks null."""
    sched = _sched(1)
    req = _request("d", 100, _params(99, 7))
    assert sched.get_num_new_matched_tokens(req, 0) == (99, True)
    null = KVCacheBlock(0, is_null=True)
    blocks = KVCacheBlocks(([null, null, null] + [KVCacheBlock(i) for i in (5, 6, 7, 8)],))
    sched.update_state_after_alloc(req, blocks, 99)
    (spec,) = sched.build_connector_meta().loads
    assert spec.local_block_ids == (5, 6, 7, 8)  # block 0 (vLLM's null block) is never written
    assert (spec.first_token, spec.num_tokens) == (3 * BLOCK, 99)
    assert spec.remote_block_ids == (0, 0, 20, 21, 22, 23, 24)  # read from token 48 on: block 22 onwards
    sched.shutdown()


def test_decode_engine_refuses_params_of_a_whole_prompt() -> None:
    """A prefill engine that computed all 100 tokens may have freed a block the last one needs: not pulled."""
    sched = _sched(1)
    req = _request("d", 100, _params(100, 7))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # prefilled locally instead
    sched.shutdown()


_WINDOW_MODEL = ModelInfo("LBHNC", "float32", 2, 16, 32, local_attention=True)


def test_a_decode_block_larger_than_the_prefill_block_is_refused_with_the_fix() -> None:
    with pytest.raises(PairRefused, match="start the decode engine with --block-size 16 or smaller"):
        plan_peer(one_layer_desc(32), 0, 1, one_layer_desc(16), 0, 1, _WINDOW_MODEL)
    assert plan_peer(one_layer_desc(16), 0, 1, one_layer_desc(32), 0, 1, _WINDOW_MODEL).placement is Placement.STAGED
    full_attention = plan_peer(one_layer_desc(32), 0, 1, one_layer_desc(16), 0, 1)
    assert full_attention.placement is Placement.STAGED  # a model without a window: fine


def test_appended_tokens_are_computed_by_the_decode_engine() -> None:
    """The proxy appended the prefill's first token: 101-token prompt, params of 100 (no window) or 99 (window)."""
    full = _sched(0)
    req = _request("a", 101, {**_params(100, 7), "appended_tokens": 1})
    assert full.get_num_new_matched_tokens(req, 0) == (100, True)
    full.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in range(5, 12)],)), 100)
    (spec,) = full.build_connector_meta().loads
    assert spec.num_tokens == 100
    window = _sched(1)
    assert window.get_num_new_matched_tokens(_request("w", 101, {**_params(99, 7), "appended_tokens": 1}), 0) \
        == (99, True)
    without = _request("n", 101, _params(100, 7))  # the same params without appended_tokens: another prompt
    assert full.get_num_new_matched_tokens(without, 0) == (0, False)
    too_many = _request("t", 3, {**_params(100, 7), "appended_tokens": 3})
    assert full.get_num_new_matched_tokens(too_many, 0) == (0, False)
    assert too_many.kv_transfer_params["do_remote_prefill"] is False
    full.shutdown()
    window.shutdown()


def test_params_say_whether_the_sampled_token_is_the_first_output_token() -> None:
    for recompute, expected in ((0, True), (1, False)):
        sched = _sched(recompute)
        req = _request("p", 40, {"do_remote_decode": True})
        sched.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = sched.request_finished_all_groups(req, ([1, 2, 3],))
        assert params is not None and params["first_token"] is expected
        sched.shutdown()
