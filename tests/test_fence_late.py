"""A fence question answered late: the reply to the first question after the READ comes only while the
question asked again waits (a prefill side channel, or its host, slower than the timeout once in a while).

Before, the question asked again was a new call that skipped the first question's reply as an answer to
another request, and its own reply came as late: the prefill rank said "held" twice and the pull failed
``unconfirmed``. Now both are one call, and a reply to either answers it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from handshake import PROTOCOL_VERSION, HoldQuery, HoldsReply, encode
from handshake import decode as decode_message
from tests.fault_injection.support import fake_side_channel, real_reply
from tests.p2p_harness import DecodeSide, PrefillProc, pull_task

TIMEOUT_S = 1.0
LATE_S = 1.4  # past one timeout, well within two


@contextlib.contextmanager
def late_fence_side_channel(pf: PrefillProc) -> Iterator[tuple[int, list[list[bytes]]]]:
    """A side channel (:func:`tests.fault_injection.support.fake_side_channel`) with ``pf``'s real metadata,
    answering at once, that answers every fence question "held", :data:`LATE_S` after it came. Yields
    ``(port, requests seen)``."""
    metadata = real_reply(pf)

    def respond(body: list[bytes]) -> list[bytes]:
        msg = decode_message(body, None)
        if not isinstance(msg, HoldQuery):
            return metadata(body)
        return encode(HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=len(msg.request_ids),
                                 request_ids=msg.request_ids, nonce=msg.nonce), None)

    def delay(body: list[bytes]) -> float:
        return LATE_S if isinstance(decode_message(body, None), HoldQuery) else 0.0

    with fake_side_channel(respond, delay) as channel:
        yield channel


def test_a_late_reply_to_the_first_question_after_the_read_confirms_the_pull(
        prefill: PrefillProc, caplog: pytest.LogCaptureFixture) -> None:
    """Every fence answer comes 1.4 s after its question, the timeout is 1 s: the pull is confirmed by the
    reply to its first question after the READ, and moves the prefill bytes."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, handshake_timeout_s=TIMEOUT_S, handshake_attempts=1, transfer_timeout_s=10.0,
                   transfer_mode="pull")
    try:
        prefill.lease(["p-late"])
        with late_fence_side_channel(prefill) as (port, seen):
            d.start(pull_task("d-late", "p-late", port, [3, 4], [5, 6]))
            assert d.pump({"d-late"}, 15.0) == set(), "the pull hung"
        failures = [r.getMessage() for r in caplog.records if "pull failed" in r.getMessage()]
        assert failures == [] and d.take_errors() == set(), failures
        assert all(d.block_ok(lb, rb, prefill.expected()) for lb, rb in ((3, 5), (4, 6)))
        kinds = [type(decode_message(body, None)).__name__ for body in seen]
        assert kinds.count("HoldQuery") >= 3, kinds  # before the READ, after it, and after it again
    finally:
        d.close()
