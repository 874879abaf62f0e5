"""The prefill scheduler's stream chunks (:mod:`p2pkv.scheduling.stream_steps`): which blocks each step computes
for a streamed request, from vLLM's ``SchedulerOutput``; which grants it streams."""

from __future__ import annotations

import time
from types import SimpleNamespace

from p2pkv.grant import ANY_DECODE, GRANT_KEY, make_stream_grant
from p2pkv.prompt_digest import prompt_digest
from p2pkv.scheduling.stream_steps import StreamSteps

SECRET = b"s" * 32
BLOCK = 4


def _request(rid: str, tokens: int, grant: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)),
                           kv_transfer_params={"do_remote_decode": True, GRANT_KEY: grant})


def _output(new=(), cached=(), resumed=frozenset(), counts=None, preempted=None) -> SimpleNamespace:
    """A SchedulerOutput: ``new`` (req_id, block_ids, computed), ``cached`` (req_id, new block ids, computed),
    ``preempted`` (request ids)."""
    return SimpleNamespace(
        preempted_req_ids=preempted,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[(b,) if b else None for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=resumed),
        num_scheduled_tokens=counts or {})


def _steps(recompute: int = 0) -> StreamSteps:
    return StreamSteps("prefill-0", SECRET, BLOCK, recompute, kv_groups=1)


def test_chunked_prefill_streams_each_steps_blocks_and_rewrites_the_block_a_chunk_ended_in() -> None:
    steps = _steps()
    steps.on_new_request(_request("r", 10, make_stream_grant("prefill-0", ANY_DECODE, SECRET, time.time() + 60)))
    first = steps.chunks(_output(new=[("r", [7, 8], 0)], counts={"r": 6}))
    assert [(c.first_block, c.block_ids, c.num_tokens, c.last) for c in first] == [(0, (7, 8), 6, False)]
    assert first[0].prompt_digest == prompt_digest(list(range(9))) and first[0].loaded_tokens == 9
    second = steps.chunks(_output(cached=[("r", [9], 6)], counts={"r": 4}))
    assert [(c.first_block, c.block_ids, c.num_tokens, c.last) for c in second] == [(1, (8, 9), 10, True)]
    assert second[0].prompt_digest == "" and second[0].loaded_tokens == 0


def test_a_cached_prefix_goes_with_the_first_chunk_and_a_preempted_request_starts_again_from_block_0() -> None:
    steps = _steps()
    steps.on_new_request(_request("r", 12, make_stream_grant("prefill-0", ANY_DECODE, SECRET, time.time() + 60)))
    (first,) = steps.chunks(_output(new=[("r", [3, 4, 5], 8)], counts={"r": 2}))
    assert (first.first_block, first.block_ids) == (0, (3, 4, 5))
    (resumed,) = steps.chunks(_output(cached=[("r", [6, 7, 8], 0)], resumed={"r"}, counts={"r": 12}))
    assert (resumed.first_block, resumed.block_ids, resumed.last) == (0, (6, 7, 8), True)
    assert resumed.prompt_digest, "a resumed request opens its stream again"


def test_only_grants_this_engine_can_check_are_streamed() -> None:
    steps = _steps()
    later = time.time() + 60
    for rid, grant in (("other engine", make_stream_grant("prefill-1", ANY_DECODE, SECRET, later)),
                       ("other secret", make_stream_grant("prefill-0", ANY_DECODE, b"t" * 32, later)),
                       ("named decode", make_stream_grant("prefill-0", "decode-0", SECRET, later)),
                       ("expired", make_stream_grant("prefill-0", ANY_DECODE, SECRET, time.time() - 60)),
                       ("malformed", "v1.nope")):
        steps.on_new_request(_request(rid, 8, grant))
        assert rid not in steps, rid
    good = make_stream_grant("prefill-0", ANY_DECODE, SECRET, later)
    steps.on_new_request(_request("a", 8, good))
    steps.on_new_request(_request("b", 8, good))
    assert "a" in steps and "b" not in steps, "one stream id streams one request"
    unsecured = StreamSteps("prefill-0", None, BLOCK, 0, 1)
    unsecured.on_new_request(_request("c", 8, good))
    assert "c" not in unsecured, "without a secret nothing streams"


def test_an_aborted_streamed_request_is_told_to_the_workers_once() -> None:
    steps = _steps(recompute=1)
    steps.on_new_request(_request("r", 8, make_stream_grant("prefill-0", ANY_DECODE, SECRET, time.time() + 60)))
    (chunk,) = steps.chunks(_output(new=[("r", [1, 2], 0)], counts={"r": 8}))
    assert chunk.loaded_tokens == 8, "with recompute_tokens the prompt here is already the decode's load"
    assert steps.finished("r", completed=False)
    assert steps.take_aborts() == {"r": "the prefill request was aborted"}
    assert steps.take_aborts() == {}
    assert not steps.finished("r", completed=True)


def test_a_preempted_streamed_request_is_told_to_the_workers_once_and_opens_again_from_block_0() -> None:
    steps = _steps()
    steps.on_new_request(_request("r", 12, make_stream_grant("prefill-0", ANY_DECODE, SECRET, time.time() + 60)))
    (first,) = steps.chunks(_output(new=[("r", [3, 4], 0)], counts={"r": 8}))
    assert not first.last
    assert steps.chunks(_output(preempted={"r", "not-streamed"})) == []
    assert steps.take_restarts() == ["r"], "only a streamed request's preemption is told"
    assert steps.take_restarts() == []
    (resumed,) = steps.chunks(_output(cached=[("r", [6, 7, 8], 4)], resumed={"r"}, counts={"r": 8}))
    assert (resumed.first_block, resumed.block_ids, resumed.last) == (0, (6, 7, 8), True)
    assert resumed.prompt_digest, "the resumed request opens its stream again"
