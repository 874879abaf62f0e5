"""Where a side-channel request's time goes: the server's and the client's timing log, and the fence
questions' times in a pull's stats line; a reply that came in time is taken however late its asker looks."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import handshake.client as client
from handshake import Destination, HandshakeServer, HoldLink, HoldStatus, query_holds
from tests.handshake_support import make_agent_info
from tests.p2p_harness import DecodeSide, PrefillProc, free_port, pull_task

HOST = "127.0.0.1"
SECRET = b"side-channel-timing-secret"
ENGINE = "prefill-engine"  # make_agent_info's


@pytest.fixture
def inproc_server() -> Iterator[HandshakeServer]:
    srv = HandshakeServer(HOST, 0, "compat-test", secret=SECRET, on_heartbeat=lambda ids, s, b: HoldStatus())
    srv.set_info(make_agent_info(0))
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def ask(port: int, link: HoldLink, timeout_s: float = 5.0) -> None:
    query_holds(Destination(HOST, port, ENGINE, 0), ["r-1"], [[1, 2]], "decode-engine", 10.0, secret=SECRET,
                timeout_s=timeout_s, link=link)


def test_both_sides_log_each_requests_times_at_debug(inproc_server: HandshakeServer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """One fence question: the server logs its receive, checks, handler and reply times, the client its send and
    reply, both naming the request by the same nonce prefix; with DEBUG off neither logs a line."""
    link = HoldLink(HOST, inproc_server.port, SECRET)
    try:
        caplog.set_level(logging.INFO, logger="p2pkv.handshake.timing")
        ask(inproc_server.port, link)
        time.sleep(0.2)  # the server logs (or not) just after it sent the reply
        assert not [r for r in caplog.records if r.name == "p2pkv.handshake.timing"]
        caplog.set_level(logging.DEBUG, logger="p2pkv.handshake.timing")
        ask(inproc_server.port, link)
        end = time.monotonic() + 5  # the server logs after sending: maybe just after the client's line
        while len([r for r in caplog.records if r.name == "p2pkv.handshake.timing"]) < 2 and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        link.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pkv.handshake.timing"]
    replied = [m for m in lines if re.search(r"side channel tcp://\S+: reply to [0-9a-f]{8} after", m)]
    assert len(replied) == 1, lines
    nonce = replied[0].split("reply to ")[1].split()[0]
    served = [m for m in lines if m.startswith(f"side channel served hold_query {nonce}:")]
    assert len(served) == 1, lines
    for part in ("on the wire and queued", "checks", "handler", "reply sent", "received at"):
        assert part in served[0], served[0]


def test_a_reply_that_came_in_time_is_taken_when_its_asker_looks_late(inproc_server: HandshakeServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The asking thread is descheduled across its deadline (a busy host): the reply, in its socket since long
    before the deadline, answers the question (before: the thread saw the deadline passed and reported no
    reply without looking)."""
    link = HoldLink(HOST, inproc_server.port, SECRET)
    try:
        ask(inproc_server.port, link)  # connected and authenticated
        real, me = time.monotonic, threading.get_ident()
        calls = {"n": 0}

        def late_clock() -> float:
            if threading.get_ident() != me:
                return real()
            calls["n"] += 1
            if calls["n"] == 2:  # the first look after sending: the thread ran again only past its deadline
                time.sleep(0.3)
                return real() + 10.0
            return real()

        monkeypatch.setattr(client.time, "monotonic", late_clock)
        ask(inproc_server.port, link, timeout_s=1.0)
        assert calls["n"] >= 2
    finally:
        monkeypatch.undo()
        link.close()


def test_a_reply_to_a_requester_gone_is_counted_not_lost_unseen(inproc_server: HandshakeServer,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A requester that stopped waiting and closed its connection before the reply: the server counts and logs
    the reply it could not deliver (before, ZMQ dropped it without a word)."""
    caplog.set_level(logging.WARNING, logger="p2pkv.handshake")
    release = threading.Event()
    def busy(ids, s, b):  # type: ignore[no-untyped-def]  # a busy handler
        return (release.wait(5.0), HoldStatus())[1]

    inproc_server._dispatch._holds._on_heartbeat = busy
    link = HoldLink(HOST, inproc_server.port, SECRET)
    try:
        with pytest.raises(Exception, match="no reply"):
            ask(inproc_server.port, link, timeout_s=0.3)
    finally:
        link.close()
    time.sleep(1.0)  # the server's ZMQ notices the closed connection
    release.set()
    end = time.monotonic() + 5
    while not inproc_server.stats.get("replies_dropped") and time.monotonic() < end:
        time.sleep(0.01)
    assert inproc_server.stats.get("replies_dropped") == 1
    assert any("handshake reply dropped" in r.getMessage() for r in caplog.records)


def test_a_pulls_stats_line_has_its_fence_questions_times(tmp_path: Path) -> None:
    """A pull's line in ``stats_file``: both fence questions, each queued, sent and answered in that order."""
    stats = tmp_path / "pulls.jsonl"
    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0)
    pf.start()
    d = DecodeSide(64, stats_file=str(stats), handshake_timeout_s=2.0)
    try:
        pf.lease(["p-timed"])
        d.start(pull_task("d-timed", "p-timed", pf.port, [1, 2], [3, 4]))
        assert d.pump({"d-timed"}, 20.0) == set() and d.take_errors() == set()
    finally:
        d.close()
        pf.stop()
    (line,) = [json.loads(x) for x in stats.read_text().splitlines()]
    questions = line["fence"]
    assert {q["phase"] for q in questions} == {"before", "after"}, questions
    for q in questions:
        assert q["answer"] == "held" and q["queued"] <= q["sent"] <= q["answered"], q
    after = next(q for q in questions if q["phase"] == "after")
    assert line["marks"]["read"] <= after["queued"] and after["answered"] <= line["marks"]["confirmed"] + 0.01

