"""A prefill hold is freed only for its own block ids: forged releases and "done"s free nothing.

Whoever reaches the decode engine's HTTP API once made the decode worker
release another request's hold by naming that request's id with other
block ids (the failed pull's release, a notify-only pull's "done").
"""

from __future__ import annotations

from p2pkv.notification import DoneNotification, blocks_digest, encode_done, parse_done
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.telemetry.stats import empty_stats

KEY = b"a-side-channel-secret-of-32-byte"


def test_release_frees_only_a_hold_with_exactly_those_block_ids() -> None:
    holds = PrefillHolds(lease_s=30.0)
    holds.hold("victim", 1e12, (4, 5, 6))
    stats = empty_stats()
    assert holds.on_release(["victim"], [[4, 5]]) == 0, "a subset of the blocks"
    assert holds.on_release(["victim"], [[4, 5, 6, 7]]) == 0, "a superset"
    assert holds.on_release(["victim"], [[1, 2, 3]]) == 0, "another request's blocks"
    assert holds.released([], stats) == set()
    assert holds.on_heartbeat(["victim"], 10.0, [[4, 5, 6]]).not_held == [], "still held"
    assert holds.on_release(["victim", "never"], [[6, 5, 4], [1]]) == 1
    assert holds.released([], stats) == {"victim"}


def test_done_frees_only_with_the_digest_of_the_held_block_ids() -> None:
    holds = PrefillHolds(lease_s=30.0)
    holds.hold("victim", 1e12, (4, 5, 6))
    stats = empty_stats()
    forged = [DoneNotification("victim", "d:0", 1, blocks_digest((1, 2, 3))), DoneNotification("victim", "d:1", 1)]
    for note in forged:
        assert holds.released([note], stats) == set()
        assert holds.on_heartbeat(["victim"], 10.0, [[4, 5, 6]]).not_held == []
    assert holds.released([DoneNotification("victim", "d:0", 1, blocks_digest((4, 5, 6)))], stats) == {"victim"}


def test_digest_travels_signed_in_the_notification() -> None:
    note = DoneNotification("cmpl-1-0", "decode-engine:0", 2, blocks_digest((9, 8)))
    wire = encode_done(note, KEY)
    assert parse_done(wire, KEY) == note
    assert parse_done(wire.replace(note.blocks.encode(), blocks_digest((9,)).encode()), KEY) is None
    assert blocks_digest((1, 2)) != blocks_digest((2, 1)) != blocks_digest((12,))
