"""Push mode on the wire: the "pushed"/"push_failed" NIXL notification codec, and a :class:`handshake.PushRequest`
against real side-channel servers, checked by a real :class:`p2pkv.prefill.pusher.Pusher` over real NIXL agents
(two agents in this process, UCX over loopback).

A push request that is refused must queue nothing: no pin on the hold, nothing pending, no byte written, no
notification sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch
import zmq

from handshake import (
    PROTOCOL_VERSION,
    AgentInfo,
    Destination,
    ErrorReply,
    HandshakeServer,
    PushReply,
    PushRequest,
    RemoteRefusedError,
    decode,
    encode,
    request_push,
)
from handshake._net import configure_socket
from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
from p2pkv.notification import PUSH_PREFIX, PushedNotification, encode_pushed, parse_pushed
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.write_engine import WriteEngine
from tests.handshake_support import make_agent_info
from tests.p2p_harness import writes_left
from tests.push_support import DECODE, ENGINE, HOST, KEY, NUM_BLOCKS, Agents, decode_info_of, descs, side_channel

PID = bytes(range(16))


# ---- the notification codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [None, KEY], ids=["open", "signed"])
@pytest.mark.parametrize("note", [
    PushedNotification(PID, True),
    PushedNotification(os.urandom(32), True),
    PushedNotification(PID, False, "WRITE failed: peer gone"),
    PushedNotification(PID, False, "a | bar, a # hash and non-ASCII é"),
    PushedNotification(PID, False, ""),
], ids=["ok", "ok_32_bytes", "failed", "failed_odd_reason", "failed_no_reason"])
def test_pushed_round_trips(note: PushedNotification, secret: bytes | None) -> None:
    wire = encode_pushed(note, secret)
    assert wire.startswith(PUSH_PREFIX)
    assert parse_pushed(wire, secret) == note


def test_a_long_reason_is_cut_to_200_characters() -> None:
    got = parse_pushed(encode_pushed(PushedNotification(PID, False, "x" * 5000), KEY), KEY)
    assert got == PushedNotification(PID, False, "x" * 200)


def test_an_ok_note_carries_no_reason() -> None:
    assert parse_pushed(encode_pushed(PushedNotification(PID, True, "ignored"))) == PushedNotification(PID, True)


@pytest.mark.parametrize("note", [PushedNotification(PID, True), PushedNotification(PID, False, "why")],
                         ids=["ok", "failed"])
def test_the_mac_is_checked(note: PushedNotification) -> None:
    signed = encode_pushed(note, KEY)
    assert parse_pushed(signed, b"another secret") is None
    assert parse_pushed(encode_pushed(note), KEY) is None, "an unsigned note must not count"
    other_id = signed.replace(PID, bytes(16))
    assert other_id != signed and parse_pushed(other_id, KEY) is None, "a tampered push id"
    flipped = encode_pushed(msgspec.structs.replace(note, ok=not note.ok)) + signed[-32:]
    assert parse_pushed(flipped, KEY) is None, "ok turned into failed (or back)"
    assert parse_pushed(signed[:-1], KEY) is None and parse_pushed(signed + b"0", KEY) is None
    assert parse_pushed(signed[:-32], KEY) is None, "MAC stripped"


@pytest.mark.parametrize("body", [
    {"push_id": PID.hex(), "ok": True},  # the id as text
    {"push_id": bytes(8), "ok": True},  # too short
    {"push_id": bytes(33), "ok": True},  # too long
    {"push_id": PID, "ok": "yes"},
    {"push_id": PID, "ok": False, "reason": "x" * 201},
    {"push_id": PID, "ok": True, "extra": 1},
    {"ok": True},
], ids=["hex_id", "short_id", "long_id", "ok_text", "long_reason", "unknown_field", "no_id"])
def test_only_what_the_encoder_makes_is_a_pushed_notification(body: dict) -> None:
    """Strict like the side channel's messages: typed, bounded, nothing unknown or missing."""
    raw = PUSH_PREFIX + msgspec.msgpack.encode(body)
    assert parse_pushed(raw) is None
    assert parse_pushed(raw + hmac.new(KEY, raw, hashlib.sha256).digest(), KEY) is None


@pytest.mark.parametrize("wire", [
    b"", b"p2pkv:done:req|decode:0:1|abc", b"p2pkv:push:", b"p2pkv:pushed:" + PID.hex().encode(),
    b"p2pkv:push_failed:" + PID.hex().encode() + b"|why", b"p2pkv:push:\xff\xfe", b"\x00" * 40,
    b"p2pkv:pushes:" + msgspec.msgpack.encode({"push_id": PID, "ok": True}),
], ids=["empty", "done", "prefix_only", "protocol_8_ok", "protocol_8_failed", "not_msgpack", "zeros", "other_tag"])
@pytest.mark.parametrize("secret", [None, KEY], ids=["open", "signed"])
def test_garbage_parses_to_none(wire: bytes, secret: bytes | None) -> None:
    assert parse_pushed(wire, secret) is None
    if secret:  # a valid MAC over garbage does not make it a note either
        assert parse_pushed(wire + hmac.new(KEY, wire, hashlib.sha256).digest(), secret) is None


