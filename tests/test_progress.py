"""The pulls' thread: it advances pulls between engine steps, and stops when told."""

from __future__ import annotations

import threading
import time

import pytest

from p2pkv.decode.direction import Direction
from p2pkv.decode.progress import Progress
from p2pkv.decode.transfer import Part, Transfer, TransferState, poll_wait_s, streams_only
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from tests.p2p_harness import DecodeSide, PrefillProc, pull_task


def _wait_for(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it holds (a loaded host may start the thread late), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the progress thread never got there"
        time.sleep(0.002)


def test_progress_polls_while_active_sleeps_until_woken_and_stops() -> None:
    calls, active, seen_on_thread = [], threading.Event(), []

    def advance() -> bool:
        calls.append(time.monotonic())
        seen_on_thread.append(progress.on_thread())
        return active.is_set()

    progress = Progress(advance, "p2pkv-test-progress", interval_s=0.001)
    try:
        time.sleep(0.05)
        assert calls == []  # nothing to do until woken
        active.set()
        progress.wake()
        _wait_for(lambda: len(calls) >= 5)  # keeps polling while advance() says a READ is in flight
        active.clear()
        time.sleep(0.05)
        settled = len(calls)
        time.sleep(0.05)
        assert len(calls) == settled  # went back to sleep
        progress.wake()
        _wait_for(lambda: len(calls) >= settled + 1)
        time.sleep(0.05)
        assert len(calls) == settled + 1  # one round per wake when idle
        assert all(seen_on_thread) and not progress.on_thread()
    finally:
        progress.close()
    assert not any(t.name == "p2pkv-test-progress" for t in threading.enumerate())


def test_what_is_in_flight_sets_the_pace() -> None:
    """``wait_s`` is asked after each busy call: a slow pace (a stream waiting for its prefill) polls less."""
    calls, pace = [], [0.001]

    def advance() -> bool:
        calls.append(time.monotonic())
        return True

    progress = Progress(advance, "p2pkv-test-pace", interval_s=0.001, wait_s=lambda: pace[0])
    try:
        progress.wake()
        deadline = time.monotonic() + 5
        while len(calls) < 50 and time.monotonic() < deadline:  # about 50 ms at the fast pace; more when loaded
            time.sleep(0.01)
        fast = len(calls)
        pace[0] = 0.05
        time.sleep(0.1)
        start = len(calls)
        time.sleep(0.5)
        slow = len(calls) - start
    finally:
        progress.close()
    assert fast >= 50, fast
    assert slow <= 12, slow  # at most 0.5 s / 0.05 s and a margin (a loaded machine only calls less often)


def test_only_streams_waiting_for_their_prefill_slow_the_pace() -> None:
    def transfer(direction: Direction, state: TransferState) -> Transfer:
        t = Transfer.taken(LoadSpec("r", (1,), (), RemotePrefill("p", "s", "127.0.0.1", 1, (), 1), stream_grant="g"))
        t.state = state
        t.parts = [Part(t, 0, None, None, None, None, direction=direction)]  # type: ignore[arg-type]
        return t

    stream, read = transfer(Direction.STREAM, TransferState.READING), transfer(Direction.PULL, TransferState.READING)
    assert streams_only([stream]) and streams_only([stream, transfer(Direction.STREAM, TransferState.READING)])
    assert not streams_only([]) and not streams_only([stream, read])
    assert not streams_only([transfer(Direction.STREAM, TransferState.HANDSHAKE)])
    # The pace: 1 % of the youngest stream's wait so far, within STREAM_POLL_MIN_S .. 10 ms.
    stream.started, young = 100.0, transfer(Direction.STREAM, TransferState.READING)
    young.started = 103.0
    assert poll_wait_s([stream], 100.05, 0.0002, 0.001) == 0.001  # 50 ms waited: the floor
    assert poll_wait_s([stream], 100.5, 0.0002, 0.001) == pytest.approx(0.005)
    assert poll_wait_s([stream], 104.0, 0.0002, 0.001) == pytest.approx(0.01)  # capped
    assert poll_wait_s([stream, young], 104.0, 0.0002, 0.001) == pytest.approx(0.01)  # the young one: 1 s
    assert poll_wait_s([stream, young], 103.2, 0.0002, 0.001) == pytest.approx(0.002)
    assert poll_wait_s([stream, read], 104.0, 0.0002, 0.001) == 0.0002  # a READ keeps the pull pace


def test_no_thread_at_interval_zero_and_a_failing_start_leaves_no_thread() -> None:
    calls: list[int] = []
    off = Progress(lambda: bool(calls.append(1)), "p2pkv-test-off", interval_s=0.0)
    off.wake()
    time.sleep(0.05)
    assert calls == [] and not off.on_thread()
    off.close()

    def boom() -> None:
        raise RuntimeError("no GPU here")

    broken = Progress(lambda: bool(calls.append(1)), "p2pkv-test-broken", interval_s=0.001, on_start=boom)
    broken.wake()
    time.sleep(0.05)
    assert calls == []  # the engine step still advances the pulls
    broken.close()
    assert not any(t.name.startswith("p2pkv-test-") for t in threading.enumerate())


def test_a_pull_finishes_between_engine_steps(prefill: PrefillProc) -> None:
    """After the handshake, a pull is posted at start_load_kv and then read, fenced and confirmed by the
    pulls' thread alone: no engine step (get_finished) runs until it is DONE, and the bytes are right."""
    d = DecodeSide(64, handshake_timeout_s=2.0)
    try:
        prefill.lease(["p-warm", "p-1"])
        d.start(pull_task("d-warm", "p-warm", prefill.port, [1], [2]))
        assert d.pump({"d-warm"}, 30.0) == set()  # handshake done (engine steps allowed here)
        d.start(pull_task("d-1", "p-1", prefill.port, [10, 11, 12], [20, 21, 22]))
        receiver = d.worker.receiver
        assert receiver is not None
        deadline = time.monotonic() + 10.0
        while receiver.transfers and time.monotonic() < deadline:  # DONE pulls leave the list
            time.sleep(0.001)
        assert not receiver.transfers and not receiver.in_state(TransferState.READING)
        assert d.step() == {"d-1"}  # the first engine step after it hands it to vLLM
        expected = prefill.expected()
        assert all(d.block_ok(lb, rb, expected) for lb, rb in ((10, 20), (11, 21), (12, 22)))
    finally:
        d.close()


def test_an_idle_engine_step_waits_for_the_pull_to_end(prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that scheduled no tokens (vLLM polling transfers) waits for the pull instead of returning empty:
    its own get_finished hands the pull to vLLM, with the right bytes."""
    monkeypatch.setattr("p2pkv.worker.IDLE_WAIT_S", 0.1)
    d = DecodeSide(64, handshake_timeout_s=2.0)
    try:
        prefill.lease(["p-warm2", "p-2", "p-3"])
        d.start(pull_task("d-warm2", "p-warm2", prefill.port, [1], [2]))
        assert d.pump({"d-warm2"}, 30.0) == set()
        for rid, remote, blocks in (("d-2", "p-2", [30, 31, 32, 33]), ("d-3", "p-3", [40, 41])):
            d.start(pull_task(rid, remote, prefill.port, blocks, [b - 10 for b in blocks]))
            d.worker.start_load_kv(P2pKvMetadata(idle=True))  # the next step: nothing scheduled
            got = set()
            for _ in range(20):  # at most 2 s of idle steps; each waits up to 0.1 s for the pull
                got = d.step()
                if got:
                    break
            assert got == {rid}
            expected = prefill.expected()
            assert all(d.block_ok(b, b - 10, expected) for b in blocks)
    finally:
        d.close()



def test_start_load_kv_polls_reads_and_sends_fence_questions_itself(prefill: PrefillProc) -> None:
    """Without the pulls' thread and before any engine step, start_load_kv itself polls the READs in
    flight (an earlier pull's, done by now) and sends their after-READ fence question: that pull has left
    READING when the call returns. The next steps hand both pulls over with the right bytes."""
    d = DecodeSide(64, handshake_timeout_s=2.0, pull_thread=False)
    try:
        prefill.lease(["p-warm4", "p-4", "p-5"])
        d.start(pull_task("d-warm4", "p-warm4", prefill.port, [1], [2]))
        assert d.pump({"d-warm4"}, 30.0) == set()  # handshake done
        receiver = d.worker.receiver
        assert receiver is not None
        d.start(pull_task("d-4", "p-4", prefill.port, [50, 51], [40, 41]))
        [first] = receiver.transfers
        time.sleep(0.1)  # its READ (within one host) is done; nothing has polled it
        d.start(pull_task("d-5", "p-5", prefill.port, [52, 53], [42, 43]))
        assert first.state in (TransferState.FENCING, TransferState.DONE) and "read" in first.marks  # DONE: its answer
        # came too (on a busy host the question can leave its lane after the READ, and its answer confirms it)
        assert d.pump({"d-4", "d-5"}, 30.0) == set()
        expected = prefill.expected()
        assert all(d.block_ok(lb, rb, expected) for lb, rb in ((50, 40), (51, 41), (52, 42), (53, 43)))
    finally:
        d.close()
