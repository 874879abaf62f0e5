"""Push mode, prefill side: a hold pinned by a WRITE (``PrefillHolds.pin``/``unpin``) outlives whatever ends it
meanwhile (a release, the last "done", its lease), which then takes effect exactly once when the last pin goes.

The lease table runs on a fake clock (``PrefillHolds.leases`` is injectable, as in ``tests/test_leases.py``), so
expiry is exact and nothing sleeps.
"""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.notification import DoneNotification, blocks_digest
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.leases import LeaseTable
from p2pkv.telemetry.hold_spans import HoldEnd
from p2pkv.telemetry.stats import empty_stats
from tests.clock import FakeClock


def holds_on(clock: FakeClock, lease_s: float = 30.0) -> PrefillHolds:
    """A :class:`PrefillHolds` whose leases expire on ``clock``."""
    holds = PrefillHolds(lease_s=lease_s)
    holds.leases = LeaseTable(clock)
    return holds


def done(rid: str, blocks: tuple[int, ...]) -> DoneNotification:
    """One decode rank's "done" for ``rid`` naming the digest of ``blocks``."""
    return DoneNotification(rid, "decode:0", 1, blocks_digest(blocks))


def step(holds: PrefillHolds, notes: list[DoneNotification] | None = None) -> tuple[set[str], dict[str, HoldEnd]]:
    """One engine step: the ids freed now and why (the endings taken, as the worker takes them)."""
    freed = holds.released(notes or [], empty_stats())
    endings, holds.endings = holds.endings, {}
    return freed, endings


# ---- what pin answers ------------------------------------------------------------------------------------
def test_pin_answers_like_the_fence() -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("held", 10.0, (4, 5, 6))
    holds.hold("no-blocks", 10.0)  # block ids not known: any list is taken
    holds.hold("gone", 10.0, (7,))
    holds.hold("short", 1.0, (8,))
    assert holds.on_release(["gone"], [[7]]) == 1
    clock.now = 2.0
    assert step(holds)[0] == {"gone", "short"}
    assert holds.pin("held", [6, 5, 4]) == "held"  # the same blocks in another order
    assert holds.pin("held", [4, 5]) == "not_held", "a subset of the hold's blocks"
    assert holds.pin("held", [4, 5, 6, 7]) == "not_held", "a superset"
    assert holds.pin("no-blocks", [1, 2]) == "held"
    assert holds.pin("gone", [7]) == "not_held"
    assert holds.pin("short", [8]) == "expired"
    assert holds.pin("never", [1]) == "unknown"
    assert holds._pins == {"held": 1, "no-blocks": 1}  # only the holds it answered "held" for


def test_unpin_of_what_was_never_pinned_changes_nothing() -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("r", 10.0, (1,))
    holds.unpin("r")
    holds.unpin("never")
    assert holds._pins == {}
    assert holds.on_release(["r"], [[1]]) == 1
    assert step(holds)[0] == {"r"}, "an unpin without a pin must not keep (or lose) anything"


# ---- each way a hold ends, deferred while pinned, then applied once ----------------------------------------
def _end(holds: PrefillHolds, clock: FakeClock, how: str) -> list[DoneNotification]:
    """Start ending hold "r" (blocks 1, 2, deadline 10) ``how``; the notes the next step must see."""
    if how == "released":
        assert holds.on_release(["r"], [[1, 2]]) == 1
        return []
    if how == "expired":
        clock.now = 11.0
        return []
    return [done("r", (1, 2))]


WHY = {"released": HoldEnd.RELEASED, "expired": HoldEnd.EXPIRED, "notified": HoldEnd.NOTIFIED}


def test_an_ending_while_pinned_waits_for_the_unpin_then_applies_once() -> None:
    for how, why in WHY.items():
        clock = FakeClock(0.0)
        holds = holds_on(clock)
        holds.hold("r", 10.0, (1, 2))
        assert holds.pin("r", [1, 2]) == "held"
        notes = _end(holds, clock, how)
        stats = empty_stats()
        assert holds.released(notes, stats) == set(), f"{how}: a pinned hold was freed"
        assert holds.pending(), f"{how}: a hold waiting for its WRITE must count as pending"
        assert "r" not in holds.leases
        # Ending: a new WRITE from it is refused (as the fence would answer once it has ended).
        assert holds.pin("r", [1, 2]) == ("expired" if how == "expired" else "not_held"), how
        assert step(holds) == (set(), {}), f"{how}: freed before the WRITE ended"
        holds.unpin("r")
        assert step(holds) == ({"r"}, {"r": why}), how
        for _ in range(3):
            assert step(holds) == (set(), {}), f"{how}: freed twice"
        assert not holds.pending()
        assert holds.pin("r", [1, 2]) == ("expired" if how == "expired" else "not_held"), how
        status = holds.on_heartbeat(["r"], 5.0, [[1, 2]])
        assert (status.expired if how == "expired" else status.not_held) == ["r"], how


def test_the_last_of_several_pins_frees_the_hold() -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("r", 10.0, (1, 2))
    assert [holds.pin("r", [1, 2]) for _ in range(3)] == ["held"] * 3  # three decode ranks, one WRITE each
    assert holds.on_release(["r"], [[1, 2]]) == 1
    for _ in range(2):
        holds.unpin("r")
        assert step(holds) == (set(), {}), "freed while a WRITE from it is still in flight"
    holds.unpin("r")
    assert step(holds) == ({"r"}, {"r": HoldEnd.RELEASED})


