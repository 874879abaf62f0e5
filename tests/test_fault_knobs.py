"""The operator's fault knobs beyond a corrupted landing (``p2pkv.faults``): a stale READ, a delayed READ, a
dropped WRITE. Each is parsed and refused like the others, and each is shown through two real processes with
NIXL agents: the stale READ and the dropped push WRITE are caught by verified KV (the load fails, never served,
the hold released, the next request unharmed), a delay shorter than the load's window only slows it (verified,
bytes equal), and a longer one ends the load at its window without a wrong byte handed over.

The dropped layer-stream WRITE is in tests/test_stream_abort.py (its in-process stream pair)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest

from p2pkv.config import ConfigError
from p2pkv.faults import DELAY_S, Faults, load_faults, rolled
from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import block_bytes, make_kv_caches
from p2pkv.worker import WorkerSide
from tests.fault_injection.support import released_once_not_expired
from tests.p2p_harness import PrefillProc, synthetic_rank
from tests.workers import NUM_BLOCKS, SHAPE, free_port, make_worker, model_info, run_until_received, task

ALLOW = {"P2PKV_ALLOW_FAULTS": "1"}
LOCAL, REMOTE = [3, 4, 5, 20], [10, 11, 12, 7]


def _rows(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def test_the_new_knobs_are_parsed_and_refused_like_the_others() -> None:
    faults = load_faults({"P2PKV_FAULT_STALE_READ": "1", "P2PKV_FAULT_DELAY_READ": "0.5",
                          "P2PKV_FAULT_DROP_WRITE": "0.25", "P2PKV_FAULT_DELAY_S": "3", **ALLOW})
    assert (faults.stale_read, faults.delay_read, faults.drop_write, faults.delay_s) == (1.0, 0.5, 0.25, 3.0)
    assert load_faults({"P2PKV_FAULT_DELAY_READ": "1", **ALLOW}).delay_s == DELAY_S
    assert not load_faults({"P2PKV_FAULT_DELAY_S": "5"}).any  # a delay alone injects nothing
    with pytest.raises(ConfigError, match="P2PKV_ALLOW_FAULTS=1"):
        load_faults({"P2PKV_FAULT_DROP_WRITE": "1"})
    for bad in ("0", "-1", "nan", "soon", "601"):
        with pytest.raises(ConfigError, match="P2PKV_FAULT_DELAY_S"):
            load_faults({"P2PKV_FAULT_DELAY_READ": "1", "P2PKV_FAULT_DELAY_S": bad, **ALLOW})


def test_a_stale_read_reads_other_rows_of_the_same_size_and_stays_inside_them() -> None:
    rows = _rows((100, 8, 0), (200, 8, 0), (300, 16, 0), (400, 8, 1))
    out = rolled(rows)
    assert out[:, 0].tolist() == [200, 400, 300, 100] and out[:, 2].tolist() == [0, 1, 0, 0]
    assert out[:, 1].tolist() == rows[:, 1].tolist()  # sizes kept: every byte READ lies in some given row
    one = _rows((100, 8, 0))
    assert Faults(stale_read=1.0).read_rows(one, one, "r")[1].tolist() == one.tolist()  # nothing to swap with


def test_a_dropped_write_moves_one_byte_and_a_delay_is_drawn_per_request() -> None:
    source, target = _rows((100, 64, 0), (300, 64, 0)), _rows((900, 64, 0), (1100, 64, 0))
    src, dst = Faults(drop_write=1.0).write_rows(source, target, "r")
    assert src.tolist() == [[100, 1, 0]] and dst.tolist() == [[900, 1, 0]]
    assert Faults(drop_write=1.0, requests="other").write_rows(source, target, "r")[0] is source
    assert Faults().write_rows(source, target, "r")[0] is source
    half = Faults(delay_read=0.5, delay_s=2.0, rng=random.Random(0))
    draws = [half.delay("r") for _ in range(200)]
    assert set(draws) == {0.0, 2.0} and 60 < draws.count(2.0) < 140


def _decode(mode: str, **cfg: object) -> WorkerSide:
    worker = make_worker("decode-engine", free_port(), transfer_mode=mode, **cfg)
    worker.model = model_info("LBHNC")
    return worker


DROPPING = {"P2PKV_FAULT_DROP_WRITE": "1", "P2PKV_FAULT_REQUESTS": "dropped", **ALLOW}


def _dropping_rank(port: int) -> list[tuple[WorkerSide, object]]:
    """:func:`tests.p2p_harness.synthetic_rank` built under :data:`DROPPING` (its WRITE engine loads the faults
    as it starts), the process's environment restored afterwards (prefill processes are reused)."""
    before = {name: os.environ.get(name) for name in DROPPING}
    os.environ.update(DROPPING)
    try:
        return synthetic_rank(1, 64, "LBHNC", 30.0, port)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProc]:
    """This module's prefill process (seed 1, ``LBHNC``), its push WRITEs of requests named ``dropped`` moving
    one byte (``P2PKV_FAULT_DROP_WRITE``), nothing injected for the others."""
    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0, layout="LBHNC", ranks=_dropping_rank)
    pf.start()
    try:
        yield pf
    finally:
        pf.stop()
    assert not pf.pinned_at_stop, f"holds still pinned by a WRITE at the end: {pf.pinned_at_stop}"


def _load(worker: WorkerSide, decode_request: str, prefill_request: str, port: int) -> tuple[set[int], dict]:
    worker.start_load_kv(P2pKvMetadata(loads=[task(decode_request, prefill_request, port, LOCAL, REMOTE)]))
    errors = run_until_received(worker, decode_request)
    return errors, worker.take_stats() or {}


