"""What a connection may cost a side-channel server before its CURVE handshake completes, and how many there
may be: hostile raw TCP peers (tests/side_channel_flood.py) against a real in-process server on 127.0.0.1.

Before these limits a peer offering CURVE could announce a 31 MiB HELLO (under the 32 MiB frame limit) and
hold it for libzmq's default 30 s handshake time, and any number of peers could: 16 of them held 497 MiB of
the server. Now a frame is at most FRAME_LIMIT bytes, a handshake at most ``handshake_s`` seconds, and the
connections not past their HELLO at most ``max_handshakes`` (the oldest are cut), all connections at most
``max_connections`` (the newest are cut).
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Iterator

import pytest

from handshake import Destination, HandshakeServer, HandshakeTimeoutError, HoldLink, fetch_agent_info, query_holds
from handshake._net import FRAME_LIMIT
from tests.handshake_support import make_agent_info
from tests.polling import eventually
from tests.side_channel_flood import is_closed, open_hostile

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"side-channel-limits-test"
ENGINE = "prefill-engine"  # make_agent_info's engine id


@contextlib.contextmanager
def serving(**options: float) -> Iterator[HandshakeServer]:
    """An in-process CURVE server of rank 0 of ENGINE that takes heartbeats, with ``options``."""
    srv = HandshakeServer(HOST, 0, COMPAT, secret=SECRET, on_heartbeat=lambda ids, s, b: None,
                          **options)  # type: ignore[arg-type]
    srv.set_info(make_agent_info(0))
    with srv:
        yield srv


@contextlib.contextmanager
def hostile(port: int, n: int, kind: str = "idle", hello_bytes: int = 0) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            socks.append(open_hostile(port, kind, hello_bytes))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def fetch(port: int, timeout_s: float = 5.0) -> object:
    return fetch_agent_info(Destination(HOST, port, ENGINE, 0), "decode-engine", COMPAT, secret=SECRET,
                            timeout_s=timeout_s, retries=1)


def ask(link: HoldLink, timeout_s: float = 5.0) -> int:
    """A fence question over ``link`` (a long-lived connection); how many ids the server took."""
    return query_holds(Destination(HOST, link.port, ENGINE, 0), ["r1"], [[1]], "decode-engine", 10.0, secret=SECRET,
                       timeout_s=timeout_s, link=link).accepted


wait_for = functools.partial(eventually, timeout_s=10.0, interval_s=0.02)


def test_a_frame_over_the_frame_limit_is_dropped_before_the_handshake() -> None:
    """A HELLO announced one byte over FRAME_LIMIT (the old limit was 32 MiB) is cut as its header arrives;
    one just under it is buffered, and the server still answers."""
    with serving() as srv, hostile(srv.port, 1, "hello", FRAME_LIMIT + 1) as over, \
            hostile(srv.port, 1, "hello", FRAME_LIMIT - 64) as under:
        assert wait_for(lambda: is_closed(over[0])), "a frame over the limit was not dropped"
        assert fetch(srv.port) == make_agent_info(0)
        assert not is_closed(under[0])


def test_a_peer_that_never_completes_the_handshake_is_disconnected() -> None:
    """After ``handshake_s`` (libzmq's ZMQ_HANDSHAKE_IVL; its default was 30 s), whether it sent only the
    greeting or is in the middle of a HELLO."""
    with serving(handshake_s=0.5) as srv, hostile(srv.port, 2) as idle, \
            hostile(srv.port, 1, "hello", FRAME_LIMIT - 64) as slow:
        assert wait_for(lambda: all(is_closed(s) for s in idle + slow), timeout_s=10.0)
        assert fetch(srv.port) == make_agent_info(0)
        assert srv.stats.get("connections_cut", 0) == 0  # libzmq's handshake timer, not the caps


def test_connections_beyond_max_handshakes_are_cut_oldest_first_and_honest_clients_answered() -> None:
    """16 hostile connections against max_handshakes 8: the 8 oldest are cut at once; honest clients are
    answered meanwhile, on a connection made before (a fence link, past its HELLO: never cut) and on fresh
    ones (each pushes the oldest hostile connection out)."""
    with serving(max_handshakes=8) as srv:
        link = HoldLink(HOST, srv.port, SECRET)
        try:
            assert ask(link) == 1
            with hostile(srv.port, 16, "hello", 64 * 1024) as socks:
                assert wait_for(lambda: sum(is_closed(s) for s in socks) >= 8)
                time.sleep(0.2)
                closed = [is_closed(s) for s in socks]
                assert closed == [True] * 8 + [False] * 8, closed
                for _ in range(3):
                    assert fetch(srv.port) == make_agent_info(0)
                assert ask(link) == 1
                # each honest connection, while not past its HELLO, made the oldest hostile one the 9th
                assert srv.stats["connections_cut_handshaking"] >= 8
        finally:
            link.close()


def test_honest_clients_are_answered_while_16_hostile_connections_hold_a_hello() -> None:
    """16 peers each holding a HELLO just under the frame limit (the most each may cost) under the default
    limits: every honest request is answered."""
    with serving() as srv, hostile(srv.port, 16, "hello", FRAME_LIMIT - 64) as socks:
        for _ in range(5):
            assert fetch(srv.port) == make_agent_info(0)
        assert not any(is_closed(s) for s in socks)


def test_peers_beyond_max_connections_are_not_served() -> None:
    """max_connections 3: three long-lived authenticated connections are served; a fourth is cut (its
    request is never answered), the three still are; once one closes, a new one is served."""
    with serving(max_connections=3, max_handshakes=3) as srv:
        links = [HoldLink(HOST, srv.port, SECRET) for _ in range(3)]
        try:
            for link in links:
                assert ask(link) == 1
            with pytest.raises(HandshakeTimeoutError):
                fetch(srv.port, timeout_s=1.0)
            assert srv.stats["connections_cut"] >= 1
            for link in links:
                assert ask(link) == 1
            links.pop().close()
            assert wait_for(lambda: srv._limits is not None and srv._limits.connections < 3)
            assert fetch(srv.port) == make_agent_info(0)
        finally:
            for link in links:
                link.close()


@pytest.mark.parametrize(("options", "message"), [
    ({"max_connections": 0}, "max_connections"), ({"max_handshakes": 0}, "max_handshakes"),
    ({"max_connections": 4, "max_handshakes": 8}, "max_handshakes"), ({"handshake_s": 0.0}, "handshake_s"),
])
def test_limits_are_checked(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HandshakeServer(HOST, 0, COMPAT, secret=SECRET, **options)  # type: ignore[arg-type]
