"""``p2pkv bench transfer`` end to end on a tiny shape, plus its synthetic-data helpers.

The end-to-end test spawns the real prefill process (NIXL over UCX loopback)
and checks that every method ran, moved the same bytes, pulled them exactly
(the benchmark compares one pulled request per method with its source byte
for byte) and that cross-layer coalescing never needs more descriptors than
the per-layer scheme.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from p2pkv.bench import report
from p2pkv.bench.synth import (
    KVShape,
    allocate_blocks,
    make_shaped_kv_caches,
    pattern_bytes,
    ranges_equal,
    run_ranges,
    size_cache,
)
from p2pkv.bench.transfer import METHODS, TransferBenchOptions, run_transfer_bench
from p2pkv.plan import coalesce_runs

TINY = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=16)


def test_bench_transfer_tiny_end_to_end(tmp_path) -> None:
    opts = TransferBenchOptions(shape=TINY, tokens=(64, 100), requests=2, fragmentation=2, quiet=True,
                                argv=["p2pkv", "bench", "transfer", "--layers", "2"])
    t0 = time.monotonic()
    result = run_transfer_bench(opts)
    assert time.monotonic() - t0 < 60
    path = tmp_path / "bench.json"
    report.write_json(result, path)
    data = json.loads(path.read_text())

    assert data["command"] == "p2pkv bench transfer --layers 2"
    assert data["machine"]["cpu_model"] and data["machine"]["versions"]["torch"]
    assert [e["tokens"] for e in data["results"]] == [64, 100]
    for entry in data["results"]:
        methods = entry["methods"]
        assert set(methods) == set(METHODS)
        blocks = TINY.blocks_for(entry["tokens"])
        assert entry["blocks_per_request"] == blocks
        assert {m["bytes_total"] for m in methods.values()} == {2 * blocks * TINY.block_bytes}
        for name, m in methods.items():
            assert m["verified"] is True, f"{name} pulled wrong bytes"
            assert m["gbps"] > 0 and m["latency_ms"]["p50"] > 0
        cross, per_layer = methods["cross_layer"], methods["per_layer"]
        for c, p, runs in zip(cross["descriptors_per_request"]["all"], per_layer["descriptors_per_request"]["all"],
                              entry["runs_per_request"]["all"], strict=True):
            assert c <= p
            assert c == runs
            assert p == blocks * TINY.num_layers
        assert methods["layer_coalesced"]["descriptors_per_request"]["mean"] == (
            entry["runs_per_request"]["mean"] * TINY.num_layers)
    for peer in ("BLHNC", "LBHNC"):
        setup = data["setup"]["peers"][peer]
        assert setup["setup_ms"] == setup["handshake_ms"] + setup["add_remote_agent_ms"]
        assert "first_pull_ms" in setup
    assert {t["name"] for t in data["targets"]} >= {"cross_layer_vs_memcpy", "descriptors_le_runs",
                                                   "first_request_setup_ms"}
    assert next(t for t in data["targets"] if t["name"] == "descriptors_le_runs")["met"] is True
    table = report.format_table(result)
    assert all(name in table for name in METHODS)


def test_allocate_blocks_gives_distinct_ids_in_bounded_runs() -> None:
    rng = np.random.default_rng(0)
    for max_run in (0, 1, 3, 32):
        ids = allocate_blocks(rng, 200, 150, max_run)
        assert ids.size == 150 and np.unique(ids).size == 150
        assert ids.min() >= 0 and ids.max() < 200
        breaks = np.flatnonzero(np.diff(ids) != 1)
        if max_run == 0:
            assert breaks.size == 0
        elif max_run == 1:
            # Chunks of one block: consecutive ids only where two chunks happen to meet.
            assert breaks.size > 100
        else:
            # Shuffled chunks can meet by chance, so a run may exceed max_run only that way.
            assert breaks.size >= 150 // max_run - 1


def test_size_cache_shrinks_and_skips_what_does_not_fit() -> None:
    block = TINY.block_bytes
    nb, fits, warnings = size_cache(TINY, (64, 1024), 2, 0, 2 * 40 * block)
    assert nb == 40 and fits == [64] and any("skipping 1024" in w for w in warnings)
    nb, fits, warnings = size_cache(TINY, (64,), 2, 1000, 2 * 40 * block)
    assert nb == 40 and fits == [64] and any("shrunk" in w for w in warnings)


def test_pattern_check_catches_a_single_wrong_byte() -> None:
    base, _ = make_shaped_kv_caches("BLHNC", TINY, 8, fill="pattern", seed=5)
    raw = base.view(-1).view(torch.uint8)
    assert torch.equal(raw[: TINY.block_bytes], pattern_bytes(0, TINY.block_bytes, 5))
    loc, rem, lens = coalesce_runs([0, 1], [0, 1], 8, 8)
    ranges = run_ranges([(0, TINY.block_bytes, TINY.block_bytes)], loc, rem, lens)
    assert ranges_equal(raw, ranges, None, 5)
    assert not ranges_equal(raw, ranges, None, 6)
    raw[TINY.block_bytes + 3] ^= 1
    assert not ranges_equal(raw, ranges, None, 5)
