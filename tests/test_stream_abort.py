"""Streams cut short: a decode request aborted mid-stream, a NIXL fault on a WRITE mid-stream, a prefill rank
that dies mid-stream.

Two real :class:`p2pkv.worker.WorkerSide` in this process, a prefill rank and
a decode rank sharing a secret, their NIXL agents moving host memory, driven
as vLLM drives them: the prefill's steps open the stream
(``P2pKvMetadata.streams``) and report layers done (``save_kv_layer``); the
decode worker takes the streamed load (``LoadSpec.stream_grant``) and sends
its destination. After the first layer landed, the decode request ends
(vLLM aborted it: its scheduler names it in ``ended_streams``). Checked:

* the decode worker hands the request back to vLLM (finished receiving, no
  load errors) once the prefill rank said it stopped, long before the
  stream's window would have passed;
* layers the prefill computes after that are never WRITTEN: the decode
  blocks hold layer 0 and zeros;
* the prefill rank frees the request's hold as soon as it is made (the
  stream has ended), so no block stays held.

A NIXL call of the prefill rank's WRITE of the second layer fails (it
cannot start, or fails in flight): the decode rank is told, its load fails
with every block a load error, the hold is freed, and the next stream lands
whole.

A prompt shorter than ``stream_min_tokens`` (the measured default) lands in
one WRITE after the prefill's last layer, nothing before it.

A prefill rank (in its own process, :class:`tests.p2p_harness.PrefillProc`)
SIGKILLed after the first layer landed: the decode worker fails the load
(every block a load error, so vLLM recomputes or fails the request by its
``kv_load_failure_policy``) once the stream's window has passed, and a
stream from the rank's next incarnation lands whole.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from p2pkv.grant import ANY_DECODE, check_stream_grant, make_stream_grant
from p2pkv.metadata import LoadSpec, P2pKvMetadata, StreamChunk
from p2pkv.params import RemotePrefill
from p2pkv.prefill import stream_pending
from p2pkv.prefill.prefill_streams import measured_min_tokens
from p2pkv.prompt_digest import prompt_digest
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.faults import inject, restore
from tests.p2p_harness import ENGINE, LAYOUT, DecodeSide, PrefillProc, free_port, shape
from tests.workers import make_worker

SECRET = "stream-abort-test-secret-32bytes"
NUM_BLOCKS = 16
BLOCK_SIZE = shape(NUM_BLOCKS)["block_size"]
LAYERS = shape(NUM_BLOCKS)["num_layers"]
SOURCE, TARGET = (1, 2, 3), (5, 6, 7)
PROMPT = len(SOURCE) * BLOCK_SIZE  # tokens; the decode engine computes the last one itself
WINDOW_S = 10.0  # the decode rank's transfer_timeout_s: the stream's window


def _stream(prefill_request: str, decode_request: str, port: int) -> tuple[StreamChunk, LoadSpec]:
    """A streamed request's first (and last) prefill chunk over :data:`SOURCE`, and its decode rank's load into
    :data:`TARGET`, under one grant."""
    grant = make_stream_grant(ENGINE, ANY_DECODE, SECRET.encode(), time.time() + 60)
    stream_id = check_stream_grant(grant, SECRET.encode(), prefill_engine_id=ENGINE,
                                   decode_engine_id="decode-engine", now=time.time()).stream_id
    loaded = PROMPT - 1
    digest = prompt_digest(list(range(loaded)))
    chunk = StreamChunk(prefill_request, stream_id, 0, SOURCE, PROMPT, True, digest, loaded)
    remote = RemotePrefill(ENGINE, stream_id, "127.0.0.1", port, (), 1, num_tokens=loaded, prompt_digest=digest,
                           transfer_mode="stream")
    return chunk, LoadSpec(decode_request, TARGET, (), remote, num_tokens=loaded, stream_grant=grant)


def _wait_landed(decode: DecodeSide, want: torch.Tensor, layers: slice) -> None:
    """Step the decode worker until its :data:`TARGET` blocks hold ``want`` in ``layers``."""
    deadline = time.monotonic() + 10
    while not torch.equal(decode.base[list(TARGET), layers], want):
        assert time.monotonic() < deadline, f"layers {layers} never landed"
        decode.step()
        time.sleep(0.002)


@dataclass
class Pair:
    """A secured prefill worker (synthetic cache ``source``, side channel on ``port``) and a decode worker here."""

    prefill: WorkerSide
    source: torch.Tensor
    decode: DecodeSide
    port: int


@contextlib.contextmanager
def _pair(seed: int, decode_settings: dict[str, float] | None = None, **prefill_settings: object) -> Iterator[Pair]:
    """A :class:`Pair` whose prefill cache holds ``seed``'s values, shut down on exit (``decode_settings``: the
    decode worker's, over a :data:`WINDOW_S` ``transfer_timeout_s``)."""
    port = free_port()
    prefill = make_worker(ENGINE, port, secret=SECRET, **prefill_settings)
    source, views = make_kv_caches(LAYOUT, seed=seed, **shape(NUM_BLOCKS))
    prefill.register_kv_caches(views, NUM_BLOCKS)
    decode = DecodeSide(NUM_BLOCKS, secret=SECRET, **{"transfer_timeout_s": WINDOW_S, "handshake_timeout_s": 2.0,
                                                       **(decode_settings or {})})
    try:
        yield Pair(prefill, source, decode, port)
    finally:
        decode.close()
        prefill.shutdown()


