"""The prefill rank's one WRITE thread (:class:`p2pkv.prefill.write_engine.WriteEngine`): every source takes its
turns on it, it sleeps as the most pressing source asks, a source that fails does not stop the others, a
notification keeps NIXL progressed, and closing stops every source before each drops what it has left.

The sources here are recorders; the two real ones (push, layer streams) move real bytes through it in
tests/test_push_*.py and tests/test_stream*.py, and share one engine in a worker (tests/test_worker_roles.py)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from p2pkv.prefill.write_engine import (
    IDLE_S,
    LINGER_S,
    NOTIFY_POLL_S,
    NOTIFY_PROGRESS_S,
    POLL_S,
    Pace,
    WriteEngine,
    past_window,
)


class Recorder:
    """A source that records its turns (thread, ``stopping``) and answers ``pace``; ``busy_after_stop`` turns
    with WRITEs still in flight once stopping (cancelled ones being waited out)."""

    def __init__(self, pace: Pace = Pace.IDLE, busy_after_stop: int = 0) -> None:
        self.pace = pace
        self.busy_after_stop = busy_after_stop
        self.turns: list[tuple[int, bool]] = []
        self.events: list[str] = []

    def turn(self, now: float, stopping: bool) -> Pace:
        self.turns.append((threading.get_ident(), stopping))
        if stopping:
            self.events.append("stopping")
            if self.busy_after_stop > 0:
                self.busy_after_stop -= 1
                return Pace.WRITING
            return Pace.IDLE
        return self.pace

    def drop_all(self) -> None:
        self.events.append("drop_all")

    def count(self) -> int:
        return len(self.turns)


class Progressed:
    """A NIXL agent that counts its progress calls."""

    def __init__(self) -> None:
        self.calls = 0

    def progress(self) -> None:
        self.calls += 1


def _turns_over(source: Recorder, seconds: float) -> int:
    start = source.count()
    time.sleep(seconds)
    return source.count() - start


def test_every_source_turns_on_the_one_thread_and_the_most_pressing_sets_the_pace() -> None:
    engine = WriteEngine(SimpleNamespace(progress=lambda: None), None)  # type: ignore[arg-type]
    idle, other = Recorder(Pace.IDLE), Recorder(Pace.IDLE)
    try:
        engine.attach(idle)
        engine.attach(other)
        time.sleep(0.05)
        quiet = _turns_over(idle, 0.5)
        other.pace = Pace.URGENT
        engine.wake()
        urgent = _turns_over(idle, 0.5)
        assert {ident for ident, _ in idle.turns + other.turns} == {engine.thread.ident}
        assert quiet <= 2 * 0.5 / IDLE_S + 2, f"{quiet} turns in 0.5 s with every source idle"
        assert urgent > 4 * quiet, f"an urgent source got {urgent} turns in 0.5 s, idle ones {quiet}"
    finally:
        engine.close()


def test_a_call_wakes_an_idle_engine_at_once() -> None:
    engine = WriteEngine(SimpleNamespace(progress=lambda: None), None)  # type: ignore[arg-type]
    source = Recorder(Pace.IDLE)
    try:
        engine.attach(source)
        time.sleep(0.1)
        woken = []
        for _ in range(20):  # 20 wakes within one idle sleep's time each get a turn
            before = source.count()
            engine.wake()
            deadline = time.monotonic() + IDLE_S / 2
            while source.count() == before and time.monotonic() < deadline:
                time.sleep(0.0005)
            woken.append(source.count() > before)
        assert sum(woken) >= 18, f"only {sum(woken)} of 20 wakes got a turn before the idle sleep ended"
    finally:
        engine.close()


def test_a_source_that_fails_its_turn_leaves_the_others_and_the_thread_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Recorder):
        def turn(self, now: float, stopping: bool) -> Pace:
            super().turn(now, stopping)
            raise RuntimeError("a bug in a source")

    engine = WriteEngine(SimpleNamespace(progress=lambda: None), None)  # type: ignore[arg-type]
    broken, fine = Broken(), Recorder(Pace.IDLE)
    with caplog.at_level(logging.ERROR, logger="p2pkv.prefill"):
        try:
            engine.attach(broken)
            engine.attach(fine)
            time.sleep(0.2)
            assert broken.count() >= 3 and fine.count() >= 3
            assert engine.thread.is_alive()
        finally:
            engine.close()
    assert "failed a turn of Broken" in caplog.text


def test_a_notification_keeps_nixl_progressed_while_nothing_else_would() -> None:
    agent = Progressed()
    engine = WriteEngine(agent, None)  # type: ignore[arg-type]
    try:
        time.sleep(0.1)
        start = agent.calls
        time.sleep(0.5)
        idle = agent.calls - start
        engine.notified()
        start = agent.calls
        time.sleep(0.5)
        after = agent.calls - start
        assert after > 10 * max(idle, 1), f"progressed {after} times in 0.5 s after a notification, {idle} before"
    finally:
        engine.close()


def test_a_streams_last_word_lingers_briefly_and_a_failure_word_for_seconds() -> None:
    """After a stream's last word the engine turns fast for LINGER_S only (its decode agent's connection is up);
    after a "push_failed" it keeps progressing NIXL for NOTIFY_PROGRESS_S (the agent may be loaded just now).
    The decision is read on the engine's own windows at chosen instants, not by counting turns in wall time."""
    agent = Progressed()
    engine = WriteEngine(agent, None)  # type: ignore[arg-type]
    try:
        start = time.monotonic()
        assert engine.sleep_s(Pace.IDLE, start) == IDLE_S
        engine.linger()
        assert engine.sleep_s(Pace.IDLE, start) == POLL_S
        assert engine.sleep_s(Pace.WRITING, start) == POLL_S
        after_linger = time.monotonic() + LINGER_S + 0.001
        assert engine.sleep_s(Pace.IDLE, after_linger) == IDLE_S, "a last word lingers past LINGER_S"
        engine.notified()
        now = time.monotonic()
        assert engine.sleep_s(Pace.IDLE, now) == POLL_S
        assert engine.sleep_s(Pace.IDLE, now + LINGER_S + 0.001) == NOTIFY_POLL_S
        assert engine.sleep_s(Pace.URGENT, now + LINGER_S + 0.001) == POLL_S, "a window never slows a source"
        assert engine.sleep_s(Pace.IDLE, now + NOTIFY_PROGRESS_S + 0.001) == IDLE_S
        calls = agent.calls
        deadline = time.monotonic() + 10.0
        while agent.calls < calls + 3 and time.monotonic() < deadline:  # the thread runs on these windows
            time.sleep(0.01)
        assert agent.calls >= calls + 3, "the engine's thread stopped progressing NIXL"
    finally:
        engine.close()


def test_closing_stops_every_source_waits_out_their_writes_then_each_drops_what_is_left() -> None:
    engine = WriteEngine(SimpleNamespace(progress=lambda: None), None)  # type: ignore[arg-type]
    writing, idle = Recorder(Pace.WRITING, busy_after_stop=5), Recorder(Pace.IDLE)
    engine.attach(writing)
    engine.attach(idle)
    time.sleep(0.05)
    engine.close()
    assert not engine.thread.is_alive()
    assert writing.busy_after_stop == 0, "the engine stopped before the stopped source's WRITEs ended"
    for source in (writing, idle):
        assert source.events[-1] == "drop_all" and source.events.count("drop_all") == 1
        assert source.events[0] == "stopping", source.events
    turns = writing.count()
    engine.close()  # idempotent
    assert writing.count() == turns and writing.events.count("drop_all") == 1


def test_the_window_rule_is_passed_at_its_deadline() -> None:
    assert not past_window(10.0, 9.999)
    assert past_window(10.0, 10.0)
    assert past_window(10.0, 10.5)
