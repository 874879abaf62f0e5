"""The registry of the ways KV moves (``p2pkv.ways``) agrees with the decode side's ``Direction`` and ``movers()``,
with the prefill worker's handler wiring and with the side-channel server's handler table; the lifecycle asks a
way's traits, never which way a transfer moves."""

from __future__ import annotations

import inspect
import os
import re
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from handshake import HandshakeServer, messages
from handshake.errors import MalformedMessageError
from handshake.hold_answers import HoldStatus
from p2pkv.decode.direction import Direction
from p2pkv.decode.movers import Mover, movers
from p2pkv.decode.transfer import Transfer, way_of
from p2pkv.metadata import LoadSpec
from p2pkv.params import RemotePrefill
from p2pkv.ways import PULL, PUSH, STREAM, WAYS, Way
from p2pkv.worker import way_handlers

ROOT = Path(__file__).resolve().parents[1]
SHARED = {messages.MetadataRequest, messages.LeaseHeartbeat, messages.ReleaseHolds}
"""Requests every way sends or none does: an engine's metadata at the handshake, lease heartbeats, releases."""

TRANSFER_TRAITS = ("notifies_done", "retried", "lasts_prefill", "watched", "given_up_at_request_end")
"""The traits the lifecycle asks of a whole transfer (:attr:`p2pkv.decode.transfer.Transfer.way`)."""


def test_one_direction_per_way() -> None:
    assert [d.value for d in Direction] == list(WAYS)
    assert all(d.way is WAYS[d.value] and d.way.name == d.value for d in Direction)
    assert (Direction.PULL.way, Direction.PUSH.way, Direction.STREAM.way) == (PULL, PUSH, STREAM)


def test_movers_builds_the_class_each_way_names() -> None:
    """One mover per direction, of the class its way names; a request the pushes send again goes by the mover of
    its part's direction (a stream request as a stream request, not as a push)."""
    pushes = SimpleNamespace()
    built = movers(None, None, None, pushes, 1.0)  # type: ignore[arg-type]
    assert set(built) == set(Direction)
    for direction, mover in built.items():
        assert isinstance(mover, Mover) and type(mover).__name__ == direction.way.mover
        assert mover.direction is direction
    assert pushes.posters == {d.value: built[d].post for d in (Direction.PUSH, Direction.STREAM)}


def test_each_request_belongs_to_one_way_and_the_server_serves_them_all() -> None:
    owned = [r for way in WAYS.values() for r in way.requests]
    assert len(owned) == len(set(owned)) and not set(owned) & SHARED
    server = HandshakeServer("127.0.0.1", 0, "compat", secret=b"k" * 32)
    assert set(server._dispatch.handlers) == set(owned) | SHARED


def test_each_handler_is_a_server_keyword_and_the_worker_passes_one_per_way() -> None:
    keywords = inspect.signature(HandshakeServer).parameters
    assert all(way.handler in keywords for way in WAYS.values())
    assert len({way.handler for way in WAYS.values()}) == len(WAYS)
    pusher, streams = types.SimpleNamespace(on_push=object()), types.SimpleNamespace(on_heartbeat=object(),
                                                                                     on_stream=object())
    handlers = way_handlers(pusher, streams)  # type: ignore[arg-type]
    assert handlers == {"on_heartbeat": streams.on_heartbeat, "on_push": pusher.on_push,
                        "on_stream": streams.on_stream}


def _request(kind: type[messages.Request]) -> Any:
    """A request of ``kind`` as far as its handler reads it (a real fence question; the others only pass through)."""
    head = {"protocol_version": messages.PROTOCOL_VERSION, "to_engine_id": "prefill", "to_rank": 0,
            "sent_at": time.time(), "nonce": os.urandom(16), "requester_engine_id": "decode"}
    if kind is messages.HoldQuery:
        return messages.HoldQuery(**head, request_ids=["r"], block_ids=[[1]], extend_s=5.0)
    return types.SimpleNamespace(**head)


@pytest.mark.parametrize("name", list(WAYS))
def test_a_ways_requests_reach_the_handler_it_names_and_only_it(name: str) -> None:
    way: Way = WAYS[name]
    seen: list[object] = []

    def handler(*args: object) -> object:
        seen.append(args)
        return HoldStatus() if way is PULL else ("accepted", "")

    served = HandshakeServer("127.0.0.1", 0, "compat", secret=b"k" * 32, **{way.handler: handler})
    bare = HandshakeServer("127.0.0.1", 0, "compat", secret=b"k" * 32)
    for kind in way.requests:
        served._dispatch.handlers[kind](_request(kind), None)
        with pytest.raises(MalformedMessageError, match=r"takes no|holds no"):
            bare._dispatch.handlers[kind](_request(kind), None)
    assert len(seen) == len(way.requests)


def test_pull_and_push_agree_on_what_is_asked_of_a_whole_transfer() -> None:
    """A transfer whose parts' ways are chosen as they start (pull or push) is asked pull's traits."""
    assert all(getattr(PULL, t) == getattr(PUSH, t) for t in TRANSFER_TRAITS)
    remote = RemotePrefill("p", "s", "127.0.0.1", 1, (), 1)
    assert way_of(LoadSpec("r", (1,), (1,), remote)) is PULL
    streamed = Transfer.taken(LoadSpec("r", (1,), (), remote, stream_grant="g"))
    assert streamed.fixed is Direction.STREAM and streamed.way is STREAM
    assert Transfer.taken(LoadSpec("r", (1,), (1,), remote)).fixed is None


def test_the_lifecycle_never_asks_for_a_stream_grant() -> None:
    """Only the stream way's own modules and the scheduler's load building name the grant on the decode side."""
    naming = sorted(p.name for p in (ROOT / "p2pkv" / "decode").glob("*.py") if re.search(r"\bstream_grant\b",
                                                                                          p.read_text()))
    assert set(naming) <= {"stream_parts.py", "stream_watch.py", "load_scheduling.py"}, naming