# ---- a side channel without push ------------------------------------------------------------------------------
def test_a_server_without_on_push_refuses_naming_the_fix() -> None:
    with side_channel(None, secret=KEY) as srv:
        with pytest.raises(RemoteRefusedError) as info:
            request_push(Destination(HOST, srv.port, ENGINE, 0), "req", [1], PID,
                         make_agent_info(0, engine_id="decode"), b"", b"", 5.0, "decode-engine", secret=KEY,
                         timeout_s=5.0)
        assert (info.value.code, info.value.field) == ("malformed", "type")
        assert "takes no push requests" in str(info.value) and "transfer_mode pull" in str(info.value)
        assert srv.stats["served"] == 0 and srv.stats["refused"] == 1


# ---- replay and destination, like every other request ----------------------------------------------------------
class Recorder:
    """An ``on_push`` that accepts everything and records the request ids it saw."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, msg: PushRequest) -> tuple[str, str]:
        self.seen.append(msg.request_id)
        return "accepted", ""


def push_request(**overrides: object) -> PushRequest:
    """A well-formed push request for rank 0 of ENGINE, sent now, with a fresh nonce."""
    fields: dict = dict(protocol_version=PROTOCOL_VERSION, to_engine_id=ENGINE, to_rank=0, sent_at=time.time(),
                        nonce=os.urandom(16), requester_engine_id="decode-engine", request_id="req", block_ids=[1],
                        push_id=PID, agent=make_agent_info(0, engine_id="decode"), source_rows=b"",
                        target_rows=b"", window_s=5.0)
    fields.update(overrides)
    return PushRequest(**fields)


def exchange(port: int, frames: list[bytes], secret: bytes | None = KEY, timeout_s: float = 5.0) -> list[bytes]:
    """Send ``frames`` on a fresh DEALER (CURVE with ``secret``); the reply frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        configure_socket(sock, HOST, secret=secret)
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000)), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def test_a_replayed_push_request_is_refused_and_queues_nothing_again() -> None:
    recorder = Recorder()
    request = push_request()
    frames = encode(request, KEY)
    with side_channel(recorder, secret=KEY) as srv:
        first = decode(exchange(srv.port, frames), KEY)
        assert isinstance(first, PushReply) and (first.status, first.nonce) == ("accepted", request.nonce)
        again = decode(exchange(srv.port, frames), KEY)
        assert isinstance(again, ErrorReply) and (again.code, again.field, again.nonce) == (
            "replayed", "nonce", request.nonce)
        assert recorder.seen == ["req"], "on_push ran for the replay"


@pytest.mark.parametrize(("overrides", "code", "field"), [
    ({"to_engine_id": "another-engine"}, "wrong_destination", "to_engine_id"),
    ({"to_rank": 1}, "unknown_rank", "to_rank"),
    ({"sent_at": time.time() - 120}, "stale", "sent_at"),
], ids=["other_engine", "other_rank", "stale"])
def test_a_push_request_for_another_destination_or_stale_is_refused(overrides: dict, code: str, field: str) -> None:
    recorder = Recorder()
    with side_channel(recorder, secret=KEY) as srv:
        reply = decode(exchange(srv.port, encode(push_request(**overrides), KEY)), KEY)
        assert isinstance(reply, ErrorReply) and (reply.code, reply.field) == (code, field)
        assert recorder.seen == [] and srv.stats["served"] == 0


# ---- a real Pusher behind the server ------------------------------------------------------------------------------
@dataclass
class Prefill:
    """A prefill rank's push path: its holds, its pusher, its side channel (rank 0 of ENGINE)."""

    holds: PrefillHolds
    pusher: Pusher
    server: HandshakeServer


@pytest.fixture
def push_server(agents: Agents) -> Iterator[Prefill]:
    agents.target.zero_()
    agents.decode.take_notifs(PUSH_PREFIX)  # notes a previous test left
    holds = PrefillHolds(lease_s=30.0)
    pusher = Pusher(WriteEngine(agents.prefill, KEY), holds, agents.layout, max_in_flight=1, max_queued=1)
    with side_channel(pusher.on_push, secret=KEY) as srv:
        try:
            yield Prefill(holds, pusher, srv)
        finally:
            pusher.close()


