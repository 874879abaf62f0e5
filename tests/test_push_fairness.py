"""The order in which a prefill rank posts queued WRITEs: decode ranks in turn, each within its in-flight bound."""

from __future__ import annotations

import collections

import numpy as np

from p2pkv.prefill.pusher import PushJob, take_in_turn

_ROWS = np.zeros((1, 3), dtype=np.uint64)


def _jobs(agent: str, n: int) -> collections.deque[PushJob]:
    return collections.deque(PushJob(f"{agent}-{i}", bytes(16), agent, _ROWS, _ROWS, 0.0, 60.0) for i in range(n))


def test_decode_ranks_are_served_in_turn_up_to_the_bound() -> None:
    queued = {"a": _jobs("a", 5), "b": _jobs("b", 2), "c": _jobs("c", 1)}
    taken = take_in_turn(queued, {}, ["a", "b", "c"], limit=2)
    assert [job.request_id for _, job in taken] == ["a-0", "b-0", "c-0", "a-1", "b-1"]
    assert [j.request_id for j in queued["a"]] == ["a-2", "a-3", "a-4"]  # a is at its bound; the rest wait
    assert not queued["b"] and not queued["c"]


def test_writes_in_flight_count_against_the_bound() -> None:
    queued = {"a": _jobs("a", 3), "b": _jobs("b", 3)}
    taken = take_in_turn(queued, {"a": 2, "b": 1}, ["b", "a"], limit=2)
    assert [job.request_id for _, job in taken] == ["b-0"]  # a already has 2 in flight
    assert take_in_turn(queued, {"a": 2, "b": 2}, ["a", "b"], limit=2) == []


def test_a_busy_rank_does_not_starve_one_that_arrives_later() -> None:
    """Rank a queued 100 WRITEs first; rank b's one WRITE goes out in the first round, whoever is first."""
    queued = {"a": _jobs("a", 100), "b": _jobs("b", 1)}
    for order in (["a", "b"], ["b", "a"]):
        round_ = take_in_turn({k: collections.deque(v) for k, v in queued.items()}, {}, order, limit=4)
        assert "b-0" in [job.request_id for _, job in round_[:2]]