def _started(pair: Pair, prefill_request: str, decode_request: str) -> P2pKvMetadata:
    """Stream ``prefill_request`` into ``decode_request``: the prefill's step opened, the decode's load started;
    the step's metadata (its layers are reported done by the test)."""
    chunk, load = _stream(prefill_request, decode_request, pair.port)
    step = P2pKvMetadata(streams=[chunk])
    pair.prefill.start_load_kv(step)
    pair.decode.start(load)
    return step


def test_a_decode_request_aborted_mid_stream_stops_the_writes_and_frees_both_sides() -> None:
    with _pair(7, stream_min_tokens=0) as pair:
        prefill, decode = pair.prefill, pair.decode
        step = _started(pair, "p-1", "d-1")
        prefill.save_kv_layer("layers.0", step)
        layer_bytes = pair.source[list(SOURCE), 0:1]
        _wait_landed(decode, layer_bytes, slice(0, 1))
        assert "d-1" not in decode.finished, "finished while the prefill still streams"

        decode.worker.start_load_kv(P2pKvMetadata(ended_streams=["d-1"]))  # vLLM aborted the request
        missing = decode.pump({"d-1"}, WINDOW_S / 2)
        assert not missing, "the decode worker waited for the stream's window instead of the prefill's word"
        assert decode.take_errors() == set(), "an aborted request's blocks are not load errors"

        for layer in range(1, LAYERS):  # the prefill goes on computing: nothing more is written
            prefill.save_kv_layer(f"layers.{layer}", step)
        prefill.wait_for_save()
        decode.pump(set(), 0.3)
        assert torch.equal(decode.base[list(TARGET), 0:1], layer_bytes)
        assert not decode.base[list(TARGET), 1:].any(), "a layer was written after the stream was given up"

        # The prefill request finishes: its hold is made, and freed at once (its stream has ended).
        prefill.start_load_kv(P2pKvMetadata(send_leases={"p-1": time.monotonic() + 60}, send_blocks={"p-1": SOURCE}))
        _wait_released(prefill, "p-1")


@pytest.mark.parametrize(("method", "mode"), [
    ("get_xfer_descs", "raise"), ("initialize_xfer", "raise"), ("transfer", "raise"), ("transfer", "err"),
    ("check_xfer_state", "raise"), ("check_xfer_state", "err"),
])
def test_a_write_that_fails_mid_stream_fails_the_load_and_the_next_stream_lands(method: str, mode: str) -> None:
    with _pair(11, stream_min_tokens=0) as pair:
        prefill, decode, source = pair.prefill, pair.decode, pair.source
        step = _started(pair, "p-1", "d-1")
        prefill.save_kv_layer("layers.0", step)
        _wait_landed(decode, source[list(SOURCE), 0:1], slice(0, 1))
        fault = inject(prefill, method, 1, mode)
        prefill.save_kv_layer("layers.1", step)
        assert not decode.pump({"d-1"}, WINDOW_S / 2), "the decode rank was not told of the failed WRITE"
        assert fault.faults == 1
        assert decode.take_errors() == set(TARGET)
        restore(prefill)
        for layer in range(2, LAYERS):
            prefill.save_kv_layer(f"layers.{layer}", step)
        prefill.wait_for_save()
        prefill.start_load_kv(P2pKvMetadata(send_leases={"p-1": time.monotonic() + 60}, send_blocks={"p-1": SOURCE}))
        _wait_released(prefill, "p-1")

        decode.base.zero_()
        step = _started(pair, "p-2", "d-2")
        for layer in range(LAYERS):
            prefill.save_kv_layer(f"layers.{layer}", step)
        prefill.wait_for_save()
        assert not decode.pump({"d-2"}, 10.0) and decode.take_errors() == set()
        assert torch.equal(decode.base[list(TARGET)], source[list(SOURCE)])


