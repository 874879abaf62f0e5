"""Verified KV (``verify_kv``): what lands is checked against the prefill rank's digest before vLLM reads it.

The digest itself (bytes in row order, host memory only), the pure check, the prefill rank's checks before it
digests a hold's rows, the fault knobs, and two real processes with NIXL agents pulling and pushing: verified
loads land and are counted, a corrupted landing fails its load (its blocks load errors, the hold released) and
the next request is unharmed, with the check off the same corruption is served (the check is what catches it),
and a prefill rank that gives no digest fails the load closed.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
import xxhash

from handshake.messages import BUCKET_BYTES, DIGEST_BUCKETS, DIGEST_BYTES
from p2pkv.config import ConfigError
from p2pkv.dataplane.digest import (
    DigestError,
    bucket_items,
    check_host,
    combine,
    differing_items,
    digest_rows,
    merged_ranges,
    page_block_digest,
    pages_digest,
)
from p2pkv.dataplane.layers import groups_by_layer
from p2pkv.dataplane.layout import Segment, describe_torch_kv_caches
from p2pkv.decode import fence
from p2pkv.decode.transfer import Part
from p2pkv.decode.verify import Check, judge
from p2pkv.faults import Faults, load_faults
from p2pkv.metadata import P2pKvMetadata
from p2pkv.prefill.hold_digests import HoldDigests
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.testing import block_bytes, make_kv_caches
from p2pkv.worker import WorkerSide
from tests.fault_injection.support import released_once_not_expired
from tests.p2p_harness import PrefillProc
from tests.workers import NUM_BLOCKS, SHAPE, free_port, make_worker, model_info, run_until_received, task


def _rows(*ranges: tuple[int, int]) -> np.ndarray:
    return np.array([[addr, length, 0] for addr, length in ranges], dtype=np.uint64)


def test_a_digest_is_the_bytes_in_row_order() -> None:
    """XXH3-64 of the rows' bytes, in order, bucket by bucket (one row each here), then each bucket's: touching
    rows of one bucket are one range; another order or one byte changed disagree."""
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    a = data.data_ptr()
    raw = data.numpy()
    whole = digest_rows(_rows((a, 300), (a + 1000, 40)))
    parts = [xxhash.xxh3_64(raw[:300].tobytes()).digest(), xxhash.xxh3_64(raw[1000:1040].tobytes()).digest()]
    assert whole == xxhash.xxh3_64(b"".join(parts)).digest() + parts[0][:BUCKET_BYTES] + parts[1][:BUCKET_BYTES]
    assert len(whole) == DIGEST_BYTES + 2 * BUCKET_BYTES
    assert merged_ranges(_rows((a, 100), (a + 100, 200), (a + 1000, 40)))[1].tolist() == [300, 40]
    assert merged_ranges(_rows((a, 100), (a + 100, 200)), np.array([0, 1]))[1].tolist() == [100, 200]
    assert digest_rows(_rows((a + 1000, 40), (a, 300))) != whole  # the same bytes, landed in other places
    data[5] += 1
    assert digest_rows(_rows((a, 300), (a + 1000, 40))) != whole
    assert digest_rows(np.zeros((0, 3), dtype=np.uint64)) == xxhash.xxh3_64(b"").digest()


def test_a_mismatch_is_located_by_the_buckets_that_differ() -> None:
    """Rows cut into at most 64 buckets of consecutive rows: one byte changed in row 100 of 200 changes only its
    bucket (rows 100-103), many rows one bucket each; a digest without buckets locates nothing finer."""
    data = torch.zeros(200 * 64, dtype=torch.uint8)
    rows = _rows(*[(data.data_ptr() + 64 * i, 32) for i in range(200)])
    sent = digest_rows(rows)
    assert len(sent) == DIGEST_BYTES + DIGEST_BUCKETS * BUCKET_BYTES
    assert bucket_items(200)[[0, 3, 4, 100, 103, 199]].tolist() == [0, 0, 1, 32, 32, 63]
    data[64 * 101 + 7] = 1
    landed = digest_rows(rows)
    assert landed[:DIGEST_BYTES] != sent[:DIGEST_BYTES]
    assert differing_items(sent, landed, 200) == [range(100, 104)]
    assert differing_items(sent[:DIGEST_BYTES], landed, 200) == [range(200)]
    assert differing_items(digest_rows(rows[99:102]), digest_rows(rows[100:103]), 3) == [range(1, 2), range(2, 3)]


def test_a_streams_digest_tells_each_groups_blocks_in_a_page_apart() -> None:
    """A layer of vLLM's hybrid KV cache holds blocks of several KV cache groups in one page (tensors shared):
    the digest the decode rank takes over each page's groups' blocks equals the prefill rank's pieces keyed by
    (page, group, block) whatever order they came in, and differs when two groups' blocks landed swapped."""
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    pages = [Segment(data.data_ptr(), 64, 256, 0, 1, 0), Segment(data.data_ptr() + 128, 64, 256, 0, 1, 1)]
    landed = [{0: [1, 2], 1: [5]}, {0: [1, 2], 1: [5]}]
    sent = {(i, g, j): page_block_digest(pages[i], block) for i in (1, 0) for g, ids in ((1, [5]), (0, [1, 2]))
            for j, block in enumerate(ids)}
    assert pages_digest(pages, landed) == combine(sent)
    assert pages_digest(pages, [{0: [1, 5], 1: [2]}, landed[1]]) != combine(sent)


