"""The side channel's stall watchdog (``handshake.watchdog.StallWatchdog``): a serving loop that stops turning
is logged once per stall with every thread's stack, and its end with the stall's length."""

from __future__ import annotations

import logging
import time

import pytest

from handshake import Destination, HandshakeServer, send_heartbeat
from handshake.watchdog import StallWatchdog
from tests.clock import FakeClock
from tests.handshake_support import make_agent_info

HOST = "127.0.0.1"


def test_a_stall_is_reported_once_with_stacks_then_its_end(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(100.0)
    dog = StallWatchdog("the loop", stall_s=2.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="p2pkv.handshake"):
        clock.now += 1.9
        assert dog.check() is None  # not late yet
        dog.beat()
        clock.now += 2.5
        assert dog.check() == "stalled"
        clock.now += 10.0
        assert dog.check() is None and dog.stalls == 1  # the same stall: said once
        dog.beat()
        assert dog.check() == "resumed"
        assert dog.check() is None
    warning, info = [r for r in caplog.records if r.name == "p2pkv.handshake"]
    assert warning.levelno == logging.WARNING and "the loop has not turned for 2.5 s (stall_s=2.0)" in warning.message
    assert "test_a_stall_is_reported_once_with_stacks_then_its_end" in warning.message  # this thread's stack
    assert info.levelno == logging.INFO and "the loop turned again after 12.5 s" in info.message


def test_stall_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        StallWatchdog("the loop", stall_s=0.0)
    with pytest.raises(ValueError, match="stall_s"):
        HandshakeServer(HOST, 0, "compat", stall_s=-1.0)


def blocking_heartbeat_handler(ids: list[str], extend_s: float, blocks: list[list[int]]) -> None:
    """A heartbeat handler that holds the side channel's thread for 1.5 s."""
    time.sleep(1.5)


def test_a_side_channel_blocked_in_a_handler_is_named_with_its_stack(caplog: pytest.LogCaptureFixture) -> None:
    """The serving thread blocked in a handler: the warning shows where it waits; the loop then turns again
    and keeps answering."""
    with (
        caplog.at_level(logging.INFO, logger="p2pkv.handshake"),
        HandshakeServer(HOST, 0, "compat-test", on_heartbeat=blocking_heartbeat_handler, stall_s=0.4) as server,
    ):
        server.set_info(make_agent_info(0))
        to = Destination(HOST, server.port, "prefill-engine", 0)
        reply = send_heartbeat(to, ["r1"], "decode", 30.0, timeout_s=5.0)
        assert reply.accepted == 1
        deadline = time.monotonic() + 5.0
        while "turned again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        stalls = [r.message for r in caplog.records if "has not turned" in r.message]
        assert "turned again after" in caplog.text
        assert send_heartbeat(to, ["r2"], "decode", 30.0, timeout_s=5.0).accepted == 1  # still serving
    assert len(stalls) == 1, stalls  # one warning for the 1.5 s stall, however often the watchdog looked
    assert f"the side channel on tcp://{HOST}:{server.port}" in stalls[0]
    assert "blocking_heartbeat_handler" in stalls[0] and "time.sleep(1.5)" in stalls[0]