@pytest.mark.parametrize(("stream_timeout_s", "lands"), [(0.0, False), (WINDOW_S, True)],
                         ids=["transfer_timeout_s", "stream_timeout_s"])
def test_a_prefill_longer_than_transfer_timeout_s_streams_whole_within_stream_timeout_s(
        stream_timeout_s: float, lands: bool) -> None:
    """A prefill (its queue and forward) that outlasts the decode's ``transfer_timeout_s``: with
    ``stream_timeout_s`` above it, the decode rank keeps waiting and the prefill rank keeps WRITing (its window
    is the stream's), so every layer lands; with 0 (``transfer_timeout_s``) both sides give the stream up at 1 s
    and the load fails with every block a load error."""
    settings = {"transfer_timeout_s": 1.0, "stream_timeout_s": stream_timeout_s}
    with _pair(13, settings, stream_min_tokens=0) as pair:
        prefill, decode, source = pair.prefill, pair.decode, pair.source
        step = _started(pair, "p-1", "d-1")
        prefill.save_kv_layer("layers.0", step)
        _wait_landed(decode, source[list(SOURCE), 0:1], slice(0, 1))
        assert decode.pump({"d-1"}, 1.5) == {"d-1"} or not lands, "the load ended before the prefill"
        for layer in range(1, LAYERS):  # the rest of the forward, past transfer_timeout_s
            prefill.save_kv_layer(f"layers.{layer}", step)
        prefill.wait_for_save()
        assert not decode.pump({"d-1"}, WINDOW_S)
        if lands:
            assert decode.take_errors() == set()
            assert torch.equal(decode.base[list(TARGET)], source[list(SOURCE)])
        else:
            assert decode.take_errors() == set(TARGET)
            assert not decode.base[list(TARGET), 1:].any(), "a layer was written after the window"
        prefill.start_load_kv(P2pKvMetadata(send_leases={"p-1": time.monotonic() + 60}, send_blocks={"p-1": SOURCE}))
        _wait_released(prefill, "p-1")


def _wait_released(prefill: WorkerSide, request_id: str) -> None:
    """Wait until the prefill worker reports ``request_id``'s hold freed (finished sending)."""
    sent: set[str] = set()
    deadline = time.monotonic() + 10
    while request_id not in sent:
        assert time.monotonic() < deadline, f"the prefill rank still holds {request_id}'s blocks"
        sent |= prefill.get_finished()[0]
        time.sleep(0.01)


@contextlib.contextmanager
def _first_layer_landed(window_s: float) -> Iterator[tuple[PrefillProc, DecodeSide]]:
    """A prefill process streaming request ``p-1`` into a decode worker here (``d-1``, its stream's window
    ``window_s``), its first layer landed; both stopped on exit."""
    pf = PrefillProc(free_port(), seed=3, num_blocks=NUM_BLOCKS,
                     settings={"secret": SECRET, "stream_min_tokens": 0})
    pf.start()
    decode = DecodeSide(NUM_BLOCKS, secret=SECRET, transfer_timeout_s=window_s, handshake_timeout_s=1.0)
    try:
        chunk, load = _stream("p-1", "d-1", pf.port)
        pf.call("stream", [chunk], ["layers.0"])
        decode.start(load)
        _wait_landed(decode, pf.expected()[list(SOURCE), 0:1], slice(0, 1))
        yield pf, decode
    finally:
        decode.close()
        pf.stop()