def _caught_then_unharmed(prefill: PrefillProc, mode: str, bad: tuple[str, str], good: tuple[str, str]
                          ) -> tuple[dict, dict]:
    """A verified ``mode`` load of ``bad`` (decode request, prefill request) fails as a digest mismatch, its hold
    freed; then one of ``good`` is verified and lands the prefill's bytes, its hold freed. The two loads'
    ``kv_checks`` counts."""
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode(mode, verify_kv=True)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        errors, caught = _load(worker, *bad, prefill.port)
        assert errors == set(LOCAL) and caught["failures"] == {"digest_mismatch": 1}
        released_once_not_expired(prefill, bad[1], timeout_s=30)
        errors, unharmed = _load(worker, *good, prefill.port)
        assert errors == set() and _landed_as_sent(views)
        released_once_not_expired(prefill, good[1], timeout_s=30)
        return caught["kv_checks"], unharmed["kv_checks"]
    finally:
        worker.shutdown()


def _landed_as_sent(views: object) -> bool:
    _, expected = make_kv_caches("LBHNC", seed=1, **SHAPE)
    return all(block_bytes(views, "LBHNC", lb) == block_bytes(expected, "LBHNC", rb)
               for lb, rb in zip(LOCAL, REMOTE, strict=True))


def test_a_stale_read_is_caught_and_the_next_read_is_unharmed(prefill: PrefillProc,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``P2PKV_FAULT_STALE_READ``: each row of the pull READ from the next row's source (other blocks of the
    prefill's cache): the digests differ, the load fails (``digest_mismatch``) and the hold is freed; the next
    pull, not aimed at, is verified and its bytes are the prefill's."""
    prefill.lease(["stale-bad", "stale-good"])
    for name, value in {"P2PKV_FAULT_STALE_READ": "1", "P2PKV_FAULT_REQUESTS": "d-stale", **ALLOW}.items():
        monkeypatch.setenv(name, value)
    checks = _caught_then_unharmed(prefill, "pull", ("d-stale", "stale-bad"), ("d-next", "stale-good"))
    assert checks == ({"pull:mismatch": 1}, {"pull:verified": 1})


def test_without_the_check_a_stale_read_is_served(prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same stale READ with ``verify_kv`` off: handed to vLLM with no error, bytes not the prefill's (what the
    check is there to catch)."""
    prefill.lease(["stale-served"])
    for name, value in {"P2PKV_FAULT_STALE_READ": "1", **ALLOW}.items():
        monkeypatch.setenv(name, value)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode("pull")
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        errors, stats = _load(worker, "d-1", "stale-served", prefill.port)
        assert errors == set() and not stats.get("kv_checks") and not _landed_as_sent(views)
        released_once_not_expired(prefill, "stale-served", timeout_s=30)
    finally:
        worker.shutdown()


def test_a_delayed_read_within_its_window_is_only_slower(prefill: PrefillProc,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``P2PKV_FAULT_DELAY_READ`` of 0.5 s under a 30 s window: the load lands verified, bytes equal."""
    prefill.lease(["slow"])
    for name, value in {"P2PKV_FAULT_DELAY_READ": "1", "P2PKV_FAULT_DELAY_S": "0.5", **ALLOW}.items():
        monkeypatch.setenv(name, value)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode("pull", verify_kv=True)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        errors, stats = _load(worker, "d-slow", "slow", prefill.port)
        assert errors == set() and stats["kv_checks"] == {"pull:verified": 1} and _landed_as_sent(views)
        released_once_not_expired(prefill, "slow", timeout_s=30)
    finally:
        worker.shutdown()


def test_a_read_delayed_past_its_window_fails_the_load(prefill: PrefillProc,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ held back 5 s under a 1 s ``transfer_timeout_s``: the load ends at its window (a timeout, every
    block a load error), no block handed over as loaded; the next load, not aimed at, lands."""
    prefill.lease(["late", "after-late"])
    for name, value in {"P2PKV_FAULT_DELAY_READ": "1", "P2PKV_FAULT_DELAY_S": "5",
                        "P2PKV_FAULT_REQUESTS": "d-late", **ALLOW}.items():
        monkeypatch.setenv(name, value)
    _, views = make_kv_caches("LBHNC", fill=0.0, **SHAPE)
    worker = _decode("pull", transfer_timeout_s=1.0)
    worker.register_kv_caches(views, NUM_BLOCKS)
    try:
        errors, stats = _load(worker, "d-late", "late", prefill.port)
        assert errors == set(LOCAL) and stats["failures"] == {"timeout": 1}, stats
        errors, _ = _load(worker, "d-after", "after-late", prefill.port)
        assert errors == set() and _landed_as_sent(views)
        released_once_not_expired(prefill, "after-late", timeout_s=30)
    finally:
        worker.shutdown()


def test_a_dropped_push_write_is_caught_and_the_next_push_is_unharmed(prefill: PrefillProc) -> None:
    """``P2PKV_FAULT_DROP_WRITE`` on the prefill rank: its push WRITE moves one byte and notifies done with the
    digest of the whole rows: the decode rank's digest of what landed differs, the load fails (never served) and
    the hold is freed; the next push, not aimed at, is verified and lands whole."""
    prefill.lease(["dropped-push", "kept-push"])
    checks = _caught_then_unharmed(prefill, "push", ("d-1", "dropped-push"), ("d-2", "kept-push"))
    assert checks == ({"push:mismatch": 1}, {"push:verified": 1})
