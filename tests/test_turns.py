"""Multi-turn reuse, scheduler side (``keep_turns_s``): the decode engine keeps a finished request's blocks for the
conversation's next turn and answers with params naming them; the next turn's prefill engine loads them and
computes only the rest.

Driven with real vLLM ``Request`` and ``KVCacheBlocks`` objects, as vLLM's scheduler calls the hooks: turn 1's
decode leg loads from a prefill engine, generates, finishes; its params go with turn 2's prefill leg, whose prompt
extends turn 1's prompt and answer. Each guarantee of a capability holds for a kept turn: counted and capped with
every hold, one request per capability, bound to the tokens it stands for (an edited conversation loads nothing
and frees the kept blocks), leased for ``keep_turns_s``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from p2pkv.config import ConfigError, P2pKvConfig
from p2pkv.params import CAPABILITY_KEY, make_prefill_response_params
from p2pkv.prompt_digest import prompt_digest
from p2pkv.scheduler import SchedulerSide
from p2pkv.turns import TURN_LOADED_KEY, wants_turn_load

SECRET = "a-side-channel-secret-of-32-byte"
BLOCK = 16
PROMPT = 40
"""Turn 1's prompt (tokens)."""
ANSWER = 12
"""Tokens turn 1's decode leg generates."""
KEEP_S = 120.0


@contextlib.contextmanager
def engine(engine_id: str, num_blocks: int = 64, recompute_tokens: int = 0,
           **settings: object) -> Iterator[SchedulerSide]:
    """An engine's scheduler side (role both, turns kept ``KEEP_S`` unless ``settings`` say otherwise;
    ``recompute_tokens`` 1: a sliding-window or Mamba model's)."""
    config = P2pKvConfig(lease_s=30.0, secret=SECRET, role="both", **{"keep_turns_s": KEEP_S, **settings})
    sched = SchedulerSide(engine_id, config, BLOCK, "127.0.0.1", 5700 if engine_id == "decode" else 5600, 1,
                          role="both", num_blocks=num_blocks, recompute_tokens=recompute_tokens)
    try:
        yield sched
    finally:
        sched.shutdown()


def _request(rid: str, tokens: list[int], params: dict,
             output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=ANSWER, output_kind=output_kind), None)
    req.kv_transfer_params = params
    return req


def _blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _turn_one(decode: SchedulerSide, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED,
              output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> tuple[Request, bool, dict | None]:
    """Turn 1's decode leg on ``decode``: loads 40 prompt tokens from a prefill engine, generates 12, finishes."""
    prompt = list(range(100, 100 + PROMPT))
    loaded = make_prefill_response_params(
        engine_id="prefill", request_id="t1-prefill", host="127.0.0.1", port=5600, block_ids=[7, 8, 9], tp_size=1,
        num_tokens=PROMPT, expiry_time=time.time() + 30, prompt_digest=prompt_digest(prompt), secret=SECRET.encode())
    req = _request("t1", prompt, loaded, output_kind)
    decode.on_new_request(req)
    assert decode.get_num_new_matched_tokens(req, 0) == (PROMPT, True)
    decode.update_state_after_alloc(req, _blocks(1, 2, 3), PROMPT)
    req.append_output_token_ids(list(range(500, 500 + ANSWER)))
    req.num_computed_tokens = PROMPT + ANSWER - 1  # the last token sampled, not computed
    req.status = status
    hold, params = decode.request_finished(req, [1, 2, 3, 4])
    return req, hold, params


def test_a_finished_decode_leg_keeps_its_blocks_and_names_them_for_the_next_turn() -> None:
    """Kept: every block, counted with the engine's holds and leased ``keep_turns_s``; the params are vLLM's
    bidirectional flags with the blocks, the tokens computed (prompt and answer but the last sampled token) and
    their digest, signed; a router sending them with the next prefill leg makes it a turn load."""
    with engine("decode") as decode:
        req, hold, params = _turn_one(decode)
        assert hold and params is not None
        kept = PROMPT + ANSWER - 1
        assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)
        assert params["remote_block_ids"] == [[1, 2, 3, 4]] and params["remote_engine_id"] == "decode"
        assert params["remote_num_tokens"] == kept
        assert params["remote_prompt_digest"] == prompt_digest(list(req.all_token_ids[:kept]))
        assert params[CAPABILITY_KEY] and wants_turn_load(params)
        assert decode.prefill.held_blocks == 4
        meta = decode.build_connector_meta()
        assert meta.send_blocks == {"t1": (1, 2, 3, 4)}
        assert KEEP_S - 5 < meta.send_leases["t1"] - decode.prefill._clock() <= KEEP_S