def test_a_prefill_that_dies_mid_stream_fails_the_load_and_its_next_incarnation_streams_whole() -> None:
    with _first_layer_landed(3.0) as (pf, decode):
        pf.kill()
        missing = decode.pump({"d-1"}, 20.0)
        assert not missing, "a load from a dead prefill rank never ended"
        assert decode.take_errors() == set(TARGET), "a stream cut short must reach vLLM as load errors"

        pf.start(seed=4)
        decode.base.zero_()
        chunk, load = _stream("p-2", "d-2", pf.port)
        decode.start(load)
        pf.call("stream", [chunk], [f"layers.{layer}" for layer in range(LAYERS)], True)
        assert not decode.pump({"d-2"}, 20.0)
        assert decode.take_errors() == set()
        assert torch.equal(decode.base[list(TARGET)], pf.expected()[list(SOURCE)])


@pytest.mark.parametrize("restart", [False, True], ids=["stays_down", "restarted"])
def test_a_stream_whose_prefill_dies_mid_way_fails_within_seconds_not_at_its_window(restart: bool) -> None:
    """A stream waits up to its window (here 120 s) for a prefill that is only slow. One whose process died is
    known within seconds: NIXL says its agent disconnected (and a restarted one answers the decode rank's
    question that it does not know the stream), so the load fails then, and its blocks come back with nothing
    more written into them."""
    with _first_layer_landed(120.0) as (pf, decode):
        pf.kill()
        if restart:
            pf.start(seed=4)
        started = time.monotonic()
        assert not decode.pump({"d-1"}, 20.0), "the load waited for its window after its prefill process died"
        assert time.monotonic() - started < 20.0
        assert decode.take_errors() == set(TARGET), "a stream cut short must reach vLLM as load errors"
        assert not decode.base[list(TARGET), 1:].any(), "a layer landed after the stream was over"
        if not restart:
            pf.start(seed=4)  # the harness stops a live incarnation


def test_a_prompt_under_the_measured_threshold_lands_in_one_write_after_its_last_layer() -> None:
    with _pair(5) as pair:  # stream_min_tokens -1: as measured for the cache's kind
        prefill, decode, source = pair.prefill, pair.decode, pair.source
        assert measured_min_tokens(prefill.streams.source) > PROMPT
        step = _started(pair, "p-1", "d-1")
        for layer in range(LAYERS - 1):
            prefill.save_kv_layer(f"layers.{layer}", step)
        decode.pump(set(), 0.3)
        assert not decode.base.any(), "a short prompt's layers were written before its prefill ended"
        prefill.save_kv_layer(f"layers.{LAYERS - 1}", step)
        prefill.wait_for_save()
        assert not decode.pump({"d-1"}, 10.0) and decode.take_errors() == set()
        assert torch.equal(decode.base[list(TARGET)], source[list(SOURCE)])


def _chunked(pair: Pair, prefill_request: str, decode_request: str) -> tuple[P2pKvMetadata, P2pKvMetadata]:
    """Stream ``prefill_request`` in two prefill chunks: blocks 0-1 to token 1.5 blocks, then blocks 1-2 to the end
    (block 1, half filled by the first chunk, is computed further and sent again, as vLLM's chunked prefill does);
    the two steps' metadata, the decode's load started."""
    first, load = _stream(prefill_request, decode_request, pair.port)
    half = BLOCK_SIZE + BLOCK_SIZE // 2
    first = StreamChunk(prefill_request, first.stream_id, 0, SOURCE[:2], half, False, first.prompt_digest,
                        first.loaded_tokens)
    second = StreamChunk(prefill_request, first.stream_id, 1, SOURCE[1:], PROMPT, True)
    one, two = P2pKvMetadata(streams=[first]), P2pKvMetadata(streams=[second])
    pair.prefill.start_load_kv(one)
    pair.decode.start(load)
    return one, two


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_verified_stream_is_checked_against_what_the_prefill_wrote(chunks: int) -> None:
    """``verify_kv`` on a layer stream: the prefill rank digests each page of each destination block as its WRITE
    is posted, a block sent again by a later chunk (filled further meanwhile) replacing its digest, and the decode
    rank digests its pages once all landed: equal, the load verified and handed over, bytes equal."""
    with _pair(21, {"verify_kv": True}, stream_min_tokens=0) as pair:
        prefill, decode, source = pair.prefill, pair.decode, pair.source
        if chunks == 1:
            step = _started(pair, "p-1", "d-1")
            for layer in range(LAYERS):
                prefill.save_kv_layer(f"layers.{layer}", step)
        else:
            one, two = _chunked(pair, "p-1", "d-1")
            for layer in range(LAYERS):
                prefill.save_kv_layer(f"layers.{layer}", one)
            prefill.wait_for_save()
            deadline = time.monotonic() + 10  # the first chunk's blocks landed: their digests were taken then
            while not torch.equal(decode.base[list(TARGET[:2])], source[list(SOURCE[:2])]):
                assert time.monotonic() < deadline, "the first chunk never landed"
                decode.step()
                time.sleep(0.002)
            source[SOURCE[1]] += 1.0  # the second chunk's forward fills the rest of block 1
            prefill.start_load_kv(two)
            for layer in range(LAYERS):
                prefill.save_kv_layer(f"layers.{layer}", two)
        prefill.wait_for_save()
        assert not decode.pump({"d-1"}, 10.0) and decode.take_errors() == set()
        assert torch.equal(decode.base[list(TARGET)], source[list(SOURCE)])
        assert decode.worker.stats.data["kv_checks"] == {"stream:verified": 1}