def ask(pf: Prefill, agents: Agents, request_id: str, block_ids: list[int], source: np.ndarray | bytes,
        target: np.ndarray | bytes, agent: AgentInfo | None = None, push_id: bytes = PID) -> PushReply:
    """Send one push request for ``request_id`` to ``pf``'s side channel."""
    wire = [r if isinstance(r, bytes) else r.astype("<u8").tobytes() for r in (source, target)]
    return request_push(Destination(HOST, pf.server.port, ENGINE, 0), request_id, block_ids, push_id,
                        agent or agents.decode_info, wire[0], wire[1], 5.0, "decode-engine", secret=KEY, timeout_s=5.0)


def wait_note(agents: Agents, timeout_s: float = 10.0, agent: NixlTransferAgent | None = None) -> PushedNotification:
    """The next push notification the decode agent (or ``agent``) receives (parsed with the secret)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for msg in (agent or agents.decode).take_notifs(PUSH_PREFIX):
            note = parse_pushed(msg, KEY)
            assert note is not None, msg
            return note
        time.sleep(0.002)
    raise AssertionError("no push notification arrived")


def blocks_equal(agents: Agents, local: list[int], remote: list[int]) -> bool:
    """The decode cache's blocks ``local`` hold the prefill cache's blocks ``remote``."""
    return all(torch.equal(agents.target[lb], agents.source[rb]) for lb, rb in zip(local, remote, strict=True))


def nothing_queued(pf: Prefill, agents: Agents) -> None:
    """Refused: no pin, nothing pending, no agent loaded, no byte written, no notification (waited for briefly)."""
    assert pf.holds._pins == {} and writes_left(pf.pusher) == 0
    assert pf.pusher.agents() == {} and agents.prefill.peers() == []
    assert pf.pusher.counters.accepted == 0
    time.sleep(0.05)
    assert agents.decode.take_notifs(PUSH_PREFIX) == []
    assert torch.count_nonzero(agents.target) == 0


def test_an_accepted_push_writes_exactly_the_rows_then_notifies_and_unpins(push_server: Prefill,
                                                                           agents: Agents) -> None:
    """Control for the refusals: the same path with good rows writes the bytes, then says so."""
    push_server.holds.hold("req", 1e12, (3, 4, 9))
    reply = ask(push_server, agents, "req", [3, 4, 9], descs(agents.layout, [3, 4, 9]),
                descs(agents.decode_layout, [5, 6, 1]))
    assert reply.status == "accepted", reply
    assert wait_note(agents) == PushedNotification(PID, True)
    assert blocks_equal(agents, [5, 6, 1], [3, 4, 9])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6, 1)]
    assert torch.count_nonzero(agents.target[untouched]) == 0
    end = time.monotonic() + 5
    while push_server.holds._pins and time.monotonic() < end:
        time.sleep(0.002)
    assert push_server.holds._pins == {} and writes_left(push_server.pusher) == 0
    assert (push_server.pusher.counters.written, push_server.pusher.counters.failed) == (1, 0)


BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4  # layers x heads x block_size x 2*head_dim x float32


REFUSALS = [
    ("rows_not_24_bytes", "refused", "[n, 3] rows (24 bytes each)"),
    ("row_counts_differ", "refused", "do not pair up"),
    ("row_lengths_differ", "refused", "do not pair up"),
    ("row_outside_the_hold", "refused", "not inside the held blocks"),
    ("row_of_zero_bytes", "refused", "zero bytes"),
    ("row_beyond_2_62", "refused", "beyond 2**62"),
    ("block_id_past_num_blocks", "refused", f"outside [0, {NUM_BLOCKS})"),
    ("agent_digest_wrong", "refused", "agent:"),
    ("unknown_request", "unknown", ""),
    ("other_block_ids", "not_held", ""),
]


@pytest.mark.parametrize(("case", "status", "named"), REFUSALS, ids=[c for c, _, _ in REFUSALS])
def test_a_refused_push_queues_nothing(push_server: Prefill, agents: Agents, case: str, status: str,
                                       named: str) -> None:
    push_server.holds.hold("req", 1e12, (3, 4))
    src, dst = descs(agents.layout, [3, 4]), descs(agents.decode_layout, [5, 6])
    request_id, block_ids, agent = "req", [3, 4], agents.decode_info
    if case == "rows_not_24_bytes":
        src = src.astype("<u8").tobytes()[:-1]  # type: ignore[assignment]
    elif case == "row_counts_differ":
        dst = np.concatenate([dst, dst])
    elif case == "row_lengths_differ":
        src, dst = src.copy(), dst.copy()
        src[0, 1] = dst[0, 1] = BLOCK_BYTES
        src[0, 1] += 8
    elif case == "row_outside_the_hold":  # block 5 for 4: two rows each side, the second outside the hold
        src, dst = descs(agents.layout, [3, 5]), descs(agents.decode_layout, [5, 7])
    elif case == "row_of_zero_bytes":
        src, dst = src.copy(), dst.copy()
        src[0, 1] = dst[0, 1] = 0
    elif case == "row_beyond_2_62":
        src = src.copy()
        src[0, 0] = 2**63
    elif case == "block_id_past_num_blocks":
        block_ids = [3, NUM_BLOCKS]
    elif case == "agent_digest_wrong":
        agent = AgentInfo(**{**{f: getattr(agent, f) for f in agent.__struct_fields__},
                             "metadata_digest": bytes(len(agent.metadata_digest))})
    elif case == "unknown_request":
        request_id = "never-held"
    elif case == "other_block_ids":
        block_ids, src = [3], descs(agents.layout, [3])
        dst = descs(agents.decode_layout, [5])
    reply = ask(push_server, agents, request_id, block_ids, src, dst, agent)
    assert reply.status == status and named in reply.message, reply
    nothing_queued(push_server, agents)
    assert push_server.pusher.counters.by_status == {status: 1}


def test_a_full_queue_answers_busy_and_pins_only_what_it_queued(push_server: Prefill, agents: Agents) -> None:
    """``max_queued=1`` with the pusher thread held back: the second request is ``busy`` (no pin); once the
    thread runs, the first one is written and its hold unpinned."""
    pusher, holds = push_server.pusher, push_server.holds
    holds.hold("a", 1e12, (1,))
    holds.hold("b", 1e12, (2,))
    pusher._post_in_turn = lambda now: None  # type: ignore[method-assign]
    try:
        first = ask(push_server, agents, "a", [1], descs(agents.layout, [1]), descs(agents.decode_layout, [1]))
        second = ask(push_server, agents, "b", [2], descs(agents.layout, [2]), descs(agents.decode_layout, [2]),
                     push_id=bytes(16))
        assert (first.status, second.status) == ("accepted", "busy") and "already wait" in second.message
        assert holds._pins == {"a": 1} and writes_left(pusher) == 1
    finally:
        del pusher._post_in_turn
    pusher.engine.wake()
    assert wait_note(agents) == PushedNotification(PID, True)
    assert blocks_equal(agents, [1], [1]) and torch.count_nonzero(agents.target[2]) == 0
    end = time.monotonic() + 5
    while holds._pins and time.monotonic() < end:
        time.sleep(0.002)
    assert holds._pins == {} and writes_left(pusher) == 0


@pytest.fixture
def fresh_decode(agents: Agents) -> Iterator[tuple[NixlTransferAgent, AgentInfo]]:
    """A decode agent no prefill agent has ever connected to (the decode cache's memory registered again)."""
    agent = NixlTransferAgent(unique_agent_name(DECODE, 0))
    agent.register(agents.decode_layout.regions, "DRAM")
    try:
        yield agent, decode_info_of(agent, agents.decode_layout)
    finally:
        agent.close()


WINDOW_S = 2.0
"""The late push's window (seconds): long enough for a loaded host's side channel to accept it first."""


def test_a_push_that_misses_its_window_is_dropped_unpinned_and_reported(
        push_server: Prefill, agents: Agents, fresh_decode: tuple[NixlTransferAgent, AgentInfo]) -> None:
    """Queued behind a held-back pusher past its ``window_s``: never written, a "push_failed" note, unpinned,
    and a release that came meanwhile applies once. The decode agent is new to the prefill agent and nothing
    else progresses the prefill agent (no engine steps, no WRITE): the pusher itself must, or UCX's wire-up
    never completes and the note never arrives."""
    pusher, holds = push_server.pusher, push_server.holds
    decode_agent, decode_info = fresh_decode
    holds.hold("late", 1e12, (6,))
    pusher._post_in_turn = lambda now: None  # type: ignore[method-assign]
    try:
        wire = [descs(layout, [6]).astype("<u8").tobytes() for layout in (agents.layout, agents.decode_layout)]
        reply = request_push(Destination(HOST, push_server.server.port, ENGINE, 0), "late", [6], PID, decode_info,
                             wire[0], wire[1], WINDOW_S, "decode-engine", secret=KEY, timeout_s=5.0)
        assert reply.status == "accepted"
        assert holds.on_release(["late"], [[6]]) == 1
        stats = {"leases_expired": 0, "leases_notified": 0}
        assert holds.released([], stats) == set(), "released while a WRITE from it was queued"
        time.sleep(WINDOW_S + 0.1)
    finally:
        del pusher._post_in_turn
    pusher.engine.wake()
    note = wait_note(agents, agent=decode_agent)
    assert note.push_id == PID and not note.ok and "window passed" in note.reason
    assert torch.count_nonzero(agents.target) == 0
    end = time.monotonic() + 5
    while holds._pins and time.monotonic() < end:
        time.sleep(0.002)
    assert holds._pins == {} and pusher.counters.failed == 1
    assert holds.released([], stats) == {"late"} and holds.released([], stats) == set()