def test_each_layers_pages_hold_its_attention_groups_blocks_and_every_state_groups() -> None:
    layer_of = {"full.0": 0, "window.0": 0, "full.1": 1, "window.1": 1}
    group_of = {"full.0": 0, "window.0": 1, "full.1": 0, "window.1": 1, "mamba.0": 2}
    assert groups_by_layer(layer_of, group_of, frozenset({2})) == {0: (0, 1, 2), 1: (0, 1, 2)}
    assert groups_by_layer({"layers.0": 0, "layers.1": 1}, {}, frozenset()) == {0: (0,), 1: (0,)}


@pytest.mark.parametrize("rows", [np.zeros((2, 2), dtype=np.uint64), _rows((4096, 0)), _rows((0, 16)),
                                  _rows((1 << 62, 16))])
def test_rows_that_cannot_be_read_are_refused_before_any_byte(rows: np.ndarray) -> None:
    with pytest.raises(DigestError):
        digest_rows(rows)


def test_only_host_memory_is_digested() -> None:
    check_host("cpu")
    with pytest.raises(DigestError, match="verify_kv=false"):
        check_host("cuda")


def test_the_check_waits_for_both_digests_and_fails_closed() -> None:
    class P:
        landed_digest: bytes | None = None
        digest: bytes | None = None

    part = P()
    assert judge(part) is Check.WAIT  # type: ignore[arg-type]
    part.landed_digest = b"\x01" * 8
    assert judge(part) is Check.WAIT  # type: ignore[arg-type]
    part.digest = b""
    assert judge(part) is Check.MISSING  # type: ignore[arg-type]
    part.digest = b"\x02" * 8
    assert judge(part) is Check.MISMATCH  # type: ignore[arg-type]
    part.digest = b"\x01" * 8
    assert judge(part) is Check.VERIFIED  # type: ignore[arg-type]