def test_the_next_turns_prefill_loads_the_kept_tokens_computes_the_rest_then_holds_for_its_decode() -> None:
    with engine("decode") as decode, engine("prefill") as prefill:
        req, _, params = _turn_one(decode)
        kept = PROMPT + ANSWER - 1
        prompt = [*req.all_token_ids, *range(900, 920)]  # turn 1's prompt and answer, then the new message
        turn = _request("t2", prompt, dict(params))
        prefill.on_new_request(turn)
        assert prefill.get_num_new_matched_tokens(turn, 0) == (kept, True)
        prefill.update_state_after_alloc(turn, _blocks(11, 12, 13, 14, 15), kept)
        (spec,) = prefill.build_connector_meta().loads
        assert spec.remote.engine_id == "decode" and spec.remote.request_id == "t1"
        assert (spec.local_block_ids, spec.num_tokens, spec.first_token) == ((11, 12, 13, 14, 15), kept, 0)
        assert turn.kv_transfer_params[TURN_LOADED_KEY] and not wants_turn_load(turn.kv_transfer_params)
        assert prefill.get_num_new_matched_tokens(turn, kept) == (0, False)  # loaded once
        turn.append_output_token_ids([1])
        turn.num_computed_tokens = len(prompt)
        turn.status = RequestStatus.FINISHED_LENGTH_CAPPED
        hold, answer = prefill.request_finished(turn, [11, 12, 13, 14, 15])
        assert hold and answer is not None and answer["do_remote_prefill"] and answer["remote_engine_id"] == "prefill"
        assert answer["remote_num_tokens"] == len(prompt)


def test_a_window_or_mamba_models_turn_is_kept_as_it_is_and_loaded_to_its_last_kept_token() -> None:
    """A model whose decode engine computes the last prompt token itself (``recompute_tokens`` 1: sliding window,
    Mamba state) keeps its turn too: the blocks as vLLM left them (the null block behind the window) and the tokens
    computed, which the next turn's prefill loads whole, backing off nothing (vLLM freed the window for that very
    count, and a state block holds the state after it); that prefill leaves its own last prompt token to its decode
    engine as any prefill leg of such a model."""
    with engine("decode", recompute_tokens=1) as decode, engine("prefill", recompute_tokens=1) as prefill:
        prompt = list(range(100, 100 + PROMPT))
        loaded = make_prefill_response_params(
            engine_id="prefill", request_id="t1-prefill", host="127.0.0.1", port=5600, block_ids=[7, 8, 9],
            tp_size=1, num_tokens=PROMPT - 1, expiry_time=time.time() + 30,
            prompt_digest=prompt_digest(prompt[:-1]), secret=SECRET.encode())
        req = _request("t1", prompt, loaded)
        decode.on_new_request(req)
        assert decode.get_num_new_matched_tokens(req, 0) == (PROMPT - 1, True)
        decode.update_state_after_alloc(req, _blocks(1, 2, 3), PROMPT - 1)
        req.append_output_token_ids(list(range(500, 500 + ANSWER)))
        kept = PROMPT + ANSWER - 1
        req.num_computed_tokens = kept
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        hold, params = decode.request_finished(req, [0, 2, 3, 4])  # block 1 behind the window: vLLM's null block
        assert hold and params is not None and params["remote_block_ids"] == [[0, 2, 3, 4]]
        assert decode.prefill.held_blocks == 3  # the null block is no block of the pool's: not counted
        assert params["remote_num_tokens"] == kept
        new = [*req.all_token_ids, *range(900, 920)]
        turn = _request("t2", list(new), dict(params))
        prefill.on_new_request(turn)
        assert turn.num_prompt_tokens == len(new) - 1  # its last token left to its own decode engine
        assert prefill.get_num_new_matched_tokens(turn, 0) == (kept, True)


def test_a_prefix_cached_on_the_prefill_engine_loads_only_the_kept_tokens_after_it() -> None:
    with engine("decode") as decode, engine("prefill") as prefill:
        req, _, params = _turn_one(decode)
        kept = PROMPT + ANSWER - 1
        turn = _request("t2", [*req.all_token_ids, 7, 7], dict(params))
        assert prefill.get_num_new_matched_tokens(turn, 2 * BLOCK) == (kept - 2 * BLOCK, True)
        cached = [KVCacheBlock(20), KVCacheBlock(21)]
        for block in cached:
            block._block_hash = b"cached"  # type: ignore[assignment]  # a prefix-cache hit
        blocks = KVCacheBlocks(([*cached, KVCacheBlock(22), KVCacheBlock(23)],))
        prefill.update_state_after_alloc(turn, blocks, kept - 2 * BLOCK)
        (spec,) = prefill.build_connector_meta().loads
        assert (spec.local_block_ids, spec.first_token, spec.num_tokens) == ((22, 23), 2 * BLOCK, kept)


