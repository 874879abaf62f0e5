"""Lease table with a fake clock: interleaved holds, extensions, releases, expiries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.prefill.leases import LeaseTable
from tests.clock import FakeClock


def test_no_head_of_line_stranding() -> None:
    clock = FakeClock(0.0)
    leases = LeaseTable(clock)
    leases.hold("long", 100.0)
    leases.hold("a", 5.0)
    leases.hold("b", 6.0)
    clock.now = 7.0
    assert leases.pop_expired() == ["a", "b"]  # not stuck behind "long"
    assert "long" in leases and len(leases) == 1
    clock.now = 100.0
    assert leases.pop_expired() == ["long"]
    assert leases.pop_expired() == []


def test_release_and_extend_are_exactly_once() -> None:
    clock = FakeClock(0.0)
    leases = LeaseTable(clock)
    leases.hold("r", 10.0)
    assert leases.extend("r", 20.0)  # now 0 + 20
    clock.now = 15.0
    assert leases.pop_expired() == []
    assert leases.release("r") and not leases.release("r")
    clock.now = 25.0
    assert leases.pop_expired() == []
    assert not leases.extend("r", 5.0)
    leases.hold("s", 30.0)
    leases.hold("s", 1.0)  # never shortens
    clock.now = 29.0
    assert leases.pop_expired() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "extend", "release", "tick"]),
                          st.integers(0, 5), st.floats(0, 50)), max_size=60))
def test_each_lease_ends_once_and_never_early(ops) -> None:
    clock = FakeClock(0.0)
    leases = LeaseTable(clock)
    model: dict[str, float] = {}
    ended: list[str] = []
    for op, i, x in ops:
        rid = f"r{i}"
        if op == "hold":
            leases.hold(rid, clock.now + x)
            model[rid] = max(model.get(rid, float("-inf")), clock.now + x)
        elif op == "extend":
            assert leases.extend(rid, x) == (rid in model)
            if rid in model:
                model[rid] = max(model[rid], clock.now + x)
        elif op == "release":
            assert leases.release(rid) == (rid in model)
            if model.pop(rid, None) is not None:
                ended.append(rid)
        else:
            clock.now += x
        for rid in leases.pop_expired():
            assert model.pop(rid) <= clock.now  # never before its deadline
            ended.append(rid)
        assert all(d > clock.now for d in model.values())  # nothing expired left behind
        assert set(model) == {r for r in model if r in leases}
