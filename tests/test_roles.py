"""Which engines hold blocks for a remote decode (``role``, ``max_held_fraction``): a decode engine holds nothing
for anyone, and no engine holds more than its cap, whoever sends ``do_remote_decode`` to its HTTP API. Driven as
vLLM's scheduler calls the connector, with vLLM's own ``Request``; the real engines' side is in
``tests/test_hostile.py``."""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from p2pkv.config import ConfigError, P2pKvConfig, engine_role, load_config
from p2pkv.scheduler import SchedulerSide
from p2pkv.scheduling.hold_scheduling import NO_HOLD_KEY

BLOCK = 16


def _sched(role: str = "both", num_blocks: int | None = None, fraction: float = 0.5) -> SchedulerSide:
    config = P2pKvConfig(lease_s=30.0, max_held_fraction=fraction)
    return SchedulerSide("engine", config, BLOCK, "127.0.0.1", 5600, 1, role=role, num_blocks=num_blocks)


def _finish(sched: SchedulerSide, rid: str, blocks: list[int]) -> tuple[bool, dict | None]:
    """A prefill leg of ``len(blocks)`` blocks, run to its end on ``sched``'s engine."""
    req = Request(rid, list(range(3, 3 + BLOCK * len(blocks))), SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {"do_remote_decode": True}
    sched.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return sched.request_finished_all_groups(req, (blocks,))


@pytest.mark.parametrize(("role", "kv_role", "expected", "warns"), [
    ("", "kv_producer", "prefill", False), ("", "kv_consumer", "decode", False), ("", "kv_both", "both", True),
    ("", None, "both", True), ("decode", "kv_both", "decode", False), ("prefill", "kv_both", "prefill", False),
    ("both", "kv_both", "both", False)])
def test_the_role_comes_from_the_setting_else_from_vllms_kv_role(role: str, kv_role: str | None, expected: str,
                                                                warns: bool) -> None:
    got, warning = engine_role(P2pKvConfig(role=role), kv_role)
    assert got == expected and bool(warning) == warns
    if warns:
        assert "any caller of its HTTP API can make it hold KV blocks" in warning and "role" in warning


def test_a_decode_engine_holds_nothing_and_says_why() -> None:
    sched = _sched("decode")
    hold, params = _finish(sched, "p-1", [5, 6, 7])
    assert not hold and params is not None and params["do_remote_prefill"] is False
    assert "this engine's role is decode" in params[NO_HOLD_KEY] and "role" in params[NO_HOLD_KEY]
    meta = sched.build_connector_meta()
    assert meta.send_leases == {} and meta.send_blocks == {} and sched.prefill.held_blocks == 0


def test_a_prefill_engine_holds() -> None:
    sched = _sched("prefill")
    hold, params = _finish(sched, "p-1", [5, 6, 7])
    assert hold and params is not None and params["remote_block_ids"] == [[5, 6, 7]]
    assert sched.build_connector_meta().send_blocks == {"p-1": (5, 6, 7)}


def test_past_the_cap_a_request_is_answered_without_a_hold_until_holds_end() -> None:
    """10 blocks, half may be held: 3 held, 3 more would pass 5 → no hold (answered at once, nothing queued);
    once the first hold ends (the workers report it sent) the next one is held."""
    sched = _sched("prefill", num_blocks=10, fraction=0.5)
    assert _finish(sched, "a", [1, 2, 3])[0]
    hold, params = _finish(sched, "b", [4, 5, 6])
    assert not hold and params is not None and "max_held_fraction=0.5 (5 blocks)" in params[NO_HOLD_KEY]
    assert _finish(sched, "c", [7, 8])[0]  # 3 + 2 = 5: at the cap, held
    assert sched.prefill.held_blocks == 5
    sched.on_sent({"a"})
    assert _finish(sched, "d", [4, 5, 6])[0] and sched.prefill.held_blocks == 5
    assert set(sched.build_connector_meta().send_blocks) == {"a", "c", "d"}


def test_the_cap_is_checked_as_a_share_of_the_cache() -> None:
    with pytest.raises(ConfigError, match="max_held_fraction"):
        load_config({"max_held_fraction": 0.0}, environ={})
    with pytest.raises(ConfigError, match="max_held_fraction"):
        load_config({"max_held_fraction": 1.5}, environ={})
    with pytest.raises(ConfigError):
        load_config({"role": "leader"}, environ={})
    assert load_config({}, environ={"P2PKV_ROLE": "decode"}).role == "decode"
