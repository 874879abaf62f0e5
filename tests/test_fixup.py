"""p2pkv.dataplane.fixup: every implementation vs the loop reference, bitwise, over the whole destination."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.dataplane.fixup import PageFormat, fixup_pages, staging_pieces
from p2pkv.testing import fixup_reference
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
BLOCKS = [1, 2, 3, 4, 5, 8, 16]
ELEMS = [1, 2, 3, 4, 8, 16]


@dataclass(frozen=True)
class Spec:
    """One fixup problem: formats, head slice, tokens, and how the tensors are laid out in memory."""

    pages: int
    dtype: torch.dtype
    src_fmt: PageFormat
    dst_fmt: PageFormat
    num_heads: int
    src_head_start: int
    dst_head_start: int
    num_tokens: int
    src_token_offset: int
    extra_src_blocks: int
    extra_dst_blocks: int
    extra_ids: int
    src_block_major: bool  # src given as a transposed [S, P, ...] allocation
    dst_block_major: bool
    src_pad: int  # spare elements around each page (page stride > page size)
    dst_pad: int
    src_lead: int  # first page element's offset inside the padded row
    dst_lead: int
    seed: int


def _spec(pick) -> Spec:
    """A :class:`Spec` from ``pick(kind, *args)``: shared by hypothesis and plain random sampling."""
    c = pick("choice", ELEMS)
    sf = PageFormat(pick("choice", ["HND", "NHD"]), pick("int", 1, 4), pick("choice", BLOCKS), c)
    df = PageFormat(pick("choice", ["HND", "NHD"]), pick("int", 1, 4), pick("choice", BLOCKS), c)
    nh = pick("int", 1, min(sf.num_heads, df.num_heads))
    src_pad, dst_pad = pick("int", 0, 3), pick("int", 0, 3)
    return Spec(
        pages=pick("int", 1, 3), dtype=pick("choice", DTYPES), src_fmt=sf, dst_fmt=df, num_heads=nh,
        src_head_start=pick("int", 0, sf.num_heads - nh), dst_head_start=pick("int", 0, df.num_heads - nh),
        num_tokens=pick("int", 0, 40), src_token_offset=pick("int", 0, 20), extra_src_blocks=pick("int", 0, 2),
        extra_dst_blocks=pick("int", 0, 3), extra_ids=pick("int", 0, 3), src_block_major=pick("bool"),
        dst_block_major=pick("bool"), src_pad=src_pad, dst_pad=dst_pad, src_lead=pick("int", 0, src_pad),
        dst_lead=pick("int", 0, dst_pad), seed=pick("int", 0, 2**31 - 1))


@st.composite
def specs(draw) -> Spec:
    def pick(kind, *args):
        if kind == "choice":
            return draw(st.sampled_from(args[0]))
        if kind == "int":
            return draw(st.integers(args[0], args[1]))
        return draw(st.booleans())

    return _spec(pick)


def random_spec(rng: random.Random) -> Spec:
    def pick(kind, *args):
        if kind == "choice":
            return rng.choice(args[0])
        if kind == "int":
            return rng.randint(args[0], args[1])
        return rng.random() < 0.5

    return _spec(pick)


def _pages(blocks: int, spec: Spec, fmt: PageFormat, pad: int, lead: int, block_major: bool,
           gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base allocation, ``[P, blocks, page_elems]`` view of it) filled with random bytes."""
    row = fmt.page_elems + pad
    isz = torch.empty(0, dtype=spec.dtype).element_size()
    shape = (blocks, spec.pages) if block_major else (spec.pages, blocks)
    raw = torch.randint(0, 256, (*shape, row * isz), dtype=torch.uint8, generator=gen)
    base = raw.to(device).view(spec.dtype)
    view = base.transpose(0, 1) if block_major else base
    return base, view[:, :, lead:lead + fmt.page_elems]


