"""The decode scheduler checks a request's params once and keeps the outcome (``DecodeLoad``) until allocation.

vLLM asks ``get_num_new_matched_tokens`` (the load is promised: the request
waits for it) and later calls ``update_state_after_alloc``. A capability that
expired in between once made the second call refuse the params silently: no
pull and no failure, so vLLM waited on the request for ever. Driven here with
plain request objects, as vLLM's scheduler calls the hooks; the params'
clock is moved between the calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

import p2pkv.params as params_module
import p2pkv.scheduling.load_scheduling as scheduler_module
from p2pkv.config import P2pKvConfig, Role
from p2pkv.grant import ANY_DECODE, GRANT_KEY, make_stream_grant
from p2pkv.params import (
    CLOCK_SKEW_S,
    KVTransferParamsError,
    RemotePrefill,
    make_prefill_response_params,
    sign_params,
)
from p2pkv.scheduler import SchedulerSide
from p2pkv.scheduling.load import DecodeLoad

SECRET = "a-side-channel-secret-of-32-byte"
NOW = 1_800_000_000.0
EXPIRY = NOW + 10
PROMPT = 10
BLOCKS = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],), get_unhashed_block_ids_all_groups=lambda: [[6, 7]])


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The time the params' capability is checked at (seconds since the Unix epoch), settable; and how often
    the scheduler parsed params with the secret, checking their capability's HMAC (``clock[1]``)."""
    now = [NOW, 0]
    real_parse = scheduler_module.parse_remote_prefill

    def parse_remote_prefill(params, *, secret, **kwargs):  # type: ignore[no-untyped-def]
        now[1] += bool(secret)
        return real_parse(params, secret=secret, **kwargs)

    monkeypatch.setattr(params_module, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(scheduler_module, "parse_remote_prefill", parse_remote_prefill)
    return now


@contextlib.contextmanager
def scheduler(role: Role = "both") -> Iterator[SchedulerSide]:
    """A decode engine's scheduler side (blocks of 4 tokens; ``role`` as its config says), shut down on exit."""
    config = P2pKvConfig(lease_s=30.0, secret=SECRET)
    sched = SchedulerSide("decode-engine", config, 4, "127.0.0.1", 5600, 1, role=role)
    try:
        yield sched
    finally:
        sched.shutdown()


def _request(rid: str, prompt: int = PROMPT) -> SimpleNamespace:
    params = make_prefill_response_params(engine_id="prefill-engine", request_id=f"prefill-{rid}",
                                          host="127.0.0.1", port=5601, block_ids=[1, 2, 3], tp_size=1,
                                          num_tokens=PROMPT, expiry_time=EXPIRY)
    return SimpleNamespace(request_id=rid, kv_transfer_params=sign_params(params, SECRET.encode(), EXPIRY),
                           prompt_token_ids=[0] * prompt)


@pytest.mark.parametrize("announced", [False, True], ids=["parsed_when_asked", "parsed_on_arrival"])
def test_a_capability_expiring_between_the_match_and_the_allocation_still_pulls(
        clock: list[float], announced: bool) -> None:
    """Checked once (one HMAC check for the request), kept, and used as it is after the capability expired.
    Before: the second call checked again, refused, and recorded neither a pull nor a failure."""
    with scheduler() as sched:
        req = _request("r")
        if announced:  # parsed for lease heartbeats on arrival
            sched.on_new_request(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (PROMPT, True)
        assert sched.get_num_new_matched_tokens(req, 4) == (PROMPT - 4, True)  # asked again: no blocks yet
        clock[0] = EXPIRY + CLOCK_SKEW_S + 1
        sched.update_state_after_alloc(req, BLOCKS, PROMPT - 4)
        meta = sched.build_connector_meta()
        assert [(p.request_id, p.local_block_ids, p.remote_block_ids, p.remote.request_id, p.num_tokens, p.report)
                for p in meta.loads] == [("r", (6, 7), (1, 2, 3), "prefill-r", PROMPT, True)]
        assert meta.failed == {}
        assert clock[1] == 1, f"the capability's HMAC was checked {clock[1]} times"
        assert sched.decode._loads == {}


@pytest.mark.parametrize("announced", [False, True], ids=["asked_first", "arrived_first"])
def test_a_prefill_engine_computes_a_prompt_it_is_asked_to_load_and_says_so_once(
        clock: list[float], announced: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A ``prefill`` engine loads nothing (its workers build no Receiver): params that would make a ``both``
    engine pull (the first test) are computed here instead, with no load, no heartbeat and no failure, and
    the first such request is logged naming the fix."""
    with caplog.at_level(logging.WARNING, logger="p2pkv.scheduler"), scheduler("prefill") as sched:
        for rid in ("r-1", "r-2"):
            req = _request(rid)
            if announced:
                sched.on_new_request(req)
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            assert req.kv_transfer_params["do_remote_prefill"] is False
            sched.update_state_after_alloc(req, BLOCKS, 0)
            meta = sched.build_connector_meta()
            assert (meta.loads, meta.failed) == ([], {})
            assert sched.decode._queued == {} and sched.decode._loads == {}
            assert sched.request_finished(req, [5, 6, 7]) == (False, None)
        assert clock[1] == 0, "a prefill engine checked a load's capability"
    said = [r.getMessage() for r in caplog.records if "asks this prefill engine" in r.getMessage()]
    assert len(said) == 1 and "role decode or both" in said[0]


def test_params_already_expired_when_first_asked_are_prefilled_locally(clock: list[float]) -> None:
    with scheduler() as sched:
        req = _request("late")
        clock[0] = EXPIRY + CLOCK_SKEW_S + 1
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert req.kv_transfer_params["do_remote_prefill"] is False
        sched.update_state_after_alloc(req, BLOCKS, 0)
        meta = sched.build_connector_meta()
        assert meta.loads == [] and meta.failed == {} and sched.decode._loads == {}


def test_an_allocation_without_a_checked_load_reports_its_blocks_failed(clock: list[float]) -> None:
    """No kept load at allocation (vLLM asked nothing first): the blocks reach vLLM as load errors, not silence."""
    with scheduler() as sched:
        req = _request("unasked")
        sched.update_state_after_alloc(req, BLOCKS, PROMPT)
        meta = sched.build_connector_meta()
        assert meta.loads == [] and meta.failed == {"unasked": (6, 7)}
        assert req.kv_transfer_params["do_remote_prefill"] is False


@pytest.mark.parametrize("announced", [False, True], ids=["parsed_when_asked", "parsed_on_arrival"])
def test_the_kept_load_is_dropped_when_the_request_finishes_or_is_aborted(
        clock: list[float], announced: bool) -> None:
    """Aborted after the match (its capability expired since): the prefill engine is still told to free the
    hold, from the kept load; finished after its pull: nothing kept either. Nothing stays behind."""
    with scheduler() as sched:
        aborted, pulled = _request("aborted"), _request("pulled")
        for req in (aborted, pulled):
            if announced:
                sched.on_new_request(req)
            assert sched.get_num_new_matched_tokens(req, 0) == (PROMPT, True)
        assert set(sched.decode._loads) == {"aborted", "pulled"}
        clock[0] = EXPIRY + CLOCK_SKEW_S + 1
        assert sched.request_finished(aborted, []) == (False, None)
        sched.update_state_after_alloc(pulled, BLOCKS, PROMPT)
        assert sched.request_finished(pulled, [6, 7]) == (False, None)
        assert sched.decode._loads == {} and sched.decode._queued == {}
        meta = sched.build_connector_meta()
        assert [(p.request_id, p.local_block_ids, p.remote.request_id, p.report) for p in meta.loads] == [
            ("aborted", (), "prefill-aborted", False), ("pulled", (6, 7), "prefill-pulled", True)]
        assert clock[1] == 2, "each request's capability is checked once"


def _stream_leg(rid: str) -> SimpleNamespace:
    """A decode leg as the proxy sends it in stream mode (no prefill answer yet: a grant instead of blocks)."""
    grant = make_stream_grant("prefill-engine", ANY_DECODE, SECRET.encode(), time.time() + 60)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
              "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1, GRANT_KEY: grant}
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(PROMPT)))


def test_a_streamed_load_whose_request_ends_is_named_to_the_workers_once(clock: list[float]) -> None:
    """A request aborted while its stream runs (vLLM calls request_finished, the load still under way): the
    workers are told at the next step, so they stop the stream instead of letting the prefill WRITE on."""
    with scheduler() as sched:
        streamed, cached = _stream_leg("streamed"), _stream_leg("cached")
        for req in (streamed, cached):
            assert sched.get_num_new_matched_tokens(req, 0) == (PROMPT - 1, True)
        sched.update_state_after_alloc(streamed, BLOCKS, PROMPT - 1)
        sched.update_state_after_alloc(cached, BLOCKS, 0)  # all in the prefix cache: declined, nothing streams
        meta = sched.build_connector_meta()
        assert [(p.request_id, p.local_block_ids, p.report, bool(p.stream_grant)) for p in meta.loads] == [
            ("streamed", (6, 7), True, True), ("cached", (), False, True)]
        assert meta.ended_streams == []
        sched.request_finished(streamed, [6, 7])
        sched.request_finished(cached, [6, 7])
        assert sched.build_connector_meta().ended_streams == ["streamed"]
        assert sched.build_connector_meta().ended_streams == []


def test_a_refused_request_keeps_nothing(clock: list[float]) -> None:
    with scheduler() as sched:
        req = _request("other-prompt", prompt=PROMPT - 1)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.decode._loads == {}


def test_params_of_another_group_count_are_refused_before_the_mac(clock: list[float],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler gives parse_remote_prefill its KV cache group count: params of two groups on this one-group
    engine are refused (DecodeLoad.of's message) before any MAC is computed, and prefilled locally."""
    def no_mac(*_: object) -> str:
        raise AssertionError("the MAC was computed before the group count was compared")

    params = make_prefill_response_params(engine_id="prefill-engine", request_id="prefill-g", host="127.0.0.1",
                                          port=5601, block_ids=[1, 2, 3, 4], group_sizes=[2, 2], tp_size=1,
                                          num_tokens=PROMPT, expiry_time=EXPIRY, secret=SECRET.encode())
    monkeypatch.setattr(params_module, "_fields_mac", no_mac)
    monkeypatch.setattr(params_module, "capability_mac", no_mac)
    with scheduler() as sched:
        req = SimpleNamespace(request_id="g", kv_transfer_params=params, prompt_token_ids=[0] * PROMPT)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert req.kv_transfer_params["do_remote_prefill"] is False and sched.decode._loads == {}
    assert "remote_block_ids has 2 KV cache group(s), this engine has 1" in caplog.text


def test_the_scheduler_refuses_expiries_past_its_own_max_lifetime(clock: list[float],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An engine accepts capabilities and grants at most 4 x lease_s (+ skew) ahead of its clock, never less than
    4 default leases (480 s: a short lease_s must not refuse the proxy's 120 s grants); with lease_s 300,
    1200 s."""
    assert P2pKvConfig(lease_s=15.0).max_lifetime_s == 480.0 and P2pKvConfig(lease_s=300.0).max_lifetime_s == 1200.0
    ahead = NOW + 480 + CLOCK_SKEW_S + 1
    params = make_prefill_response_params(engine_id="prefill-engine", request_id="prefill-far", host="127.0.0.1",
                                          port=5601, block_ids=[1, 2, 3], tp_size=1, num_tokens=PROMPT,
                                          expiry_time=ahead, secret=SECRET.encode())
    far = SimpleNamespace(request_id="far", kv_transfer_params=params, prompt_token_ids=[0] * PROMPT)
    stream = _stream_leg("far-stream")
    grant = make_stream_grant("prefill-engine", ANY_DECODE, SECRET.encode(), time.time() + 480 + CLOCK_SKEW_S + 2)
    stream.kv_transfer_params[GRANT_KEY] = grant
    with scheduler() as sched:  # lease_s 30
        assert sched.get_num_new_matched_tokens(far, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(stream, 0) == (0, False)
        assert stream.kv_transfer_params["do_remote_prefill"] is False
    assert "p2pkv_capability expires 486 s from now, more than the 480 s" in caplog.text
    assert "p2pkv_stream_grant expires" in caplog.text
    clock[1] = 0
    far.kv_transfer_params = {**params, "do_remote_prefill": True}
    config = P2pKvConfig(lease_s=300.0, secret=SECRET)  # 1200 s ahead accepted
    sched = SchedulerSide("decode-engine", config, 4, "127.0.0.1", 5600, 1)
    try:
        assert sched.get_num_new_matched_tokens(far, 0) == (PROMPT, True)
    finally:
        sched.shutdown()


def _remote(**kw: object) -> RemotePrefill:
    args: dict = {"engine_id": "p", "request_id": "r", "host": "h", "port": 1, "block_ids": (1, 2, 3), "tp_size": 1}
    args.update(kw)
    return RemotePrefill(**args)  # type: ignore[arg-type]


def test_decode_load_counts_tokens() -> None:
    """prompt_tokens: the request's prompt less the appended tokens; loaded_tokens: less ``recompute_tokens``."""
    assert DecodeLoad.of(_remote(num_tokens=10), range(10), 0, 1) == DecodeLoad(_remote(num_tokens=10), 10, 10)
    assert DecodeLoad.of(_remote(num_tokens=9, appended_tokens=1), range(11), 1, 1) == \
        DecodeLoad(_remote(num_tokens=9, appended_tokens=1), 10, 9)
    assert DecodeLoad.of(_remote(), range(1), 1, 1).loaded_tokens == 1  # a one-token prompt is loaded whole
    with pytest.raises(KVTransferParamsError, match="appended_tokens"):
        DecodeLoad.of(_remote(appended_tokens=3), range(3), 0, 1)
    with pytest.raises(KVTransferParamsError, match="remote_num_tokens=10 but the prefill prompt has 9"):
        DecodeLoad.of(_remote(num_tokens=10), range(9), 0, 1)
    with pytest.raises(KVTransferParamsError, match="computes all but the last 1"):
        DecodeLoad.of(_remote(num_tokens=10), range(10), 1, 1)
    with pytest.raises(KVTransferParamsError, match="1 KV cache group"):
        DecodeLoad.of(_remote(), range(10), 0, 2)
    with pytest.raises(ValueError, match="loaded_tokens"):
        DecodeLoad(_remote(), 3, 4)


def test_params_replayed_to_a_second_request_are_refused_and_prefilled_here(clock: list[float]) -> None:
    """Whoever saw the proxy → engine hop holds the params: sent again with the same prompt, they used to pull
    the hold a second time (and the first "done" then failed the honest pull's fence). A capability serves one
    request on this engine: the replay is refused before anything is allocated, and computed here."""
    with scheduler() as sched:
        honest = _request("honest")
        replay = SimpleNamespace(request_id="replay", kv_transfer_params=dict(honest.kv_transfer_params),
                                 prompt_token_ids=list(honest.prompt_token_ids))
        assert sched.get_num_new_matched_tokens(honest, 0) == (PROMPT, True)
        assert sched.get_num_new_matched_tokens(replay, 0) == (0, False)
        assert replay.kv_transfer_params["do_remote_prefill"] is False
        assert sched.get_num_new_matched_tokens(honest, 0) == (PROMPT, True), "the honest load is kept"
        sched.update_state_after_alloc(honest, BLOCKS, PROMPT)
        assert [p.request_id for p in sched.build_connector_meta().loads] == ["honest"]


def test_a_replayed_stream_grant_is_refused_without_declining_the_honest_stream(clock: list[float]) -> None:
    """A decline is a release of the stream id from this decode rank, which would stop the stream the grant
    serves: the replay is refused (and computed here) and nothing is sent for it."""
    with scheduler() as sched:
        honest = _stream_leg("honest")
        replay = SimpleNamespace(request_id="replay", kv_transfer_params=dict(honest.kv_transfer_params),
                                 prompt_token_ids=list(honest.prompt_token_ids))
        assert sched.get_num_new_matched_tokens(honest, 0) == (PROMPT - 1, True)
        assert sched.get_num_new_matched_tokens(replay, 0) == (0, False)
        sched.request_finished(replay, [])
        assert sched.build_connector_meta().loads == [], "the replay declined the honest stream"
