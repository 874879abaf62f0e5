"""The "done" notification codec and the prefill holds' answers to fence questions and releases."""

from __future__ import annotations

import hashlib
import hmac
from types import SimpleNamespace

import msgspec
import pytest

from p2pkv.notification import (
    MAX_NOTIFICATION_BYTES,
    PREFIX,
    DoneNotification,
    blocks_digest,
    encode_done,
    parse_done,
)
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.telemetry.stats import empty_stats

KEY = b"secret"


def test_notification_round_trip_and_mac() -> None:
    note = DoneNotification("req-1", "decode:1", 2, blocks_digest([4, 5, 6]))
    assert parse_done(encode_done(note)) == note
    signed = encode_done(note, KEY)
    assert parse_done(signed, KEY) == note
    assert parse_done(encode_done(note), KEY) is None, "an unsigned notification must not count"
    assert parse_done(signed, b"other") is None
    recount = encode_done(msgspec.structs.replace(note, notifiers=1))[len(PREFIX):]
    assert parse_done(PREFIX + recount + signed[-32:], KEY) is None, "a tampered count must not count"
    tampered = signed.replace(blocks_digest([4, 5, 6]).encode(), blocks_digest([4, 5, 7]).encode())
    assert tampered != signed and parse_done(tampered, KEY) is None, "a tampered block digest must not count"
    assert parse_done(signed[:-1], KEY) is None and parse_done(signed + b"0", KEY) is None
    assert parse_done(b"something else", KEY) is None


GOOD = {"request_id": "r", "reader": "decode:1", "notifiers": 2, "blocks": blocks_digest([1])}


@pytest.mark.parametrize("body", [
    b"r|decode:1:2|" + blocks_digest([1]).encode(),  # the text format of protocol 8
    msgspec.msgpack.encode("r"),  # not a map
    msgspec.msgpack.encode({**GOOD, "notifiers": "2"}),  # a count that is not a number
    msgspec.msgpack.encode({**GOOD, "notifiers": 0}),  # no notifier
    msgspec.msgpack.encode({**GOOD, "notifiers": -1}),
    msgspec.msgpack.encode({**GOOD, "notifiers": 1 << 40}),
    msgspec.msgpack.encode({**GOOD, "blocks": "not a digest"}),
    msgspec.msgpack.encode({**GOOD, "request_id": ""}),
    msgspec.msgpack.encode({**GOOD, "request_id": "r" * 257}),
    msgspec.msgpack.encode({**GOOD, "extra": 1}),  # an unknown field
    msgspec.msgpack.encode({k: v for k, v in GOOD.items() if k != "request_id"}),  # a missing one
    msgspec.msgpack.encode(GOOD) + b"\x00",  # trailing bytes
    b"",
])
def test_only_what_the_encoder_makes_is_a_done_notification(body: bytes) -> None:
    """Bodies nothing sends free nothing, signed or not: every field typed and bounded, none unknown or
    missing (the same strictness as the side channel's messages)."""
    assert parse_done(PREFIX + msgspec.msgpack.encode(GOOD)) == DoneNotification(**GOOD)  # the control
    assert parse_done(PREFIX + body) is None
    signed = PREFIX + body
    signed += hmac.new(KEY, signed, hashlib.sha256).digest()
    assert parse_done(signed, KEY) is None, "signed, and still not what the encoder makes"


def test_an_oversized_notification_is_dropped_before_its_mac_is_checked() -> None:
    note = DoneNotification("r" * 256, "d" * 512, 2, blocks_digest([1]))
    assert parse_done(encode_done(note, KEY), KEY) == note  # the largest valid one fits
    huge = PREFIX + b"x" * MAX_NOTIFICATION_BYTES
    assert parse_done(huge + hmac.new(KEY, huge, hashlib.sha256).digest(), KEY) is None


