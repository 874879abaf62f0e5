"""What a per-page digest of KV costs on this machine, by candidate, against copying the same bytes.

Groundwork for verified KV (a digest of every page a transfer moves, computed by the producer over what it sends
and by the consumer over what landed): a Llama-3-8B-shaped cache (32 layers, 8 KV heads x 128, bfloat16: 128 KiB
per token), ``--tokens`` tokens in pages of one layer's K or V of one block (``--block-size`` tokens: 4 KiB x
block size), and per candidate the seconds to digest every page of the request, with a copy of the same bytes
(``torch`` ``copy_``, what a transfer over ``cma`` costs the host at least) measured in the same run as the
baseline. Candidates:

- ``crc32``: :func:`zlib.crc32` per page (the standard library);
- ``blake2b-64``: :func:`hashlib.blake2b` with an 8-byte digest per page (the standard library);
- ``xxh3-64``: ``xxhash.xxh3_64`` per page (the ``xxhash`` package, when installed; not a p2pkv dependency);
- ``torch-weighted``: every page viewed as int64 words, their sum weighted by a fixed random int64 vector
  (wrapping), one vectorised op over all pages at once (what runs on a GPU too);
- ``torch-sum``: the pages' int64 words summed (the cheapest vectorised form; blind to reordered words).

Each is run ``--repeats`` times; the best and the median are reported (ms), with GB/s and the ratio to the copy.

    python scripts/bench_digest.py --tokens 1024,4096 --json docs/benchmarks/digest-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import timeit
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

LAYERS, KV_HEADS, HEAD_DIM, ELEMENT_BYTES = 32, 8, 128, 2
"""Llama-3-8B's KV shape (bfloat16)."""


def _pages(tokens: int, block_size: int) -> torch.Tensor:
    """Random KV bytes of ``tokens`` tokens as pages: uint8 ``[pages, page_bytes]``, one page per layer, K or V,
    and block (``page_bytes`` = block_size x KV_HEADS x HEAD_DIM x ELEMENT_BYTES)."""
    blocks = -(-tokens // block_size)
    page_bytes = block_size * KV_HEADS * HEAD_DIM * ELEMENT_BYTES
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (LAYERS * 2 * blocks, page_bytes), dtype=torch.uint8, generator=generator)


def _per_page(fn: Callable[[memoryview], object]) -> Callable[[torch.Tensor], object]:
    def run(pages: torch.Tensor) -> object:
        array = pages.numpy()
        return [fn(memoryview(row)) for row in array]
    return run


def _weighted(pages: torch.Tensor) -> torch.Tensor:
    words = pages.view(torch.int64)
    weights = torch.randint(-(2**62), 2**62, (words.shape[1],), dtype=torch.int64,
                            generator=torch.Generator().manual_seed(1))
    return (words * weights).sum(dim=1)


def _candidates() -> dict[str, Callable[[torch.Tensor], object]]:
    out: dict[str, Callable[[torch.Tensor], object]] = {
        "crc32": _per_page(zlib.crc32),
        "blake2b-64": _per_page(lambda b: hashlib.blake2b(b, digest_size=8).digest()),
    }
    try:
        import xxhash

        out["xxh3-64"] = _per_page(xxhash.xxh3_64_intdigest)
    except ImportError:
        pass
    out["torch-weighted"] = _weighted
    out["torch-sum"] = lambda pages: pages.view(torch.int64).sum(dim=1)
    return out


def _time(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed call (the warm-up)."""
    fn()
    return timeit.repeat(fn, number=1, repeat=repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per candidate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the transfer threads' share of a host)")
    ap.add_argument("--json", help="write the run here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        pages = _pages(tokens, args.block_size)
        target = torch.empty_like(pages)
        nbytes = pages.numel()
        copy = _time(lambda p=pages, t=target: t.copy_(p), args.repeats)
        row = {"tokens": tokens, "pages": pages.shape[0], "page_bytes": pages.shape[1], "bytes": nbytes,
               "copy_ms": {"best": min(copy) * 1e3, "median": statistics.median(copy) * 1e3}, "candidates": {}}
        for name, fn in _candidates().items():
            times = _time(lambda f=fn, p=pages: f(p), args.repeats)
            best = min(times)
            row["candidates"][name] = {"best_ms": best * 1e3, "median_ms": statistics.median(times) * 1e3,
                                       "gb_per_s": nbytes / best / 1e9, "over_copy": best / min(copy)}
        rows.append(row)
        print(f"{tokens} tokens: {nbytes / 2**20:.0f} MiB in {pages.shape[0]} pages of {pages.shape[1]} B; "
              f"copy {min(copy) * 1e3:.1f} ms")
        for name, c in row["candidates"].items():
            print(f"  {name:>15}: {c['best_ms']:8.1f} ms ({c['gb_per_s']:5.2f} GB/s, {c['over_copy']:5.2f}x the copy)")
    doc = {"benchmark": "digest", "command": " ".join(["python", *sys.argv]) if argv is None else argv,
           "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "numpy": np.__version__, "threads": args.threads},
           "block_size": args.block_size, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