def test_a_kept_turn_serves_one_request_and_a_changed_conversation_loads_nothing_and_frees_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """The capability binds one request: a replay prefills locally. A conversation whose earlier message was
    edited (its first kept tokens differ), or a prompt that does not extend the kept tokens: nothing loaded, the
    request prefilled here, logged naming the key, and the decode engine told to free its kept blocks now."""
    with engine("decode") as decode, engine("prefill") as prefill:
        req, _, params = _turn_one(decode)
        tokens = list(req.all_token_ids)
        first = _request("t2", [*tokens, 1], dict(params))
        assert prefill.get_num_new_matched_tokens(first, 0)[1]
        replay = _request("t2-again", [*tokens, 1], dict(params))
        with caplog.at_level(logging.ERROR, logger="p2pkv"):
            assert prefill.get_num_new_matched_tokens(replay, 0) == (0, False)
        assert "already serves" in caplog.text or "replay" in caplog.text
        prefill.build_connector_meta()
    for change, why in (([*[1] * 5, *tokens[5:], 1], "does not match this request's first"),
                        (tokens[:-1], "a turn reuses kept tokens only for a prompt that extends them")):
        with engine("decode") as decode, engine("prefill") as prefill:
            _, _, params = _turn_one(decode)
            edited = _request("t2", change, dict(params))
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="p2pkv"):
                assert prefill.get_num_new_matched_tokens(edited, 0) == (0, False)
            assert why in caplog.text and "prefilling it locally" in caplog.text
            (release,) = prefill.build_connector_meta().loads
            assert (release.local_block_ids, release.report, release.remote.request_id) == ((), False, "t1")


def test_nothing_is_kept_for_an_aborted_or_streamed_request_past_the_cap_or_without_role_both() -> None:
    with engine("decode") as decode:
        _, hold, params = _turn_one(decode, RequestStatus.FINISHED_ABORTED)
        assert (hold, params, decode.prefill.held_blocks) == (False, None, 0)
    with engine("decode") as decode:  # a streamed answer's chunks carry no params: nobody could use them
        _, hold, params = _turn_one(decode, output_kind=RequestOutputKind.DELTA)
        assert (hold, params, decode.prefill.held_blocks) == (False, None, 0)
    with engine("decode", num_blocks=6) as decode:  # max_held_fraction 0.5: 3 blocks at most
        _, hold, params = _turn_one(decode)
        assert (hold, params, decode.prefill.held_blocks) == (False, None, 0)
    with engine("decode", keep_turns_s=0.0) as decode:  # off
        _, hold, params = _turn_one(decode)
        assert (hold, params) == (False, None)
    with pytest.raises(ConfigError, match="keep_turns_s=120 needs role both"):
        P2pKvConfig(role="decode", keep_turns_s=KEEP_S)
    with pytest.raises(ConfigError, match="max_lifetime_s=480"):
        P2pKvConfig(role="both", keep_turns_s=1000)
    with pytest.raises(ConfigError, match="role is decode"):
        SchedulerSide("d", P2pKvConfig(keep_turns_s=KEEP_S), BLOCK, "127.0.0.1", 5600, 1, role="decode")


def test_an_engine_that_loads_nothing_computes_a_kept_turns_prompt_itself(caplog: pytest.LogCaptureFixture) -> None:
    """A ``prefill`` engine builds no loader: a prefill leg naming a kept turn is computed there (never a load
    vLLM would wait on for ever), logged naming the fix; the decode engine's kept blocks wait for their lease."""
    with engine("decode") as decode:
        req, _, params = _turn_one(decode)
    sched = SchedulerSide("prefill", P2pKvConfig(lease_s=30.0, secret=SECRET), BLOCK, "127.0.0.1", 5600, 1,
                          role="prefill")
    try:
        turn = _request("t2", [*req.all_token_ids, 1], dict(params))
        with caplog.at_level(logging.WARNING, logger="p2pkv"):
            sched.on_new_request(turn)
            assert sched.get_num_new_matched_tokens(turn, 0) == (0, False)
        assert "role both" in caplog.text and not wants_turn_load(turn.kv_transfer_params)
        assert sched.build_connector_meta().loads == []
    finally:
        sched.shutdown()
