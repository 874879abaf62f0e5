"""``scripts/bench_transfer.py`` end to end on a tiny shape, plus its synthetic-data helpers.

The end-to-end test spawns the real prefill process (NIXL over UCX loopback)
and checks that every method ran, moved the same bytes, pulled them exactly
(the benchmark compares one pulled request per method with its source byte
for byte) and that cross-layer coalescing never needs more descriptors than
the per-layer scheme. ``--device`` is checked on the CPU (parsing, failing
fast without CUDA, the script staying off the proxy's web stack)
and, on a GPU machine, end to end with the caches in GPU memory.
``--mode pull,push`` runs both directions over the same caches and checks
that each push moved the pulled bytes, exactly; ``--mode push`` alone pulls
nothing.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pkv.dataplane.plan import coalesce_runs
from p2pkv.testing import (
    KVShape,
    allocate_blocks,
    make_shaped_kv_caches,
    pattern_bytes,
    ranges_equal,
    run_ranges,
    size_cache,
)
from p2pkv.tools.bench import machine
from p2pkv.tools.bench.results import write_json
from tests import warm_processes
from tests.script_loader import SCRIPTS, load_script

transfer = load_script("bench_transfer")  # puts scripts/ on sys.path for its transfer_bench package
from transfer_bench import report  # noqa: E402
from transfer_bench.options import TransferBenchOptions, peak_rss_bytes  # noqa: E402
from transfer_bench.push import PUSH_METHODS, Pusher  # noqa: E402

METHODS, run_transfer_bench = transfer.METHODS, transfer.run_transfer_bench

TINY = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=16)


def test_bench_transfer_tiny_end_to_end(tmp_path) -> None:
    opts = TransferBenchOptions(shape=TINY, tokens=(64, 100), requests=2, fragmentation=2, quiet=True,
                                argv=["/src/scripts/bench_transfer.py", "--layers", "2"])
    t0 = time.monotonic()
    result = run_transfer_bench(opts)
    assert time.monotonic() - t0 < 60
    path = tmp_path / "bench.json"
    write_json(result, path)
    data = json.loads(path.read_text())

    assert data["command"] == "python scripts/bench_transfer.py --layers 2"
    assert data["machine"]["cpu_model"] and data["machine"]["versions"]["torch"]
    assert [e["tokens"] for e in data["results"]] == [64, 100]
    for entry in data["results"]:
        methods = entry["methods"]
        assert set(methods) == set(METHODS) | {"cross_layer_pool"}
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
    for entry in data["results"]:  # cross-layer blocks: one descriptor per contiguous run of blocks, at most
        cross = entry["methods"]["cross_layer"]["descriptors_per_request"]["all"]
        assert all(d <= r for d, r in zip(cross, entry["runs_per_request"]["all"], strict=True))
    table = report.format_table(result)
    assert all(name in table for name in (*METHODS, "cross_layer_pool"))
    assert data["config"]["device"] == "cpu" and data["config"]["nixl_mem_type"] == "DRAM"
    assert data["machine"]["device"]["type"] == "cpu"
    assert "cpu (host memory, NIXL DRAM)" in table.splitlines()[0]
    gpu = copy.deepcopy(result)
    gpu["machine"]["device"] = {"type": "cuda", "name": "Some GPU", "index": 0, "nixl_mem_type": "VRAM",
                                "total_memory_bytes": 80 << 30, "compute_capability": "9.0", "multiprocessors": 132,
                                "cuda_runtime": "13.0", "driver": None}
    gpu_table = report.format_table(gpu)
    assert "cuda:0 Some GPU (GPU memory, NIXL VRAM)" in gpu_table.splitlines()[0]
    assert "GPU Some GPU: 80.0 GiB" in gpu_table


def test_bench_transfer_pull_and_push(tmp_path: Path, capsys) -> None:
    path = tmp_path / "modes.json"
    t0 = time.monotonic()
    rc = transfer.main(["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "64,200",
                        "--requests", "2", "--fragmentation", "2", "--pool-threads", "0", "--mode", "pull,push",
                        "--quiet", "--json", str(path)])
    assert rc == 0
    assert time.monotonic() - t0 < 60
    data = json.loads(path.read_text())
    assert data["config"]["modes"] == ["pull", "push"]
    assert list(data["modes"]) == ["pull", "push"]
    assert data["modes"]["push"]["methods"] == list(PUSH_METHODS)
    assert set(data["setup"]["push_add_remote_agent_ms"]) == {"BLHNC", "LBHNC"}
    for entry in data["results"]:
        pulls, pushes = entry["methods"], entry["push"]
        assert set(pushes) == set(PUSH_METHODS) and set(PUSH_METHODS) < set(pulls)
        memcpy = pulls["memcpy"]
        assert memcpy["mode"] is None
        for name in PUSH_METHODS:
            pull, push = pulls[name], pushes[name]
            assert (pull["mode"], push["mode"]) == ("pull", "push")
            # Same requests, same blocks, same descriptor rows: the same bytes, both exact copies of the source.
            assert push["bytes_total"] == pull["bytes_total"] == 2 * entry["bytes_per_request"] > 0
            assert push["descriptors_per_request"] == pull["descriptors_per_request"]
            assert pull["verified"] is True and push["verified"] is True, name
            assert push["ratio_to_memcpy"] == pytest.approx(push["gbps"] / memcpy["gbps"])
            # The decode side waited for the notification of a WRITE the prefill saw finish.
            assert push["latency_ms"]["p50"] > 0 and push["writer_xfer_ms"]["p50"] > 0
            assert push["plan_us"]["p50"] > 0  # the prefill planned the WRITE (before the ask, untimed)
    table = capsys.readouterr().out
    assert "pull x memcpy" in table and "push x memcpy" in table and "yes/yes" in table
    assert "NO" not in table.split()


def test_bench_transfer_push_only(tmp_path: Path) -> None:
    path = tmp_path / "push.json"
    rc = transfer.main(["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "64", "--requests", "2",
                        "--mode", "push", "--quiet", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert list(data["modes"]) == ["push"]
    (entry,) = data["results"]
    assert set(entry["methods"]) == {"memcpy"}  # nothing pulled
    assert set(entry["push"]) == set(PUSH_METHODS)
    for name, m in entry["push"].items():
        assert m["verified"] is True, f"{name} pushed wrong bytes"
        assert m["bytes_total"] == entry["methods"]["memcpy"]["bytes_total"] > 0
    assert data["processes"]["prefill_notifications"] == 0  # no READ was announced: nothing was pulled


def test_bench_transfer_stream_writes_each_layer_and_waits_less_after_the_last(tmp_path: Path) -> None:
    """``--mode stream``: every way moves the exact bytes; a streamed request takes one WRITE per layer (posted by
    the forward's thread between layers, so none is batched however loaded the machine), its bulk twin one WRITE,
    and the table shows both. (The poster thread's batching: ``tests/test_streamer.py``.)"""
    path = tmp_path / "stream.json"
    rc = transfer.main(["--layers", "4", "--kv-heads", "2", "--head-dim", "16", "--tokens", "256", "--requests", "2",
                        "--mode", "stream", "--layer-ms", "3", "--poster", "inline", "--quiet", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    (entry,) = data["results"]
    assert set(entry["stream"]) == {f"{m}/{w}" for m in ("cross_layer", "per_layer") for w in ("stream", "bulk")}
    for name, r in entry["stream"].items():
        assert r["verified"] is True, f"{name} moved wrong bytes"
        assert r["writes"]["all"] == ([4, 4] if name.endswith("/stream") else [1, 1])
        assert r["compute_ms"]["min"] >= 4 * 3 * 0.9  # the stand-in forward ran its layers
        assert r["wait_after_last_layer_ms"]["p50"] > 0
    assert entry["stream"]["cross_layer/stream"]["layer_transfer_ms"] > 0
    assert "stream vs bulk push" in report.format_table(data)
    with pytest.raises(ValueError, match="--layer-ms 0"):
        transfer.check_options(TransferBenchOptions(shape=TINY, tokens=(64,), modes=("stream",), layer_ms=0))


def test_forward_stream_flag_parses_and_is_checked() -> None:
    """``--forward-stream`` (the CUDA stream of the stand-in forward): current by default, side on request, any
    other value refused by the parser and by the forward itself (the prefill process gets it in a message)."""
    from transfer_bench.stream import Forward

    parser = transfer.build_parser()
    assert parser.parse_args([]).forward_stream == "current"
    assert parser.parse_args(["--forward-stream", "side"]).forward_stream == "side"
    with pytest.raises(SystemExit):
        parser.parse_args(["--forward-stream", "default"])
    with pytest.raises(ValueError, match="--forward-stream default"):
        Forward("cpu", 1.0, "default")
    assert Forward("cpu", 1.0, "side").stream is None  # no CUDA stream on the CPU


def test_mode_flag_parses() -> None:
    parser = transfer.build_parser()
    assert parser.parse_args([]).mode == ("pull",)
    assert parser.parse_args(["--mode", "push, pull"]).mode == ("push", "pull")
    for bad in ("sideways", "pull,pull", ","):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--mode", bad])
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="--mode"):
        transfer.check_options(TransferBenchOptions(shape=TINY, tokens=(64,), modes=()))


def test_pusher_answers_bad_requests_with_errors() -> None:
    pusher = Pusher({}, {}, 8)
    assert pusher.handle({"op": "push_sideways"})["op"] == "error"
    reply = pusher.handle({"op": "push", "id": 3})  # never planned
    assert reply["op"] == "error" and "push" in reply["error"]
    assert pusher.handle({"op": "push_peer", "infos": {"BLHNC": "not an AgentInfo"}})["op"] == "error"


def test_device_flag_parses() -> None:
    parser = transfer.build_parser()
    assert parser.parse_args([]).device == "cpu"
    for gone in ("--role", "--peer", "--control-port"):  # one host only: nixlbench / kvbench cover several
        with pytest.raises(SystemExit):
            parser.parse_args([gone, "x"])
    assert parser.parse_args(["--device", "cuda", "--tokens", "1k,4k"]).device == "cuda"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--device", "tpu"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="--device cuda:x"):
        transfer.resolve_device("cuda:x")
    assert str(transfer.resolve_device("cpu")) == "cpu"


def test_device_cuda_without_cuda_fails_fast(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t0 = time.monotonic()
    rc = transfer.main(["--device", "cuda", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "64"])
    assert rc == 2
    assert time.monotonic() - t0 < 5
    assert not warm_processes.others()  # refused before the prefill process started
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA device" in err and "--device cpu" in err


def test_module_entry_avoids_web_stack() -> None:
    """``python scripts/bench_transfer.py`` (as run on a GPU machine) parses the flags without the proxy's imports."""
    code = """
import runpy, sys
import torch
torch.cuda.is_available = lambda: False
sys.argv = [SCRIPT, "--device", "cuda", "--tokens", "64"]
try:
    runpy.run_path(SCRIPT, run_name="__main__")
    rc = 0
except SystemExit as exc:
    rc = exc.code
web = sorted(m for m in sys.modules if m.split(".")[0] in {"fastapi", "httpx", "starlette", "uvicorn", "vllm"})
print(rc, web)
"""
    code = code.replace("SCRIPT", repr(str(SCRIPTS / "bench_transfer.py")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "2 []", out.stdout + out.stderr
    assert "--device cuda" in out.stderr


def test_machine_and_memory_records() -> None:
    assert report.device_text({"machine": machine.machine_info("cpu")}) == "cpu (host memory, NIXL DRAM)"
    assert peak_rss_bytes() > 0


def test_command_line_names_the_module_or_script() -> None:
    assert machine.command_line(["/home/u/p2pkv/p2pkv/tools/bench/serve.py", "--runs", "2"]) == (
        "python -m p2pkv.tools.bench.serve --runs 2")
    assert machine.command_line(["/home/u/p2pkv/scripts/bench_transfer.py", "--device", "cuda"]) == (
        "python scripts/bench_transfer.py --device cuda")
    assert machine.command_line(["/usr/local/bin/p2pkv", "bench", "transfer"]) == "p2pkv bench transfer"


@pytest.mark.gpu
def test_bench_transfer_tiny_cuda() -> None:
    opts = TransferBenchOptions(shape=TINY, tokens=(64,), requests=1, fragmentation=2, device="cuda", quiet=True,
                                max_mem_gib=2.0, modes=("pull", "push"),
                                argv=["/src/scripts/bench_transfer.py", "--device", "cuda", "--mode", "pull,push"])
    result = run_transfer_bench(opts)
    dev = result["machine"]["device"]
    assert dev["type"] == "cuda" and dev["name"] == torch.cuda.get_device_name(dev["index"])
    assert result["config"]["device"] == f"cuda:{dev['index']}" and result["config"]["nixl_mem_type"] == "VRAM"
    (entry,) = result["results"]
    assert set(entry["methods"]) == set(METHODS) | {"cross_layer_pool"}
    for name, m in entry["methods"].items():
        assert m["verified"] is True, f"{name} pulled wrong bytes"
        assert m["gbps"] > 0
    assert set(entry["push"]) == set(PUSH_METHODS)
    for name, m in entry["push"].items():  # the prefill's WRITEs from its GPU memory into the decode's
        assert m["verified"] is True, f"{name} pushed wrong bytes"
        assert m["bytes_total"] == entry["methods"][name]["bytes_total"]
    assert result["processes"]["decode_peak_gpu_bytes"] > 0 and result["processes"]["prefill_peak_gpu_bytes"] > 0
    assert "NIXL VRAM" in report.format_table(result).splitlines()[0]


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
