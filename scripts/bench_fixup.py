#!/usr/bin/env python3
"""The post-receive fixup (:func:`p2pkv.dataplane.fixup.fixup_pages`) vs a plain copy (docs/benchmarks/fixup.md).

For a model KV shape (default Llama-3-8B: 32 layers, 8 KV heads, head_dim
128, bfloat16; ``P = 2 * layers`` pages per block: each layer's K and V) and
one request of ``--tokens`` tokens, each case fills a staging area in one
page format and moves it into a destination cache in another, with a random
permutation of destination block ids:

* ``block16to64`` / ``block64to16``: re-block, NHD on both sides;
* ``hnd_to_nhd`` / ``nhd_to_hnd``: permute, block 16 on both sides;
* ``tp_split``: prefill TP=1 (8 heads) → decode TP=2 rank 1 (heads 4..8 → 0..4);
* ``tp_merge``: prefill TP=2 rank 1 (4 heads) → decode TP=1 (heads 0..4 → 4..8);
* ``all``: block 32 HND, 4 heads → block 16 NHD heads 4..8 of 8, starting at
  staging token 8 (partial first and last staging blocks).

Bytes are counted once, as in a copy: ``num_tokens * P * num_heads *
head_elems * itemsize`` (``num_heads``: the heads moved). The baseline is
``dst_flat[:bytes].copy_(src_flat[:bytes])`` over the same two allocations
on the same device, measured in the same run next to each case. GB/s = 1e9
bytes per second of the median iteration; "x copy" = fixup GB/s / copy GB/s.
Implementations (``--impls``): ``torch`` (``index_put_``), ``runs`` (one
``copy_`` per run of tokens) and, on CUDA, ``triton``; see :mod:`p2pkv.dataplane.fixup`.
On CUDA the device memory one call allocates beyond its inputs is recorded
(``peak_extra_bytes``: the index grids; the source view is never copied).
On CUDA each iteration is timed with CUDA events (start recorded, the call
made, end recorded and waited for: the host's launch overhead counts); on CPU
with ``timeit`` (``time.perf_counter``). On CUDA a second figure, "back to back", times
``--iters`` calls queued without waiting (one event pair around them), as a
pipelined caller sees it. Before timing, each implementation's output is
compared bitwise with :func:`p2pkv.testing.fixup_reference` on the first and
last page of every block (whole pages: untouched blocks and heads included).

    PYTHONPATH=. python scripts/bench_fixup.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import sys
import timeit
from dataclasses import dataclass
from typing import Any

from p2pkv.testing import fixup_reference
from p2pkv.tools.bench.machine import command_line, machine_info, version
from p2pkv.tools.bench.results import write_json
from p2pkv.tools.bench.table import grid_lines, yes_no

CASE_NAMES = ("block16to64", "block64to16", "hnd_to_nhd", "nhd_to_hnd", "tp_split", "tp_merge", "all")

BYTES_CONVENTION = ("bytes = num_tokens * pages * heads_moved * head_elems * itemsize, counted once as in "
                    "a copy; GB/s = 1e9 bytes/s of the median iteration")


@dataclass(frozen=True)
class Case:
    """One fixup to measure: source/destination page formats (as tuples) and the head slice."""

    name: str
    src: tuple[str, int, int]  # (layout, num_heads, block_size)
    dst: tuple[str, int, int]
    src_head_start: int = 0
    dst_head_start: int = 0
    num_heads: int | None = None
    src_token_offset: int = 0


def make_cases(kv_heads: int) -> dict[str, Case]:
    """The benchmark cases for a model with ``kv_heads`` KV heads (split in two for the TP cases)."""
    h, half = kv_heads, max(1, kv_heads // 2)
    cases = [
        Case("block16to64", ("NHD", h, 16), ("NHD", h, 64)),
        Case("block64to16", ("NHD", h, 64), ("NHD", h, 16)),
        Case("hnd_to_nhd", ("HND", h, 16), ("NHD", h, 16)),
        Case("nhd_to_hnd", ("NHD", h, 16), ("HND", h, 16)),
        Case("tp_split", ("NHD", h, 16), ("NHD", half, 16), src_head_start=h - half, num_heads=half),
        Case("tp_merge", ("NHD", half, 16), ("NHD", h, 16), dst_head_start=h - half, num_heads=half),
        Case("all", ("HND", half, 32), ("NHD", h, 16), dst_head_start=h - half, num_heads=half,
             src_token_offset=8),
    ]
    return {c.name: c for c in cases}


def _timed(fn: Any, device: Any, warmup: int, iters: int, queued: bool = False) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones; ``queued`` (CUDA only):
    one seconds-per-call figure of ``iters`` calls queued back to back (one event pair around all of them)."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return timeit.repeat(fn, number=1, repeat=iters)
    torch.cuda.synchronize(device)
    out = []
    for _ in range(1 if queued else iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters if queued else 1):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / (iters if queued else 1))
    return out


def run_case(case: Case, *, device: Any, dtype: Any, pages: int, head_elems: int, tokens: int, impls: list[str],
             iters: int, warmup: int, seed: int, verify: bool) -> dict[str, Any]:
    """Measure one case: the copy baseline and each implementation; returns a JSON-able dict."""
    import torch

    from p2pkv.dataplane.fixup import PageFormat

    sf = PageFormat(case.src[0], case.src[1], case.src[2], head_elems)
    df = PageFormat(case.dst[0], case.dst[1], case.dst[2], head_elems)
    nh = case.num_heads or sf.num_heads
    off = case.src_token_offset
    gen = torch.Generator(device=device).manual_seed(seed)
    s_blocks = -(-(off + tokens) // sf.block_size)
    d_blocks = -(-tokens // df.block_size)
    src = torch.empty(pages, s_blocks, sf.page_elems, dtype=dtype, device=device)
    dst = torch.empty(pages, d_blocks, df.page_elems, dtype=dtype, device=device)
    for t in (src, dst):
        t.view(torch.uint8).random_(0, 256, generator=gen)
    ids = torch.randperm(d_blocks, generator=gen, device=device)
    nbytes = tokens * pages * nh * head_elems * src.element_size()
    src_flat, dst_flat = src.view(-1).view(torch.uint8)[:nbytes], dst.view(-1).view(torch.uint8)[:nbytes]
    args = (src, sf, dst, df, ids, tokens, off, case.src_head_start, case.dst_head_start, case.num_heads)
    orig = dst.clone()
    check_pages = sorted({0, pages - 1})
    expected = None
    if verify:
        expected = orig[check_pages].cpu()
        fixup_reference(src[check_pages].cpu(), sf, expected, df, ids.cpu(), tokens, off, case.src_head_start,
                        case.dst_head_start, case.num_heads)
    copy_s = _timed(lambda: dst_flat.copy_(src_flat), device, warmup, iters)
    copy_med = statistics.median(copy_s)
    copy_pipe = _timed(lambda: dst_flat.copy_(src_flat), device, 0, iters, True)[0] if device.type == "cuda" else None
    out: dict[str, Any] = {
        "name": case.name, "src_fmt": f"{sf.layout} bs{sf.block_size} h{sf.num_heads}",
        "dst_fmt": f"{df.layout} bs{df.block_size} h{df.num_heads}", "src_head_start": case.src_head_start,
        "dst_head_start": case.dst_head_start, "num_heads": nh, "src_token_offset": off, "bytes": nbytes,
        "copy": {"ms": copy_med * 1e3, "gbps": nbytes / copy_med / 1e9, "all_ms": [x * 1e3 for x in copy_s],
                 "pipelined_gbps": nbytes / copy_pipe / 1e9 if copy_pipe else None},
        "impls": {},
    }
    for impl in impls:
        dst.copy_(orig)
        out["impls"][impl] = _measure_impl(impl, args, dst, check_pages, expected, nbytes, out["copy"], copy_pipe,
                                           device, warmup, iters)
    del src, dst, orig
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _measure_impl(impl: str, args: tuple, dst: Any, check_pages: list[int], expected: Any, nbytes: int,
                  copy: dict[str, Any], copy_pipe: float | None, device: Any, warmup: int,
                  iters: int) -> dict[str, Any]:
    """One implementation of one case: bytes checked against ``expected``, then timed (ms, GB/s, × copy)."""
    import torch

    from p2pkv.dataplane.fixup import fixup_pages

    extra = None
    if device.type == "cuda":  # device memory the call allocates beyond its inputs (index grids only)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    fixup_pages(*args, impl=impl)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
    verified = None
    if expected is not None:
        verified = bool(torch.equal(dst[check_pages].cpu().view(torch.uint8), expected.view(torch.uint8)))
    times = _timed(lambda: fixup_pages(*args, impl=impl), device, warmup, iters)
    med = statistics.median(times)
    gbps = nbytes / med / 1e9
    m: dict[str, Any] = {"ms": med * 1e3, "gbps": gbps, "x_copy": gbps / copy["gbps"],
                         "all_ms": [x * 1e3 for x in times], "verified": verified, "peak_extra_bytes": extra}
    if copy_pipe:
        pipe = nbytes / _timed(lambda: fixup_pages(*args, impl=impl), device, 0, iters, True)[0] / 1e9
        m.update(pipelined_gbps=pipe, pipelined_x_copy=pipe / copy["pipelined_gbps"])
    return m


def run_fixup_bench(*, device: str = "cpu", tokens: int = 4096, layers: int = 32, kv_heads: int = 8,
                    head_dim: int = 128, dtype: str = "bfloat16", iters: int = 10, warmup: int = 2,
                    cases: tuple[str, ...] = CASE_NAMES, impls: tuple[str, ...] | None = None, seed: int = 0,
                    verify: bool = True, threads: int = 0, quiet: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-able dict (see the module docstring for units).

    ``impls`` None means ``("torch", "runs")`` on CPU, plus ``"triton"`` on
    CUDA where Triton imports. ``threads`` > 0 sets torch's CPU threads (for
    the copy baseline and the fixup alike); 0 keeps torch's default.

    Raises:
        ValueError: unknown device, dtype, case or implementation, or CUDA asked for without one.
    """
    import torch

    from p2pkv.dataplane.fixup import IMPLS, triton_available

    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    table = make_cases(kv_heads)
    unknown = [c for c in cases if c not in table]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(table)}")
    if impls is None:
        impls = ("torch", "runs", "triton") if dev.type == "cuda" and triton_available() else ("torch", "runs")
    if any(i not in IMPLS for i in impls):
        raise ValueError(f"impls must be among {IMPLS}, got {impls}")
    if threads > 0:
        torch.set_num_threads(threads)
    pages = 2 * layers
    results = []
    for name in cases:
        if not quiet:
            print(f"[fixup bench] {name} ...", file=sys.stderr, flush=True)
        results.append(run_case(table[name], device=dev, dtype=tdtype, pages=pages, head_elems=head_dim,
                                tokens=tokens, impls=list(impls), iters=iters, warmup=warmup, seed=seed,
                                verify=verify))
    machine = {**machine_info(str(dev)), "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
               "loadavg": list(os.getloadavg())}
    if dev.type == "cuda":
        machine.update(gpu=machine["device"]["name"], triton=version("triton"))
    return {"bench": "fixup", "command": command_line(sys.argv), "device": str(dev), "machine": machine,
            "shape": {"layers": layers, "pages": pages, "kv_heads": kv_heads, "head_dim": head_dim,
                      "dtype": dtype},
            "tokens": tokens, "iters": iters, "warmup": warmup, "seed": seed, "impls": list(impls),
            "bytes_convention": BYTES_CONVENTION, "cases": results}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of a :func:`run_fixup_bench` result."""
    impls = result["impls"]
    header = ["case", "src", "dst", "heads", "MiB", "copy GB/s"]
    for impl in impls:
        header += [f"{impl} GB/s", "x copy"]
    header.append("bytes ok")
    rows = []
    for c in result["cases"]:
        heads = f"{c['src_head_start']}:{c['src_head_start'] + c['num_heads']}" \
                f"->{c['dst_head_start']}:{c['dst_head_start'] + c['num_heads']}"
        row = [c["name"], c["src_fmt"], c["dst_fmt"], heads, f"{c['bytes'] / 2**20:.0f}", f"{c['copy']['gbps']:.1f}"]
        for impl in impls:
            m = c["impls"][impl]
            row += [f"{m['gbps']:.1f}", f"{m['x_copy']:.2f}"]
        ok = [c["impls"][i]["verified"] for i in impls]
        row.append("n/a" if any(v is None for v in ok) else yes_no(all(ok)))
        rows.append(row)
    lines = grid_lines(header, rows)
    if all(c["copy"].get("pipelined_gbps") for c in result["cases"]):
        lines += ["", f"back to back ({result['iters']} calls queued, one timing around them):"]
        header = ["case", "copy GB/s"] + [h for impl in impls for h in (f"{impl} GB/s", "x copy")]
        rows = [[c["name"], f"{c['copy']['pipelined_gbps']:.1f}"]
                + [v for impl in impls for v in (f"{c['impls'][impl]['pipelined_gbps']:.1f}",
                                                 f"{c['impls'][impl]['pipelined_x_copy']:.2f}")]
                for c in result["cases"]]
        lines += grid_lines(header, rows)
    shape = result["shape"]
    lines.append(f"per call: each call timed alone (synchronized), host overhead included. "
                 f"device {result['device']} ({result['machine'].get('gpu') or result['machine'].get('cpu_model')}); "
                 f"{result['tokens']} tokens, {shape['pages']} pages x {shape['kv_heads']} kv heads x "
                 f"{shape['head_dim']} {shape['dtype']}; median of {result['iters']} iterations; "
                 + BYTES_CONVENTION)
    return "\n".join(lines)


def _names(text: str) -> tuple[str, ...]:
    """``"a, b"`` → ``("a", "b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of this script (each named as :func:`run_fixup_bench`'s keyword)."""
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the request")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before each measurement")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name, e.g. bfloat16, float16, float32")
    p.add_argument("--cases", type=_names, default=CASE_NAMES, help=f"comma-separated, among {', '.join(CASE_NAMES)}")
    p.add_argument("--impls", type=_names, default=None, help="comma-separated among torch, runs, triton, auto "
                                                               "(default: torch,runs, plus triton on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the bitwise check against fixup_reference")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def cli_main(args: argparse.Namespace) -> int:
    """Run the bench from parsed arguments; exit code 1 when a check failed."""
    import torch

    kwargs = {k: v for k, v in vars(args).items() if k in inspect.signature(run_fixup_bench).parameters}
    kwargs["device"] = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        result = run_fixup_bench(**kwargs)
    except ValueError as exc:
        print(f"bench_fixup: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        write_json(result, args.json, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(m["verified"] is not False for c in result["cases"] for m in c["impls"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    """``python scripts/bench_fixup.py [options]``."""
    parser = argparse.ArgumentParser(prog="bench_fixup.py", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return cli_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
