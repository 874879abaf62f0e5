"""The replay guard's properties under any sequence of requests (:mod:`handshake.replay`), with a made-up clock:
floods (more requests than it remembers), senders whose clocks run ahead or behind, and eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handshake import ReplayedRequestError, ReplayGuard, StaleRequestError
from tests.clock import FakeClock

WINDOW, SKEW, CAPACITY = 30.0, 5.0, 16


def _check(guard: ReplayGuard, nonce: bytes, sent_at: float) -> bool:
    """Whether ``guard`` accepted the request."""
    try:
        guard.check(nonce, sent_at)
    except (StaleRequestError, ReplayedRequestError):
        return False
    return True


# One request: (seconds the clock moves on first, offset of its sent_at from the clock, which nonce).
requests = st.lists(st.tuples(st.floats(0, 3), st.floats(-40, 40), st.integers(0, 40)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(requests)
def test_a_request_is_accepted_only_inside_the_window_and_memory_stays_bounded(ops) -> None:
    clock = FakeClock()
    guard = ReplayGuard(WINDOW, CAPACITY, clock, future_skew_s=SKEW)
    for step, offset, nonce in ops:
        clock.now += step
        accepted = _check(guard, nonce.to_bytes(16, "big"), clock.now + offset)
        assert not accepted or -WINDOW <= offset <= SKEW
        assert len(guard) <= CAPACITY


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.floats(-40, 0), st.integers(0, 40)), max_size=200))
def test_no_request_dated_in_the_past_is_accepted_twice(ops) -> None:
    """Floods and eviction included: a forgotten nonce's request is refused as stale, never let through."""
    clock = FakeClock()
    guard = ReplayGuard(WINDOW, CAPACITY, clock, future_skew_s=SKEW)
    accepted: set[tuple[bytes, float]] = set()
    for step, offset, nonce in ops:
        clock.now += step
        request = (nonce.to_bytes(16, "big"), clock.now + offset)
        if _check(guard, *request):
            assert request not in accepted
            accepted.add(request)
        for old in list(accepted)[:20]:  # every earlier request replayed now: refused
            assert not _check(guard, *old)


@settings(max_examples=200, deadline=None)
@given(flood=st.integers(1, 4 * CAPACITY), ahead=st.floats(0, SKEW), spread=st.floats(0, 2),
       pause=st.floats(0.001, 10), latency=st.floats(0, 0.5))
def test_no_flood_makes_honest_requests_after_it_stale(flood: int, ahead: float, spread: float, pause: float,
                                                      latency: float) -> None:
    """Whatever a flood was dated (up to the skew ahead: a fast clock, or a secret holder), a request sent
    after it stopped is accepted: the floor never passes the server's clock."""
    clock = FakeClock()
    guard = ReplayGuard(WINDOW, CAPACITY, clock, future_skew_s=SKEW)
    for i in range(flood):
        clock.now += spread / flood
        _check(guard, b"flood" + i.to_bytes(11, "big"), clock.now + ahead)  # late ones of a flood may be refused
    last = clock.now
    clock.now += pause
    sent_at = max(last + 1e-6, clock.now - latency)
    assert _check(guard, b"honest-request-0", sent_at)


@pytest.mark.parametrize(("offset", "accepted"), [(-30.0, True), (-30.01, False), (5.0, True), (5.01, False),
                                                  (29.0, False)])
def test_skew_ahead_is_bounded_separately_from_age(offset: float, accepted: bool) -> None:
    clock = FakeClock()
    guard = ReplayGuard(WINDOW, CAPACITY, clock, future_skew_s=SKEW)
    assert _check(guard, b"n" * 16, clock.now + offset) is accepted


def test_a_request_from_a_fast_clock_is_refused_naming_the_cause() -> None:
    guard = ReplayGuard(WINDOW, CAPACITY, FakeClock(), future_skew_s=SKEW)
    with pytest.raises(StaleRequestError, match="the sender's clock runs ahead of this server's") as info:
        guard.check(b"n" * 16, 1000.0 + 29.0)
    assert info.value.field == "sent_at"
    with pytest.raises(ValueError, match="future_skew_s"):
        ReplayGuard(WINDOW, CAPACITY, future_skew_s=31.0)