@pytest.mark.parametrize("blocks", [blocks_digest([4, 5, 6]), ""], ids=["digest", "no_digest"])
def test_request_id_with_bars_round_trips(blocks: str) -> None:
    """Request ids are chosen by clients (vLLM takes them from the X-Request-Id header) and may contain "|",
    "#" or ":" (no separator in the wire format to confuse)."""
    note = DoneNotification("req|with#bars:", "decode:1", 2, blocks)
    assert parse_done(encode_done(note)) == note
    assert parse_done(encode_done(note, KEY), KEY) == note


def test_holds_answer_fence_questions() -> None:
    holds = PrefillHolds(lease_s=30.0)
    holds.hold("held", 1e12, (4, 5, 6))
    holds.hold("gone", 1e12, (7,))
    stats = empty_stats()
    # Done notifications free a hold only when they name the digest of its block ids.
    assert holds.released([DoneNotification("gone", blocks=blocks_digest([8]))], stats) == set()
    assert holds.released([DoneNotification("gone", blocks=blocks_digest([7]))], stats) == {"gone"}
    status = holds.on_heartbeat(["held", "gone", "never", "held"], 10.0, [[4, 5], [7], [1], [4, 9]])
    assert status.not_held == ["gone", "held"] and status.unknown == ["never"] and status.expired == []
    assert holds.on_heartbeat(["held"], 10.0, []).not_held == []  # no block ids asked: held
    # A release frees a hold only when it names exactly the hold's block ids (not a subset, not others).
    assert holds.on_release(["held", "never"], [[4, 5], [1]]) == 0
    assert holds.on_release(["held"], [[4, 5, 6, 7]]) == 0
    assert holds.released([], stats) == set()
    assert holds.on_release(["held", "never"], [[4, 5, 6], [1]]) == 1
    assert holds.released([], stats) == {"held"}
    assert holds.on_heartbeat(["held"], 10.0, [[4]]).not_held == ["held"]  # released: remembered


def test_expired_hold_is_reported_expired() -> None:
    holds = PrefillHolds(lease_s=30.0)
    holds.hold("short", 0.0, (1,))
    assert holds.released([], empty_stats()) == {"short"}
    assert holds.on_heartbeat(["short"], 10.0, [[1]]).expired == ["short"]


def test_notifications_must_agree_on_the_notifier_count() -> None:
    holds = PrefillHolds(lease_s=30.0)
    holds.hold("r", 1e12)
    stats = empty_stats()
    assert holds.released([DoneNotification("r", "d:0", 2)], stats) == set()
    assert holds.released([DoneNotification("r", "x:9", 1)], stats) == set(), "a count of 1 must not end a hold of 2"
    assert holds.released([DoneNotification("r", "d:1", 2)], stats) == {"r"}


def test_scheduler_hooks_never_raise() -> None:
    """An unexpected exception in a scheduler hook is contained: local prefill, a failed pull, or freed blocks."""
    pytest.importorskip("vllm")
    from p2pkv.connector import P2pKvConnector

    def boom(*_: object) -> None:
        raise RuntimeError("bug")

    failed: list[str] = []
    scheduler = SimpleNamespace(get_num_new_matched_tokens=boom, on_new_request=boom, update_state_after_alloc=boom,
                                request_finished_all_groups=boom,
                                fail_load=lambda r, b, n: failed.append(r.request_id))
    conn = SimpleNamespace(scheduler=scheduler)
    conn.request_finished_all_groups = lambda r, b: P2pKvConnector.request_finished_all_groups(conn, r, b)
    request = SimpleNamespace(request_id="r1", kv_transfer_params={"do_remote_prefill": True})
    assert P2pKvConnector.get_num_new_matched_tokens(conn, request, 0) == (0, False)
    assert request.kv_transfer_params["do_remote_prefill"] is False
    P2pKvConnector.on_new_request(conn, request)
    P2pKvConnector.update_state_after_alloc(conn, request, None, 3)
    assert failed == ["r1"]
    assert P2pKvConnector.request_finished(conn, request, [1, 2]) == (False, None)
    assert P2pKvConnector.request_finished_all_groups(conn, request, ([1, 2], [0, 3])) == (False, None)