@pytest.mark.parametrize("fault", ["CORRUPT_LANDED", "DROP_WRITE"])
def test_a_corrupted_or_dropped_stream_fails_its_load(fault: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A fault knob aimed at one request: ``CORRUPT_LANDED`` overwrites its first page as it lands (decode rank);
    ``DROP_WRITE`` posts each of its WRITEs as one byte, its pages' digests still of what the WRITE was to move
    (prefill rank). The digests differ, every block is a load error (``digest_mismatch``), and the next stream,
    not aimed at, is verified and lands whole. The log names where the bytes differ: layer 0's page of the first
    block at least (the one a corrupted landing overwrites, and the first a dropped WRITE leaves unwritten)."""
    monkeypatch.setenv(f"P2PKV_FAULT_{fault}", "1")
    monkeypatch.setenv("P2PKV_ALLOW_FAULTS", "1")
    monkeypatch.setenv("P2PKV_FAULT_REQUESTS", "-bad")
    with _pair(22, {"verify_kv": True}, stream_min_tokens=0) as pair:
        prefill, decode = pair.prefill, pair.decode
        caplog.set_level(logging.WARNING, logger="p2pkv")
        for prefill_request, decode_request in (("p-bad", "d-bad"), ("p-good", "d-good")):
            step = _started(pair, prefill_request, decode_request)
            for layer in range(LAYERS):
                prefill.save_kv_layer(f"layers.{layer}", step)
            prefill.wait_for_save()
            assert not decode.pump({decode_request}, 10.0)
            assert decode.take_errors() == (set(TARGET) if decode_request == "d-bad" else set())
        assert torch.equal(decode.base[list(TARGET)], pair.source[list(SOURCE)])  # the second stream's, whole
        stats = decode.worker.stats.data
        assert stats["kv_checks"] == {"stream:mismatch": 1, "stream:verified": 1}
        assert stats["failures"] == {"digest_mismatch": 1}
        [line] = [r.getMessage() for r in caplog.records if "KV digest mismatch" in r.getMessage()]
        assert f"differs at layer 0, block{'s' if fault == 'DROP_WRITE' else ''} {TARGET[0]}" in line


def test_a_stream_request_answered_busy_is_sent_again_and_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of streams whose prefill legs have not reached the prefill engine's scheduler: the prefill rank keeps
    no more destinations for unknown streams (here: none) and answers ``busy``. The decode rank sends its request
    again (``RETRY_BUSY_S``) until the stream is known there, and the load lands whole, no error."""
    monkeypatch.setattr(stream_pending, "MAX_UNKNOWN_PER_RANK", 0)
    with _pair(23, stream_min_tokens=0) as pair:
        prefill, decode = pair.prefill, pair.decode
        chunk, load = _stream("p-busy", "d-busy", pair.port)
        decode.start(load)  # its destination comes before the prefill engine knows the stream: busy
        assert decode.pump({"d-busy"}, 0.3) == {"d-busy"}, "the load ended while its stream was unknown there"
        step = P2pKvMetadata(streams=[chunk])
        prefill.start_load_kv(step)
        for layer in range(LAYERS):
            prefill.save_kv_layer(f"layers.{layer}", step)
        prefill.wait_for_save()
        assert not decode.pump({"d-busy"}, 10.0) and decode.take_errors() == set()
        assert torch.equal(decode.base[list(TARGET)], pair.source[list(SOURCE)])