@pytest.mark.parametrize(("environ", "error"), [
    ({"P2PKV_FAULT_CORRUPT_LANDED": "1"}, "P2PKV_ALLOW_FAULTS=1"),
    ({"P2PKV_FAULT_CORRUPT_LANDED": "1", "P2PKV_ALLOW_FAULTS": "yes"}, "P2PKV_ALLOW_FAULTS=1"),
    ({"P2PKV_FAULT_CORRUPT_LANDD": "0.5", "P2PKV_ALLOW_FAULTS": "1"}, "not a p2pkv fault"),
    ({"P2PKV_FAULT_CORRUPT_LANDED": "2", "P2PKV_ALLOW_FAULTS": "1"}, "not a probability"),
    ({"P2PKV_FAULT_CORRUPT_LANDED": "often", "P2PKV_ALLOW_FAULTS": "1"}, "not a probability"),
])
def test_faults_are_refused_unless_explicitly_allowed(environ: dict[str, str], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_faults(environ)


def test_faults_are_off_by_default_and_overwrite_landed_bytes_when_set() -> None:
    assert not load_faults({}).any and not load_faults({"P2PKV_FAULT_CORRUPT_LANDED": "0"}).any
    faults = load_faults({"P2PKV_FAULT_CORRUPT_LANDED": "1", "P2PKV_ALLOW_FAULTS": "1"})
    data = torch.zeros(64, dtype=torch.uint8)
    assert faults.corrupt(_rows((data.data_ptr() + 3, 8), (data.data_ptr() + 40, 8)), "any")
    assert data.nonzero().flatten().tolist() == list(range(3, 11)) and int(data[3]) == 0x3F  # the first row only
    half = Faults(corrupt_landed=0.5, rng=random.Random(0))
    hits = sum(half.corrupt(_rows((data.data_ptr(), 1))) for _ in range(200))
    assert 60 < hits < 140  # about half


def test_faults_can_be_aimed_at_chosen_requests() -> None:
    """``P2PKV_FAULT_REQUESTS``: only request ids containing it are hit (a shared engine's other requests not)."""
    faults = load_faults({"P2PKV_FAULT_CORRUPT_LANDED": "1", "P2PKV_ALLOW_FAULTS": "1",
                          "P2PKV_FAULT_REQUESTS": "p2pkv-fault"})
    data = torch.zeros(8, dtype=torch.uint8)
    assert not faults.corrupt(_rows((data.data_ptr(), 8)), "cmpl-0123-0")
    assert not data.any()
    assert faults.corrupt(_rows((data.data_ptr(), 8)), "cmpl-p2pkv-fault-7-0")
    assert data.tolist() == [0x3F] * 8


def test_a_prefill_rank_digests_only_rows_of_a_held_request(caplog: pytest.LogCaptureFixture) -> None:
    """The checks before a hold's rows are digested, in order: host memory, held with exactly those block ids,
    whole rows, every byte inside the held blocks; any failed one answers ``b""``; the hold stays unpinned."""
    _, views = make_kv_caches("LBHNC", seed=3, **SHAPE)
    layout = describe_torch_kv_caches(views, NUM_BLOCKS)
    holds = PrefillHolds(30.0)
    holds.hold("req", 1e12, (4, 5))
    digests = HoldDigests(holds, layout, "cpu")
    seg = layout.segments[0]
    inside = _rows((seg.addr + 4 * seg.block_stride, 2 * seg.length))  # blocks 4 and 5 of the first segment
    wire = inside.astype("<u8").tobytes()
    assert digests.on_digest("req", [4, 5], wire) == digest_rows(inside)
    assert digests.on_digest("other", [4, 5], wire) == b""  # not held
    assert digests.on_digest("req", [4], wire) == b""  # other block ids than the hold's
    assert digests.on_digest("req", [4, 5], wire[:-1]) == b""  # not whole rows
    outside = _rows((seg.addr + 6 * seg.block_stride, seg.length)).astype("<u8").tobytes()
    assert digests.on_digest("req", [4, 5], outside) == b""  # a block not held
    assert HoldDigests(holds, layout, "cuda").on_digest("req", [4, 5], wire) == b""
    assert "digest of request req refused: digest_rows:" in caplog.text
    assert holds.pin("req", [4, 5]) == "held"  # nothing left pinned by the digests: one pin now, one unpin
    holds.unpin("req")
    assert not holds._pins


def _decode(mode: str, **cfg: object) -> WorkerSide:
    worker = make_worker("decode-engine", free_port(), transfer_mode=mode, **cfg)
    worker.model = model_info("LBHNC")
    return worker


def _corrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PKV_FAULT_CORRUPT_LANDED", "1")
    monkeypatch.setenv("P2PKV_ALLOW_FAULTS", "1")


def _faults_off(worker: WorkerSide) -> None:
    for mover in worker.receiver.moves.movers.values():
        if hasattr(mover, "faults"):
            mover.faults = None


LOCAL, REMOTE = [3, 4, 5, 20], [10, 11, 12, 7]


@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_a_read_that_did_not_happen_is_caught(prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """``P2PKV_FAULT_DROP_READ``: the READ moves one byte and is reported done, the blocks keep what they held
    (stale KV): the digest of what is there is not the prefill's, and the load fails instead of serving it."""
    prefill.lease(["dropped"])
    monkeypatch.setenv("P2PKV_FAULT_DROP_READ", "1")
    monkeypatch.setenv("P2PKV_ALLOW_FAULTS", "1")
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode("pull", verify_kv=True)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "dropped", prefill.port, LOCAL, REMOTE)]))
        assert run_until_received(worker, "d-1") == set(LOCAL)
        stats = worker.take_stats() or {}
        assert stats["failures"] == {"digest_mismatch": 1} and stats["kv_checks"] == {"pull:mismatch": 1}
        released_once_not_expired(prefill, "dropped", timeout_s=30)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_a_corrupted_landing_fails_its_load_and_the_next_is_unharmed(prefill: PrefillProc, mode: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A part's bytes overwritten as it lands (the operator's fault knob): the digests differ, the load fails
    (``digest_mismatch``, every block a load error, counted by direction, logged naming the request, the layer
    and blocks where the bytes differ, and both digests) and the prefill engine frees its hold; the next
    request, nothing injected, is verified and lands."""
    prefill.lease([f"{mode}-bad", f"{mode}-good"])
    _corrupting(monkeypatch)
    _, expected = make_kv_caches("LBHNC", seed=1, **SHAPE)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode(mode, verify_kv=True)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        with caplog.at_level(logging.WARNING, logger="p2pkv"):
            worker.start_load_kv(P2pKvMetadata(loads=[task("d-bad", f"{mode}-bad", prefill.port, LOCAL, REMOTE)]))
            assert run_until_received(worker, "d-bad") == set(LOCAL)
        assert "kind=digest_mismatch" in caplog.text and "KV digest mismatch for request 'd-bad'" in caplog.text
        assert f"prefill request '{mode}-bad'" in caplog.text and ": landed " in caplog.text
        assert "differs at layer 0, blocks 3, 4, 5: landed" in caplog.text  # the first row: layer 0, blocks 3-5
        stats = worker.take_stats() or {}
        assert stats["failures"] == {"digest_mismatch": 1}
        assert stats["kv_checks"] == {f"{mode}:mismatch": 1}
        released_once_not_expired(prefill, f"{mode}-bad", timeout_s=30)
        _faults_off(worker)
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-good", f"{mode}-good", prefill.port, LOCAL, REMOTE)]))
        assert run_until_received(worker, "d-good") == set()
        for lb, rb in zip(LOCAL, REMOTE, strict=True):
            assert block_bytes(views, "LBHNC", lb) == block_bytes(expected, "LBHNC", rb)
        assert (worker.take_stats() or {})["kv_checks"] == {f"{mode}:verified": 1}
        released_once_not_expired(prefill, f"{mode}-good", timeout_s=30)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_without_the_check_the_same_corruption_is_served(prefill: PrefillProc, mode: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault with ``verify_kv`` off: the load is handed to vLLM with no error and bytes of it are not
    the prefill's (what the check is there to catch)."""
    prefill.lease([f"{mode}-served"])
    _corrupting(monkeypatch)
    _, expected = make_kv_caches("LBHNC", seed=1, **SHAPE)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode(mode)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", f"{mode}-served", prefill.port, LOCAL, REMOTE)]))
        assert run_until_received(worker, "d-1") == set()
        differ = [lb for lb, rb in zip(LOCAL, REMOTE, strict=True)
                  if block_bytes(views, "LBHNC", lb) != block_bytes(expected, "LBHNC", rb)]
        assert differ and set(differ) <= set(LOCAL[:3])  # the first row: the run of blocks 3, 4, 5 of one layer
        assert not (worker.take_stats() or {}).get("kv_checks")  # nothing checked
        released_once_not_expired(prefill, f"{mode}-served", timeout_s=30)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("prefill", ["LBHNC"], indirect=True)
def test_a_pull_whose_prefill_rank_gives_no_digest_fails_closed(prefill: PrefillProc,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A fence question asking for the digest of rows outside the held blocks (as a hostile or broken peer
    would send): the prefill rank digests nothing (``b""``), and the decode rank fails the load rather than
    serve bytes it could not check."""
    prefill.lease(["no-digest"])

    def elsewhere(read: Part, phase: fence.Phase) -> bytes:  # the rows one block on: block 32 is not held
        rows = fence_rows(read, phase)
        if rows:
            shifted = read.remote_descs.copy()
            shifted[:, 0] += np.uint64(read.peer.segments[0].block_stride)
            return shifted.astype("<u8").tobytes()
        return rows

    fence_rows = fence.digest_asked
    monkeypatch.setattr("p2pkv.decode.fence.digest_asked", elsewhere)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode("pull", verify_kv=True)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "no-digest", prefill.port, [1, 2], [30, 31])]))
        assert run_until_received(worker, "d-1") == {1, 2}
        stats = worker.take_stats() or {}
        assert stats["failures"] == {"digest_mismatch": 1} and stats["kv_checks"] == {"pull:missing": 1}
        released_once_not_expired(prefill, "no-digest", timeout_s=30)
    finally:
        worker.shutdown()
