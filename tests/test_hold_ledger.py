"""One ledger for every hold, and one request per grant, on a prefill engine's scheduler side.

Driven as vLLM's scheduler calls the connector, with vLLM's own ``Request``: pulls and pushes hold when their
request finishes, a layer stream from its request's arrival, all against one ``max_held_fraction``; a grant's
stream id serves the first request that names it for the grant's whole life (a replay of it, after the first
request finished too, gets no stream and no hold), on an engine without pipeline stages and on one with two
(its one scheduler counts a request's blocks once for every stage's workers). The property test at the end
drives random interleavings of every way with replays, aborts, client departures, lease expiry and engine
restarts through the scheduler side and the workers' holds, and checks the cap and the leases after every step.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from p2pkv.bindings import Bindings
from p2pkv.config import P2pKvConfig
from p2pkv.grant import ANY_DECODE, GRANT_KEY, STREAMED_KEY, make_stream_grant
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.scheduler import SchedulerSide
from p2pkv.scheduling.hold_scheduling import NO_HOLD_KEY
from tests.clock import FakeClock

BLOCK = 16
SECRET = "hold-ledger-test-secret-32-bytes"
ENGINE = "prefill-engine"
LEASE_S = 30.0


def _sched(num_blocks: int = 10, clock: FakeClock | None = None, pp_size: int = 1) -> SchedulerSide:
    """A prefill engine's scheduler side; ``pp_size`` > 1: a pipeline-parallel engine, whose one scheduler holds
    each request's blocks once for all its stages' workers (the same ledger, the same cap)."""
    config = P2pKvConfig(lease_s=LEASE_S, max_held_fraction=0.5, secret=SECRET,
                         role="prefill")
    return SchedulerSide(ENGINE, config, BLOCK, "127.0.0.1", 5600, 1, role="prefill", num_blocks=num_blocks,
                         clock=clock or time.monotonic, pp_size=pp_size)


def _grant(pp_size: int = 1) -> str:
    return make_stream_grant(ENGINE, ANY_DECODE, SECRET.encode(), time.time() + 60, pp_size=pp_size)


STAGES = pytest.mark.parametrize("pp_size", [1, 2], ids=["one stage", "PP 2"])
"""The guarantees of holds and grants on an engine without and with pipeline stages."""


def _arrive(sched: SchedulerSide, rid: str, blocks: int, grant: str | None = None) -> Request:
    """A prefill leg of ``blocks`` full blocks (streamed under ``grant`` when given) arrives."""
    req = Request(rid, list(range(3, 3 + BLOCK * blocks)), SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {"do_remote_decode": True, **({GRANT_KEY: grant} if grant else {})}
    sched.on_new_request(req)
    return req


def _end(sched: SchedulerSide, req: Request, block_ids: list[int], completed: bool = True) -> tuple[bool, dict]:
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED if completed else RequestStatus.FINISHED_ABORTED
    return sched.request_finished_all_groups(req, (block_ids,))


@STAGES
def test_a_stream_counts_against_the_cap_from_its_arrival(pp_size: int) -> None:
    """5 of 10 blocks may be held. A 4-block stream counts from its arrival (its destination, once it has one,
    keeps its blocks until the stream ends, whatever else happens), so a 2-block pull finishing meanwhile is
    answered without a hold; once the stream's hold has ended, the pull is held again."""
    sched = _sched(pp_size=pp_size)
    stream = _arrive(sched, "s-1", 4, _grant(pp_size))
    assert sched.prefill.held_blocks == 4
    meta = sched.build_connector_meta()
    assert list(meta.stream_admits) == ["s-1"] and meta.stream_refusals == {}
    hold, params = _end(sched, _arrive(sched, "p-1", 2), [1, 2])
    assert not hold and "max_held_fraction=0.5 (5 blocks)" in params[NO_HOLD_KEY]
    hold, answer = _end(sched, stream, [5, 6, 7, 8])
    assert hold and sched.prefill.held_blocks == 4
    assert answer[STREAMED_KEY] is True and STREAMED_KEY not in params, "the proxy is told which prompts streamed"
    sched.on_sent({"s-1"})
    assert sched.prefill.held_blocks == 0
    assert _end(sched, _arrive(sched, "p-2", 2), [1, 2])[0]


@STAGES
def test_a_stream_that_would_pass_the_cap_is_not_streamed_and_its_destination_is_refused_at_once(pp_size: int) -> None:
    sched = _sched(pp_size=pp_size)
    assert _end(sched, _arrive(sched, "p-1", 3), [1, 2, 3])[0]
    grant = _grant(pp_size)
    req = _arrive(sched, "s-1", 4, grant)
    meta = sched.build_connector_meta()
    assert meta.stream_admits == {} and sched.prefill.held_blocks == 3
    (why,) = meta.stream_refusals.values()
    assert list(meta.stream_refusals) == [grant.split(".")[1]] and "max_held_fraction" in why
    hold, params = _end(sched, req, [5, 6, 7, 8])
    assert not hold and "max_held_fraction" in params[NO_HOLD_KEY], "a refused stream holds nothing"


