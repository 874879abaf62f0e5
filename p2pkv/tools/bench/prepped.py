"""``p2pkv bench prepped``: the cost of building a READ with ``initialize_xfer`` vs prepared descriptor lists.

p2pkv builds each READ from descriptor rows (one per run of consecutive
blocks per segment) with ``get_xfer_descs`` + ``initialize_xfer``. NIXL's
other way, used by vLLM's ``NixlConnector``, prepares one descriptor per
(segment, block) once per peer (``prep_xfer_dlist``) and builds each READ
from index arrays (``make_prepped_xfer``). This benchmark times both in one
process with two NIXL agents over UCX (host memory, ``--segments`` regions of
``--blocks`` blocks of ``--block-bytes`` bytes each):

* ``init_rows``: ``get_xfer_descs`` × 2 + ``initialize_xfer`` on rows, runs
  of consecutive blocks coalesced (what p2pkv does);
* ``prepped``: ``make_prepped_xfer`` on the prepared lists, one index per
  (segment, block) (NIXL merges neighbours itself).

Each case pulls ``--pull-blocks`` blocks, every ``--stride``-th block (2:
no two neighbours, so nothing coalesces), and is timed as ``build`` (rows or
indices + the NIXL call, µs) and ``post`` (``transfer`` until a poll sees it
DONE, µs). Before timing, each case pulls into zeroed memory and the bytes
are compared with the source.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np


def _rows(bases: np.ndarray, blocks: np.ndarray, num_blocks: int, block_bytes: int,
          coalesce: bool = True) -> np.ndarray:
    """uint64 ``[rows, 3]`` descriptors from p2pkv's planner (:mod:`p2pkv.dataplane.plan`), segment-major:
    runs of consecutive ``blocks`` coalesced, or one row per block (``coalesce=False``)."""
    from p2pkv.dataplane.layout import Segment
    from p2pkv.dataplane.plan import build_descriptors, coalesce_runs

    segments = [Segment(int(a), block_bytes, block_bytes, i, 1) for i, a in enumerate(bases)]
    starts, _, lengths = coalesce_runs(blocks, blocks, num_blocks, num_blocks)
    if not coalesce:
        starts, lengths = blocks.astype(np.int64), np.ones(len(blocks), dtype=np.int64)
    return build_descriptors(segments, starts, lengths)


def run(segments: int, blocks: int, block_bytes: int, pull_blocks: int, stride: int, repeats: int) -> dict:
    """Time both ways of building a READ; returns ``{case: {build_us, post_us: {p50, mean}}, ...}``.

    Raises:
        RuntimeError: a pull moved wrong bytes or ended in error.
        ValueError: ``pull_blocks * stride`` exceeds ``blocks``.
    """
    from p2pkv.dataplane.agent import load_nixl

    if pull_blocks * stride > blocks:
        raise ValueError(f"--pull-blocks {pull_blocks} x --stride {stride} exceeds --blocks {blocks}")
    nixl_agent, nixl_agent_config = load_nixl()
    reader, owner = (nixl_agent(n, nixl_agent_config(backends=["UCX"])) for n in ("reader", "owner"))
    size = blocks * block_bytes
    local = [np.zeros(size, np.uint8) for _ in range(segments)]
    remote = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(segments)]
    for agent, bufs in ((reader, local), (owner, remote)):
        agent.register_memory([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    reader.add_remote_agent(owner.get_agent_metadata())
    lb, rb = (np.array([b.ctypes.data for b in bufs], dtype=np.uint64) for bufs in (local, remote))
    pulled = np.arange(pull_blocks) * stride
    every = np.arange(blocks)
    local_list = reader.prep_xfer_dlist("NIXL_INIT_AGENT", _rows(lb, every, blocks, block_bytes, False), "DRAM")
    remote_list = reader.prep_xfer_dlist("owner", _rows(rb, every, blocks, block_bytes, False), "DRAM")

    def init_rows() -> object:
        descs = (reader.get_xfer_descs(_rows(b, pulled, blocks, block_bytes), "DRAM") for b in (lb, rb))
        return reader.initialize_xfer("READ", *descs, "owner", b"")

    def prepped() -> object:
        idx = (np.arange(segments)[:, None] * blocks + pulled[None, :]).ravel().astype(np.int32)
        return reader.make_prepped_xfer("READ", local_list, idx, remote_list, idx, b"")

    def once(build: Callable[[], object]) -> tuple[float, float]:
        t0 = time.perf_counter()
        handle = build()
        t1 = time.perf_counter()
        state = reader.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = reader.check_xfer_state(handle)
        t2 = time.perf_counter()
        reader.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("a READ ended in error")
        return (t1 - t0) * 1e6, (t2 - t1) * 1e6

    result: dict = {"segments": segments, "blocks": blocks, "block_bytes": block_bytes, "pull_blocks": pull_blocks,
                    "stride": stride, "repeats": repeats, "cases": {}}
    for name, build in (("init_rows", init_rows), ("prepped", prepped)):
        for buf in local:
            buf[:] = 0
        once(build)
        for lbuf, rbuf in zip(local, remote, strict=True):
            for b in pulled:
                span = slice(int(b) * block_bytes, (int(b) + 1) * block_bytes)
                if not np.array_equal(lbuf[span], rbuf[span]):
                    raise RuntimeError(f"{name}: block {int(b)} differs from the source after the READ")
        times = np.array([once(build) for _ in range(repeats)])
        result["cases"][name] = {k: {"p50": float(np.median(times[:, i])), "mean": float(times[:, i].mean())}
                                 for i, k in enumerate(("build_us", "post_us"))}
        result["cases"][name]["descriptors"] = len(_rows(lb, pulled, blocks, block_bytes, name == "init_rows"))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``p2pkv bench prepped``."""
    p.add_argument("--segments", type=int, default=64, help="registered regions (layers x K/V in a per-layer cache)")
    p.add_argument("--blocks", type=int, default=512, help="blocks per region")
    p.add_argument("--block-bytes", type=int, default=4096, help="bytes per block per region")
    p.add_argument("--pull-blocks", type=int, default=16, help="blocks per READ")
    p.add_argument("--stride", type=int, default=2, help="pull every STRIDE-th block (1: all consecutive)")
    p.add_argument("--repeats", type=int, default=200, help="timed READs per case")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")


def cli_main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench prepped`` and print one line per case."""
    from p2pkv.tools.bench.report import write_json

    result = run(args.segments, args.blocks, args.block_bytes, args.pull_blocks, args.stride, args.repeats)
    for name, case in result["cases"].items():
        print(f"{name:>10}: {case['descriptors']:5d} rows, build p50 {case['build_us']['p50']:8.1f} us, "
              f"post->done p50 {case['post_us']['p50']:8.1f} us")
    if args.json:
        result["command"] = "p2pkv bench prepped " + " ".join(sys.argv[3:])
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
