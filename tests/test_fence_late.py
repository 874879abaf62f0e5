"""A fence question answered late: the reply to the first question after the READ comes only while the
question asked again waits (a prefill side channel, or its host, slower than the timeout once in a while).

Before, the question asked again was a new call that skipped the first question's reply as an answer to
another request, and its own reply came as late: the prefill rank said "held" twice and the pull failed
``unconfirmed``. Now both are one call, and a reply to either answers it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from handshake import PROTOCOL_VERSION, Destination, HoldQuery, HoldsReply, MetadataReply, encode, fetch_agent_info
from handshake import decode as decode_message
from handshake.compat import fingerprint
from tests.p2p_harness import ENGINE, DecodeSide, PrefillProc, free_port, pull_task
from tests.workers import COMPAT_FIELDS

HOST = "127.0.0.1"
TIMEOUT_S = 1.0
LATE_S = 1.4  # past one timeout, well within two


@contextlib.contextmanager
def late_fence_side_channel(pf: PrefillProc) -> Iterator[tuple[int, list[str]]]:
    """A side channel (a ROUTER in a thread) with ``pf``'s real metadata, answering at once, that answers
    every fence question "held", :data:`LATE_S` after it came. Yields ``(port, kinds of requests seen)``."""
    info = fetch_agent_info(Destination(HOST, pf.port, ENGINE, 0), "test", fingerprint(COMPAT_FIELDS), timeout_s=5.0,
                            retries=2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    seen: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        due: list[tuple[float, list[bytes]]] = []
        while not stop.is_set():
            if sock.poll(5):
                identity, *body = sock.recv_multipart()
                msg = decode_message(body, None)
                seen.append(type(msg).__name__)
                if isinstance(msg, HoldQuery):
                    reply = HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=len(msg.request_ids),
                                       request_ids=msg.request_ids, nonce=msg.nonce)
                    due.append((time.monotonic() + LATE_S, [identity, *encode(reply, None)]))
                else:
                    reply = MetadataReply(protocol_version=PROTOCOL_VERSION, info=info, nonce=msg.nonce)
                    due.append((time.monotonic(), [identity, *encode(reply, None)]))
            now = time.monotonic()
            for item in [x for x in due if x[0] <= now]:
                due.remove(item)
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(item[1], zmq.NOBLOCK)
        sock.close(0)

    thread = threading.Thread(target=loop, name="late-side-channel", daemon=True)
    thread.start()
    try:
        yield port, seen
    finally:
        stop.set()
        thread.join(2)
        ctx.term()


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProc]:
    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0)
    pf.start()
    try:
        yield pf
    finally:
        pf.stop()


def test_a_late_reply_to_the_first_question_after_the_read_confirms_the_pull(
        prefill: PrefillProc, caplog: pytest.LogCaptureFixture) -> None:
    """Every fence answer comes 1.4 s after its question, the timeout is 1 s: the pull is confirmed by the
    reply to its first question after the READ, and moves the prefill bytes."""
    caplog.set_level(logging.ERROR, logger="p2pkv.decode")
    d = DecodeSide(64, handshake_timeout_s=TIMEOUT_S, handshake_retries=1, transfer_timeout_s=10.0)
    try:
        prefill.lease(["p-late"])
        with late_fence_side_channel(prefill) as (port, seen):
            d.start(pull_task("d-late", "p-late", port, [3, 4], [5, 6]))
            assert d.pump({"d-late"}, 15.0) == set(), "the pull hung"
        failures = [r.getMessage() for r in caplog.records if "pull failed" in r.getMessage()]
        assert failures == [] and d.take_errors() == set(), failures
        assert all(d.block_ok(lb, rb, prefill.expected()) for lb, rb in ((3, 5), (4, 6)))
        assert seen.count("HoldQuery") >= 3, seen  # before the READ, after it, and after it again
    finally:
        d.close()