def build(spec: Spec, device: str = "cpu"):
    """(src, dst_base, dst, ids) for ``spec`` on ``device``."""
    gen = torch.Generator().manual_seed(spec.seed)
    sf, df, n = spec.src_fmt, spec.dst_fmt, spec.num_tokens
    s_blocks = -(-(spec.src_token_offset + n) // sf.block_size) + spec.extra_src_blocks
    need = -(-n // df.block_size)
    nb = need + spec.extra_dst_blocks
    _, src = _pages(s_blocks, spec, sf, spec.src_pad, spec.src_lead, spec.src_block_major, gen, device)
    dst_base, dst = _pages(nb, spec, df, spec.dst_pad, spec.dst_lead, spec.dst_block_major, gen, device)
    ids = torch.randperm(nb, generator=gen)[:need + min(spec.extra_ids, nb - need)].to(device)
    return src, dst_base, dst, ids


def _call_args(spec: Spec, src, dst, ids) -> tuple:
    return (src, spec.src_fmt, dst, spec.dst_fmt, ids, spec.num_tokens, spec.src_token_offset,
            spec.src_head_start, spec.dst_head_start, spec.num_heads)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


def expected_after(spec: Spec) -> torch.Tensor:
    """The destination allocation after :func:`fixup_reference`, as bytes (CPU)."""
    src, dst_base, dst, ids = build(spec)
    fixup_reference(*_call_args(spec, src, dst, ids))
    return _bytes(dst_base)


def check(spec: Spec, impl: str, device: str = "cpu") -> None:
    src, dst_base, dst, ids = build(spec, device)
    before = _bytes(dst_base)
    fixup_pages(*_call_args(spec, src, dst, ids), impl=impl)
    after, want = _bytes(dst_base), expected_after(spec)
    assert torch.equal(after, want), f"{impl} differs from fixup_reference for {spec}"
    if spec.num_tokens == 0:
        assert torch.equal(after, before)


@pytest.mark.parametrize("impl", ["auto", "torch", "runs"])
@settings(max_examples=60, deadline=None)
@given(spec=specs())
def test_matches_reference_bitwise(impl: str, spec: Spec) -> None:
    check(spec, impl)


def test_reference_moves_what_it_should() -> None:
    """The oracle itself on a hand-checked case: NHD bs2 → HND bs4, heads 1:2 → 0:1, offset 1."""
    sf, df = PageFormat("NHD", 2, 2, 1), PageFormat("HND", 1, 4, 1)
    src = torch.arange(12, dtype=torch.float32).view(1, 3, 4)  # staging token j, head h = 2*j + h
    dst = torch.full((1, 3, 4), -1.0)
    fixup_reference(src, sf, dst, df, torch.tensor([2, 0]), 5, src_token_offset=1, src_head_start=1,
                    num_heads=1)
    want = torch.tensor([[[11, -1, -1, -1], [-1, -1, -1, -1], [3, 5, 7, 9]]], dtype=torch.float32)
    assert torch.equal(dst, want)
    dst2 = torch.full((1, 3, 4), -1.0)
    fixup_pages(src, sf, dst2, df, torch.tensor([2, 0]), 5, src_token_offset=1, src_head_start=1, num_heads=1)
    assert torch.equal(dst2, want)


@pytest.mark.parametrize(("off", "n", "bs"), [(0, 0, 4), (0, 8, 4), (3, 1, 4), (3, 10, 4), (4, 4, 4), (1, 2, 1)])
def test_staging_pieces_cover_each_token_once(off: int, n: int, bs: int) -> None:
    tokens = [s * bs + t for s_lo, s_hi, t_lo, t_hi in staging_pieces(off, n, bs)
              for s in range(s_lo, s_hi) for t in range(t_lo, t_hi)]
    assert sorted(tokens) == list(range(off, off + n))
    assert len(staging_pieces(off, n, bs)) <= 3


def test_torch_path_does_not_materialise_the_source() -> None:
    """index_put_ reads the strided source view in place: no allocation near the data size."""
    from torch.profiler import ProfilerActivity, profile

    sf, df = PageFormat("HND", 8, 16, 64), PageFormat("NHD", 4, 32, 64)
    src = torch.randn(4, 16, sf.page_elems)
    dst = torch.zeros(4, 8, df.page_elems)
    data = 4 * 256 * 4 * 64 * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the allocation pattern does not depend on threads; a busy machine's wake-ups do
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fixup_pages(src, sf, dst, df, torch.randperm(8), 256, src_head_start=4, num_heads=4, impl="torch")
    finally:
        torch.set_num_threads(threads)
    biggest = max(e.self_cpu_memory_usage for e in prof.key_averages())
    assert biggest < data // 16, f"an op allocated {biggest} B for {data} B of data"


def _good():
    sf, df = PageFormat("HND", 4, 4, 8), PageFormat("NHD", 4, 8, 8)
    src, dst = torch.zeros(2, 3, sf.page_elems), torch.zeros(2, 4, df.page_elems)
    return dict(src=src, src_fmt=sf, dst=dst, dst_fmt=df, dst_block_ids=torch.tensor([1, 3]), num_tokens=10,
                src_token_offset=1)


BAD = {
    "src rank": (lambda a: a.update(src=a["src"][0]), "src.shape"),
    "src page size": (lambda a: a.update(src=a["src"][:, :, :-8]), "src.shape[2]"),
    "dst page size": (lambda a: a.update(dst=torch.zeros(2, 4, 100)), "dst.shape[2]"),
    "src last stride": (lambda a: a.update(src=torch.zeros(2, 3, 256)[:, :, ::2]), "src.stride(2)"),
    "pages": (lambda a: a.update(dst=torch.zeros(3, 4, 256)), "src.shape[0]"),
    "dtype": (lambda a: a.update(dst=a["dst"].half()), "dtype"),
    "head_elems": (lambda a: a.update(dst_fmt=PageFormat("NHD", 8, 8, 4)), "head_elems"),
    "src heads": (lambda a: a.update(src_head_start=1), "src_head_start"),
    "dst heads": (lambda a: a.update(dst_head_start=-1), "dst_head_start"),
    "num_heads": (lambda a: a.update(num_heads=5), "num_heads"),
    "num_heads 0": (lambda a: a.update(num_heads=0), "num_heads"),
    "too few ids": (lambda a: a.update(dst_block_ids=torch.tensor([1])), "len(dst_block_ids)"),
    "id range": (lambda a: a.update(dst_block_ids=torch.tensor([1, 4])), "dst_block_ids"),
    "negative id": (lambda a: a.update(dst_block_ids=torch.tensor([-1, 2])), "dst_block_ids"),
    "ids dtype": (lambda a: a.update(dst_block_ids=torch.tensor([1, 3], dtype=torch.int32)), "dst_block_ids.dtype"),
    "ids rank": (lambda a: a.update(dst_block_ids=torch.tensor([[1, 3]])), "dst_block_ids.dim()"),
    "src too short": (lambda a: a.update(src_token_offset=3), "src_token_offset + num_tokens"),
    "negative tokens": (lambda a: a.update(num_tokens=-1), "num_tokens"),
    "negative offset": (lambda a: a.update(src_token_offset=-1), "src_token_offset"),
    "ids device": (lambda a: a.update(dst_block_ids=torch.tensor([1, 3], device="meta")), "dst_block_ids.device"),
    "device": (lambda a: a.update(dst=a["dst"].to("meta")), "device"),
}


@pytest.mark.parametrize("fn", [fixup_pages, fixup_reference])
@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_names_argument_and_values(fn, case: str) -> None:
    args = _good()
    fn(**args)  # the good call works
    mutate, needle = BAD[case]
    mutate(args)
    before = args["dst"].clone() if args["dst"].device.type == "cpu" else None
    with pytest.raises(ValueError, match="got") as info:
        fn(**args)
    assert needle in str(info.value)
    if before is not None:
        assert torch.equal(args["dst"], before)


def test_bad_formats_and_impl() -> None:
    with pytest.raises(ValueError, match="layout"):
        PageFormat("HDN", 1, 1, 1)
    with pytest.raises(ValueError, match="block_size"):
        PageFormat("HND", 1, 0, 1)
    with pytest.raises(ValueError, match="impl"):
        fixup_pages(**_good(), impl="fast")
    with pytest.raises(ValueError, match="triton"):
        fixup_pages(**_good(), impl="triton")  # CPU tensors


def _interpreter_check(count: int) -> None:
    """The Triton kernel under TRITON_INTERPRET=1 on CPU tensors vs the reference (run in a subprocess)."""
    from p2pkv.dataplane import fixup, fixup_triton

    rng = random.Random(7)
    for i in range(count):
        spec = random_spec(rng)
        if i % 3 == 1:
            spec = replace(spec, num_tokens=rng.randint(20, 40))
        src, dst_base, dst, ids = build(spec)
        nh = fixup.validate(*_call_args(spec, src, dst, ids))
        if spec.num_tokens:
            src_w, dst_w, c = fixup._widen(src, dst, spec.src_fmt.head_elems)
            config = None
            if i % 2:  # small tiles: heads split across programs, one token per program
                config = (1, fixup_triton.triton.next_power_of_2(c), rng.choice([1, 2]), 1)
            fixup_triton.fixup_triton(src_w, spec.src_fmt, dst_w, spec.dst_fmt, ids, spec.num_tokens,
                                      spec.src_token_offset, spec.src_head_start, spec.dst_head_start, nh, c,
                                      config=config)
        assert torch.equal(_bytes(dst_base), expected_after(spec)), f"triton differs for {spec}"
    _out_of_range_ids_skipped(lambda *a: fixup_triton.fixup_triton(*a, 2, 8), "cpu")


def _out_of_range_ids_skipped(run, device: str) -> None:
    """A block id past dst's end: its tokens are not written, and nothing beyond dst is either."""
    sf, df = PageFormat("HND", 2, 4, 8), PageFormat("NHD", 2, 4, 8)
    src = torch.randn(2, 2, sf.page_elems, device=device)
    base = torch.zeros(2, 10, df.page_elems, device=device)
    dst = base[:, :3]
    run(src, sf, dst, df, torch.tensor([1, 7], device=device), 8, 0, 0, 0)
    want = torch.zeros(2, 10, df.page_elems)
    fixup_reference(src.cpu(), sf, want[:, :3], df, torch.tensor([1]), 4)
    assert torch.equal(base.cpu(), want)


def test_triton_kernel_in_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", "import tests.test_fixup as t; t._interpreter_check(30)"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "torch", "runs", "triton"])
@settings(max_examples=30, deadline=None)
@given(spec=specs())
def test_cuda_matches_cpu_reference(impl: str, spec: Spec) -> None:
    from p2pkv.dataplane.fixup import triton_available

    if impl == "triton" and not triton_available():
        pytest.skip("triton not importable")
    check(spec, impl, device="cuda")


@pytest.mark.gpu
def test_cuda_large_offsets() -> None:
    """Pages far into a large allocation (element offsets beyond 2**31) land where the reference puts them."""
    sf, df = PageFormat("HND", 2, 16, 128), PageFormat("NHD", 2, 32, 128)
    blocks = (2**31) // df.page_elems // 2 + 8
    dst = torch.zeros(2, blocks, df.page_elems, dtype=torch.int8, device="cuda")
    src = torch.randint(-128, 127, (2, 4, sf.page_elems), dtype=torch.int8, device="cuda")
    ids = torch.tensor([blocks - 1, 0], device="cuda")
    from p2pkv.dataplane.fixup import triton_available

    for impl in ("torch", "runs", "triton") if triton_available() else ("torch", "runs"):
        dst[:, 0].zero_()
        dst[:, blocks - 1].zero_()
        fixup_pages(src, sf, dst, df, ids, 60, src_token_offset=3, impl=impl)
        want = torch.zeros(2, 2, df.page_elems, dtype=torch.int8)
        fixup_reference(src.cpu(), sf, want, df, torch.tensor([1, 0]), 60, src_token_offset=3)
        assert torch.equal(dst[:, [0, blocks - 1]].cpu(), want), impl


@pytest.mark.gpu
def test_cuda_out_of_range_ids() -> None:
    from p2pkv.dataplane.fixup import triton_available

    args = _good()
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    args["dst_block_ids"] = torch.tensor([1, 4], device="cuda")
    with pytest.raises(ValueError, match="dst_block_ids"):
        fixup_pages(**args, impl="torch")
    with pytest.raises(ValueError, match="dst_block_ids"):
        fixup_pages(**args, impl="runs")
    if triton_available():
        with pytest.raises(ValueError, match="dst_block_ids"):
            fixup_pages(**args, impl="triton", check_block_ids=True)
        _out_of_range_ids_skipped(lambda *a: fixup_pages(*a, impl="triton"), "cuda")


def test_bench_smoke_cpu() -> None:
    bench = load_script("bench_fixup")
    CASE_NAMES, format_table = bench.CASE_NAMES, bench.format_table
    result = bench.run_fixup_bench(device="cpu", tokens=40, layers=1, kv_heads=2, head_dim=8, iters=1, warmup=0)
    assert [c["name"] for c in result["cases"]] == list(CASE_NAMES)
    for c in result["cases"]:
        assert c["bytes"] == 40 * 2 * c["num_heads"] * 8 * 2
        assert set(c["impls"]) == {"torch", "runs"}
        assert all(m["verified"] is True and m["gbps"] > 0 for m in c["impls"].values())
    table = format_table(result)
    assert all(name in table for name in CASE_NAMES)


def test_bench_options_parse() -> None:
    bench = load_script("bench_fixup")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--tokens", "64", "--iters", "3"])
    assert (args.device, args.tokens, args.iters) == ("cpu", 64, 3)