def test_several_endings_while_pinned_free_it_once() -> None:
    """A release, then the lease running out, then a late "done", all while a WRITE is in flight."""
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("r", 10.0, (1, 2))
    holds.hold("other", 10.0, (3,))
    stats = empty_stats()
    assert holds.pin("r", [1, 2]) == "held"
    holds.on_release(["r"], [[1, 2]])
    assert holds.released([], stats) == set()
    clock.now = 11.0  # "other" expires now, "r" has no lease left to expire
    assert holds.released([done("r", (1, 2))], stats) == {"other"}
    holds.unpin("r")
    assert holds.released([], stats) == {"r"}
    assert holds.released([done("r", (1, 2))], stats) == set()
    assert (stats["leases_expired"], stats["leases_notified"]) == (1, 1)


def test_a_pinned_hold_that_nothing_ends_is_kept_after_the_unpin() -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("r", 10.0, (1, 2))
    assert holds.pin("r", [1, 2]) == "held"
    holds.unpin("r")
    assert step(holds) == (set(), {})
    assert holds.pin("r", [1, 2]) == "held", "the WRITE ended; the hold goes on until its own end"
    holds.unpin("r")
    clock.now = 10.0
    assert step(holds) == ({"r"}, {"r": HoldEnd.EXPIRED})


def test_unpinned_holds_are_not_held_back_by_a_pinned_one() -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("pinned", 10.0, (1,))
    holds.hold("free", 10.0, (2,))
    assert holds.pin("pinned", [1]) == "held"
    assert step(holds, [done("pinned", (1,)), done("free", (2,))]) == ({"free"}, {"free": HoldEnd.NOTIFIED})
    holds.unpin("pinned")
    assert step(holds) == ({"pinned"}, {"pinned": HoldEnd.NOTIFIED})


def test_a_pin_that_lands_while_the_hold_is_being_ended_is_refused() -> None:
    """The side-channel thread pins while the engine thread ends the same hold: the pin must not be answered
    "held" for a hold being handed back to vLLM (its WRITE would read freed blocks). Ending a hold (deciding
    it ends, forgetting its blocks) is one critical section: a pin sent from another thread in the middle of
    it waits for it, then finds the hold ended."""
    clock = FakeClock(0.0)
    holds = holds_on(clock)
    holds.hold("r", 10.0, (1, 2))
    answers: list[str] = []
    remember = holds._remember

    def remember_while_another_thread_pins(released: set[str], expired: set[str], now: float) -> None:
        pinner = threading.Thread(target=lambda: answers.append(holds.pin("r", [1, 2])))
        pinner.start()
        pinner.join(timeout=0.2)  # it cannot get in while the hold is being ended
        assert pinner.is_alive() and answers == []
        remember(released, expired, now)
        threads.append(pinner)

    threads: list[threading.Thread] = []
    holds._remember = remember_while_another_thread_pins  # type: ignore[method-assign]
    assert holds.on_release(["r"], [[1, 2]]) == 1
    assert step(holds)[0] == {"r"}
    threads[0].join(timeout=5)
    assert answers == ["not_held"], "a WRITE was accepted from a hold handed back in the same step"


# ---- exactly once, never while pinned, never early: random interleavings -------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["pin", "unpin", "release", "done", "tick", "step", "beat"]),
                         st.integers(0, 2), st.floats(0.0, 6.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_hold_ends_once_and_never_while_pinned(ops: list[tuple[str, int, float]]) -> None:
    clock = FakeClock(0.0)
    holds = holds_on(clock, lease_s=10.0)
    blocks = {f"r{i}": (10 * i, 10 * i + 1) for i in range(3)}
    for rid, ids in blocks.items():
        holds.hold(rid, 10.0, ids)
    pins = dict.fromkeys(blocks, 0)
    asked: dict[str, bool] = dict.fromkeys(blocks, False)  # a release or "done" asked for, or its lease ran out
    ended: dict[str, HoldEnd] = {}
    notes: list[DoneNotification] = []
    for op, i, x in ops:
        rid = f"r{i}"
        if op == "pin":
            answer = holds.pin(rid, list(blocks[rid]))
            if rid in ended:
                assert answer in ("expired", "not_held")
            elif answer == "held":
                pins[rid] += 1
            else:  # refused only once it is ending
                assert asked[rid] or rid not in holds.leases, (rid, answer)
        elif op == "unpin" and pins[rid]:
            pins[rid] -= 1
            holds.unpin(rid)
        elif op == "release":
            holds.on_release([rid], [list(blocks[rid])])
            asked[rid] = asked[rid] or rid not in ended
        elif op == "done":
            notes.append(done(rid, blocks[rid]))
            asked[rid] = asked[rid] or rid not in ended
        elif op == "tick":
            clock.now += x
        elif op == "beat":
            holds.on_heartbeat([rid], x, [])
        else:
            freed, endings = step(holds, notes)
            notes = []
            assert freed == set(endings)
            for r, why in endings.items():
                assert r not in ended, f"{r} ended twice"
                assert pins[r] == 0, f"{r} ended with {pins[r]} WRITE(s) from it in flight"
                assert why is HoldEnd.EXPIRED or asked[r], f"{r} ended {why} without a release or a done"
                ended[r] = why
    for rid in blocks:  # drain: unpin everything, let the leases run out
        for _ in range(pins[rid]):
            holds.unpin(rid)
    for _ in range(2):  # the first step applies heartbeats still queued (they extend from when applied)
        freed, endings = step(holds, notes)
        notes = []
        assert not set(endings) & set(ended), "ended twice"
        ended.update(endings)
        clock.now += 100.0
    assert set(ended) == set(blocks), "a hold was never freed"
    assert not holds.pending() and holds._pins == {}