@STAGES
def test_a_replayed_grant_serves_no_second_request_even_after_the_first_has_finished(pp_size: int) -> None:
    """A grant is seen by logs, traces, routers and the plaintext proxy → engine hop. Sent again once its first
    request has finished, it used to stream again (a hold no cap refused, pinned until the lease)."""
    sched = _sched(num_blocks=100, pp_size=pp_size)
    grant = _grant(pp_size)
    first = _arrive(sched, "s-1", 4, grant)
    assert _end(sched, first, [5, 6, 7, 8])[0]
    sched.on_sent({"s-1"})
    sched.build_connector_meta()
    replay = _arrive(sched, "s-2", 4, grant)
    meta = sched.build_connector_meta()
    assert meta.stream_admits == {} and "s-2" not in sched.streams, "a replayed grant was streamed again"
    hold, params = _end(sched, replay, [9, 10, 11, 12])
    assert not hold and "already serves request s-1" in params[NO_HOLD_KEY]
    assert sched.prefill.held_blocks == 0


@STAGES
def test_a_replayed_grant_while_its_request_runs_is_refused_and_the_first_keeps_its_stream(pp_size: int) -> None:
    sched = _sched(num_blocks=100, pp_size=pp_size)
    grant = _grant(pp_size)
    first = _arrive(sched, "s-1", 2, grant)
    replay = _arrive(sched, "s-2", 2, grant)
    assert "s-1" in sched.streams and "s-2" not in sched.streams
    assert not _end(sched, replay, [3, 4])[0]
    assert _end(sched, first, [1, 2])[0] and sched.prefill.held_blocks == 2


def test_bindings_refuse_past_their_count_and_forget_only_what_expired() -> None:
    bound = Bindings("stream id", max_entries=3)
    for i in range(3):
        assert bound.bind(f"id-{i}", f"r-{i}", expiry=100.0 + i, now=50.0) is None
    assert "the most it keeps (3)" in bound.bind("id-3", "r-3", expiry=200.0, now=50.0)
    assert bound.bind("id-0", "r-0", expiry=100.0, now=50.0) is None, "the same owner again is no replay"
    assert "already serves request r-0" in bound.bind("id-0", "r-9", expiry=100.0, now=50.0)
    assert bound.expire(101.5) == 2 and len(bound) == 1 and bound.owner("id-2") == "r-2"
    assert bound.bind("id-3", "r-3", expiry=200.0, now=101.5) is None


# ---- random interleavings ----------------------------------------------------------------

WAYS = ("pull", "push", "stream")
OPS = st.lists(st.tuples(
    st.sampled_from(("arrive", "replay", "finish", "abort", "done", "leave", "tick", "restart")),
    st.sampled_from(WAYS), st.integers(1, 5), st.integers(0, 7)), min_size=5, max_size=60)


class Engine:
    """A prefill engine's scheduler side and its one worker's holds, on one fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sched = _sched(num_blocks=20, clock=clock)
        self.holds = PrefillHolds(LEASE_S, clock)
        self.running: dict[str, tuple[Request, int]] = {}  # request id → (request, its blocks)
        self.held: dict[str, float] = {}  # held request id → when its hold was made
        self.grants: list[str] = []
        self.next_block = 1

    def step(self) -> set[str]:
        """One engine step: the scheduler's metadata to the worker, the worker's releases back."""
        meta = self.sched.build_connector_meta()
        for rid, deadline in meta.send_leases.items():
            self.holds.hold(rid, deadline, meta.send_blocks.get(rid))
        released = self.holds.released([], {"leases_expired": 0, "leases_notified": 0})
        self.sched.on_sent(released)
        for rid in released:
            self.held.pop(rid, None)
        return released


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_no_hold_outlives_its_lease_and_the_cap_is_never_passed(ops: list[tuple[str, str, int, int]]) -> None:
    clock = FakeClock()
    engine = Engine(clock)
    cap = engine.sched.prefill.max_held_blocks
    n = 0
    for op, way, blocks, pick in ops:
        n += 1
        if op in ("arrive", "replay"):
            grant = None
            if way == "stream":
                grant = engine.grants[pick % len(engine.grants)] if op == "replay" and engine.grants else _grant()
                engine.grants.append(grant)
            rid = f"r-{n}"
            engine.running[rid] = (_arrive(engine.sched, rid, blocks, grant), blocks)
        elif op in ("finish", "abort") and engine.running:
            rid = sorted(engine.running)[pick % len(engine.running)]
            req, size = engine.running.pop(rid)
            ids = list(range(engine.next_block, engine.next_block + size))
            engine.next_block += size
            hold, _ = _end(engine.sched, req, ids, completed=op == "finish")
            if hold:
                engine.held[rid] = clock.now
        elif op in ("done", "leave") and engine.held:  # the decode's "done", or the proxy's release
            rid = sorted(engine.held)[pick % len(engine.held)]
            blocks_of = engine.holds._blocks.get(rid)
            if blocks_of is not None:
                engine.holds.on_release([rid], [sorted(blocks_of)])
        elif op == "tick":
            clock.now += pick * LEASE_S / 4
        elif op == "restart":  # the engine process is replaced: nothing it held survives
            engine = Engine(clock)
            continue
        engine.step()
        assert engine.sched.prefill.held_blocks <= cap, "more blocks held than max_held_fraction allows"
        for rid, since in engine.held.items():
            assert clock.now - since <= LEASE_S, f"{rid} held {clock.now - since:.0f} s, past its {LEASE_S} s lease"
        streamed = [rid for rid, (req, _) in engine.running.items() if rid in engine.sched.streams]
        owners = [engine.sched.streams.bound.owner(req.kv_transfer_params[GRANT_KEY].split(".")[1])
                  for rid, (req, _) in engine.running.items() if rid in streamed]
        assert sorted(owners) == sorted(streamed), "a grant serves more than one request"
