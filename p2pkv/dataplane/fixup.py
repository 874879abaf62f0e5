"""Post-receive fixup: move staged remote KV pages into local blocks, on the device, in one pass.

A heterogeneous pair (different block size, HND vs NHD page layout, a
different TP size so each rank holds a different slice of the KV heads)
cannot READ straight into the local blocks. The decode worker READs the
remote blocks into a staging area instead, then :func:`fixup_pages` moves
every received token into its local block and slot, permuting the page
layout and selecting/placing the head slice on the way. Each element is read
once from staging and written once to the cache; nothing else is copied.

Shapes: a *page* is one block's data of one layer (or of one layer's K or
V); see :class:`PageFormat`. ``src`` (staging) is ``[P, S, page_elems]`` and
``dst`` (the local cache) ``[P, NB, page_elems]``: ``P`` pages per block
(e.g. one per layer), ``S`` staging blocks in token order, ``NB`` local
blocks. Both may have any strides except a contiguous last dim.

Implementations (``impl=``), all bitwise copies that give the same result:

* ``"torch"`` (any device): at most three ``index_put_`` calls (a partial
  first staging block, the whole ones, a partial last one), each writing
  through a strided view of ``dst`` from a strided view of ``src`` (not
  materialised: ``index_put_`` iterates over the strided value in place),
  with 2-D index grids of local block ids and slots per (staging block,
  slot). A constant number of device ops whatever the request size.
* ``"runs"`` (any device; the CPU default): one ``copy_`` per run of tokens
  that stays inside one staging block and one local block, between the same
  strided views. ``num_tokens / min(block sizes)`` ops or fewer, each a plain
  strided copy: several times faster than ``index_put_`` on CPU, whose
  per-row indexing cost dominates, but one kernel launch per run on CUDA.
* ``"triton"`` (CUDA only, :mod:`p2pkv.dataplane.fixup_triton`, imported lazily): one
  kernel; the CUDA default when Triton imports.

Rows of ``head_elems`` elements are moved as the widest integer word (up to
8 bytes) that the sizes, strides and offsets allow, so any dtype works
(fp8 included) and the copy is bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAGE_ORDERS = ("HND", "NHD")
IMPLS = ("auto", "torch", "runs", "triton")
RUNS_MIN_BLOCK = 8
"""``impl="auto"`` on CPU uses ``"runs"`` when both block sizes are at least this (else ``"torch"``)."""

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class PageFormat:
    """One block's page of one layer (or one layer's K or V).

    Layout ``"HND"`` is ``[num_heads, block_size, head_elems]`` and ``"NHD"``
    is ``[block_size, num_heads, head_elems]``, dense, row-major.

    Attributes:
        layout: ``"HND"`` or ``"NHD"``.
        num_heads: KV heads held in this page (this rank's heads).
        block_size: tokens per block.
        head_elems: elements per (token, head), e.g. head_dim, or 2*head_dim
            when K and V are interleaved.

    Raises:
        ValueError: an unknown layout or a size < 1.
    """

    layout: str
    num_heads: int
    block_size: int
    head_elems: int

    def __post_init__(self) -> None:
        if self.layout not in PAGE_ORDERS:
            raise ValueError(f"PageFormat.layout must be one of {PAGE_ORDERS}, got {self.layout!r}")
        for name in ("num_heads", "block_size", "head_elems"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PageFormat.{name} must be an int >= 1, got {value!r}")

    @property
    def page_elems(self) -> int:
        """Elements in one page: ``num_heads * block_size * head_elems``."""
        return self.num_heads * self.block_size * self.head_elems

    @property
    def slot_stride(self) -> int:
        """Elements between one token slot's row and the next slot's (same head)."""
        return self.head_elems if self.layout == "HND" else self.num_heads * self.head_elems

    @property
    def head_stride(self) -> int:
        """Elements between one head's row and the next head's (same slot)."""
        return self.block_size * self.head_elems if self.layout == "HND" else self.head_elems

    def row_offset(self, slot: int, head: int) -> int:
        """Element offset in the page of the ``head_elems`` row of (``slot``, ``head``)."""
        return slot * self.slot_stride + head * self.head_stride


def _fail(what: str, got: Any, want: Any) -> None:
    raise ValueError(f"{what}: got {got}, expected {want}")


def _check_pages(name: str, t: torch.Tensor, fmt: PageFormat) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        _fail(f"{name}.shape must be [P, blocks, page_elems] ({name}.dim())", t.dim(), 3)
    if t.shape[2] != fmt.page_elems:
        _fail(f"{name}.shape[2] must equal {name}_fmt.page_elems", t.shape[2], fmt.page_elems)
    if t.stride(2) != 1 and t.shape[2] > 1:
        _fail(f"{name}.stride(2) (the page dim must be contiguous)", t.stride(2), 1)


def validate(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
             dst_block_ids: torch.Tensor, num_tokens: int, src_token_offset: int = 0,
             src_head_start: int = 0, dst_head_start: int = 0, num_heads: int | None = None,
             check_block_ids: bool = True) -> int:
    """Check the arguments of :func:`fixup_pages`; returns the number of heads moved.

    With ``check_block_ids`` the used ids are also checked to lie in
    ``[0, dst.shape[1])`` (on CUDA that reads two integers back: one sync).

    Raises:
        ValueError: naming the argument and both values, on any mismatch.
    """
    _check_pages("src", src, src_fmt)
    _check_pages("dst", dst, dst_fmt)
    if src.shape[0] != dst.shape[0]:
        _fail("src.shape[0] (pages per block) must equal dst.shape[0]", src.shape[0], dst.shape[0])
    if src.dtype != dst.dtype:
        _fail("src.dtype must equal dst.dtype", src.dtype, dst.dtype)
    if src.device != dst.device:
        _fail("src.device must equal dst.device", src.device, dst.device)
    if src_fmt.head_elems != dst_fmt.head_elems:
        _fail("src_fmt.head_elems must equal dst_fmt.head_elems", src_fmt.head_elems, dst_fmt.head_elems)
    nh = src_fmt.num_heads if num_heads is None else num_heads
    if not isinstance(nh, int) or nh < 1:
        _fail("num_heads", nh, "an int >= 1")
    if src_head_start < 0 or src_head_start + nh > src_fmt.num_heads:
        _fail("src heads [src_head_start, src_head_start + num_heads)", f"[{src_head_start}, "
              f"{src_head_start + nh})", f"inside [0, src_fmt.num_heads={src_fmt.num_heads})")
    if dst_head_start < 0 or dst_head_start + nh > dst_fmt.num_heads:
        _fail("dst heads [dst_head_start, dst_head_start + num_heads)", f"[{dst_head_start}, "
              f"{dst_head_start + nh})", f"inside [0, dst_fmt.num_heads={dst_fmt.num_heads})")
    if num_tokens < 0:
        _fail("num_tokens", num_tokens, ">= 0")
    if src_token_offset < 0:
        _fail("src_token_offset", src_token_offset, ">= 0")
    have = src.shape[1] * src_fmt.block_size
    if src_token_offset + num_tokens > have:
        _fail("src_token_offset + num_tokens (staging tokens needed)", src_token_offset + num_tokens,
              f"<= src.shape[1] * src_fmt.block_size = {have}")
    if not isinstance(dst_block_ids, torch.Tensor):
        raise ValueError(f"dst_block_ids must be a torch.Tensor, got {type(dst_block_ids).__name__}")
    if dst_block_ids.dtype != torch.int64:
        _fail("dst_block_ids.dtype", dst_block_ids.dtype, torch.int64)
    if dst_block_ids.dim() != 1:
        _fail("dst_block_ids.dim()", dst_block_ids.dim(), 1)
    if dst_block_ids.device != dst.device:
        _fail("dst_block_ids.device must equal dst.device", dst_block_ids.device, dst.device)
    need = -(-num_tokens // dst_fmt.block_size)
    if dst_block_ids.shape[0] < need:
        _fail("len(dst_block_ids)", dst_block_ids.shape[0],
              f">= ceil(num_tokens / dst_fmt.block_size) = {need}")
    if check_block_ids and need:
        lo, hi = torch.stack(torch.aminmax(dst_block_ids[:need])).tolist()
        _check_id_range(lo, hi, dst.shape[1])
    return nh


def _check_id_range(lo: int, hi: int, num_blocks: int) -> None:
    if lo < 0 or hi >= num_blocks:
        _fail("dst_block_ids (used ids)", f"[{lo}, {hi}]", f"inside [0, dst.shape[1]={num_blocks})")


def _widen(src: torch.Tensor, dst: torch.Tensor, head_elems: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Views of ``src``/``dst`` as the widest integer words (<= 8 bytes) rows of ``head_elems`` allow."""
    isz = src.element_size()
    for size in (8, 4, 2, 1):
        if size < isz or size % isz:
            continue
        r = size // isz
        ok = head_elems % r == 0 and all(
            t.storage_offset() % r == 0 and t.stride(0) % r == 0 and t.stride(1) % r == 0 for t in (src, dst))
        if ok:
            word = _INT_BY_SIZE[size]
            try:
                return src.view(word), dst.view(word), head_elems // r
            except RuntimeError:
                continue
    return src, dst, head_elems  # itemsize > 8 (complex128): copied as its own dtype


def _token_major(t: torch.Tensor, fmt: PageFormat, head_elems: int) -> torch.Tensor:
    """``[P, N, page]`` → strided view ``[P, N, block_size, num_heads, head_elems]``."""
    if fmt.layout == "HND":
        return t.unflatten(2, (fmt.num_heads, fmt.block_size, head_elems)).transpose(2, 3)
    return t.unflatten(2, (fmt.block_size, fmt.num_heads, head_elems))


def staging_pieces(src_token_offset: int, num_tokens: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """Rectangles ``(s_lo, s_hi, t_lo, t_hi)`` of (staging block, slot) covering the tokens read.

    At most three: the partial first staging block, the whole ones, the
    partial last one; together they cover staging tokens
    ``[src_token_offset, src_token_offset + num_tokens)`` exactly once.
    """
    s0, t0 = divmod(src_token_offset, block_size)
    s1, t1 = divmod(src_token_offset + num_tokens, block_size)
    if s0 == s1:
        return [(s0, s0 + 1, t0, t1)] if t1 > t0 else []
    out = []
    if t0:
        out.append((s0, s0 + 1, t0, block_size))
        s0 += 1
    if s1 > s0:
        out.append((s0, s1, 0, block_size))
    if t1:
        out.append((s1, s1 + 1, 0, t1))
    return out


def _fixup_torch(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
                 ids: torch.Tensor, num_tokens: int, off: int, hs: int, hd: int, nh: int, c: int) -> None:
    src_t = _token_major(src, src_fmt, c)[:, :, :, hs:hs + nh]
    dst_t = _token_major(dst, dst_fmt, c)[:, :, :, hd:hd + nh]
    bs_s, bs_d = src_fmt.block_size, dst_fmt.block_size
    dev = dst.device
    for s_lo, s_hi, t_lo, t_hi in staging_pieces(off, num_tokens, bs_s):
        # k[s, t]: the destination token index of staging (block s, slot t).
        k = torch.arange(s_lo * bs_s - off, s_hi * bs_s - off, bs_s, device=dev)[:, None] \
            + torch.arange(t_lo, t_hi, device=dev)
        blk = ids.index_select(0, (k // bs_d).flatten()).view(k.shape)
        dst_t[:, blk, k % bs_d] = src_t[:, s_lo:s_hi, t_lo:t_hi]


def _fixup_runs(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
                ids: torch.Tensor, num_tokens: int, off: int, hs: int, hd: int, nh: int, c: int) -> None:
    src_t = _token_major(src, src_fmt, c)[:, :, :, hs:hs + nh]
    dst_t = _token_major(dst, dst_fmt, c)[:, :, :, hd:hd + nh]
    bs_s, bs_d = src_fmt.block_size, dst_fmt.block_size
    blocks = ids[:-(-num_tokens // bs_d)].tolist()
    _check_id_range(min(blocks), max(blocks), dst.shape[1])
    k = 0
    while k < num_tokens:
        s, t = divmod(off + k, bs_s)
        q, u = divmod(k, bs_d)
        m = min(bs_s - t, bs_d - u, num_tokens - k)
        dst_t[:, blocks[q], u:u + m].copy_(src_t[:, s, t:t + m])
        k += m


_TRITON: Any = None


def _triton_module() -> Any:
    """:mod:`p2pkv.dataplane.fixup_triton`, or False when Triton is not importable (cached)."""
    global _TRITON
    if _TRITON is None:
        try:
            from p2pkv.dataplane import fixup_triton
        except ImportError:
            fixup_triton = False
        _TRITON = fixup_triton
    return _TRITON


def triton_available() -> bool:
    """True when the Triton kernel can run (Triton importable and CUDA present)."""
    return torch.cuda.is_available() and bool(_triton_module())


def fixup_pages(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
                dst_block_ids: torch.Tensor, num_tokens: int, src_token_offset: int = 0,
                src_head_start: int = 0, dst_head_start: int = 0, num_heads: int | None = None,
                *, impl: str = "auto", check_block_ids: bool | None = None) -> None:
    """Move received tokens from staging pages into local blocks, in place, in one pass.

    Token ``k`` (``0 <= k < num_tokens``) is read from staging token
    ``src_token_offset + k`` (staging block ``j // src_fmt.block_size``,
    slot ``j % src_fmt.block_size``) and written to local block
    ``dst_block_ids[k // dst_fmt.block_size]``, slot
    ``k % dst_fmt.block_size``. Source heads ``[src_head_start, +num_heads)``
    go to destination heads ``[dst_head_start, +num_heads)``. Every other
    element of ``dst`` is left untouched. On CUDA the work is queued on the
    current stream (asynchronous, like any kernel).

    Args:
        src: staging pages ``[P, S, src_fmt.page_elems]``, any dtype, any
            strides except a contiguous last dim.
        src_fmt: page format of ``src``.
        dst: local cache pages ``[P, NB, dst_fmt.page_elems]``, same dtype and
            device as ``src``, any strides except a contiguous last dim
            (e.g. an ``as_strided`` view of the cache); written in place.
        dst_fmt: page format of ``dst``; ``head_elems`` must equal ``src_fmt``'s.
        dst_block_ids: int64 ``[>= ceil(num_tokens / dst_fmt.block_size)]`` on
            ``dst``'s device: local block of each group of
            ``dst_fmt.block_size`` tokens; distinct ids.
        num_tokens: tokens to move (>= 0).
        src_token_offset: first staging token to read (>= 0).
        src_head_start: first source head.
        dst_head_start: first destination head.
        num_heads: heads to move; None means ``src_fmt.num_heads``.
        impl: ``"auto"``: ``"triton"`` on CUDA when Triton imports, else
            ``"torch"``; on CPU ``"runs"`` when both block sizes are >=
            :data:`RUNS_MIN_BLOCK`, else ``"torch"``. Or name one of
            ``"torch"``, ``"runs"``, ``"triton"`` (CUDA only); see the module
            docstring.
        check_block_ids: check that the used ids lie in ``[0, NB)`` and raise
            ValueError otherwise. On CUDA that reads two integers back (a
            device sync), so None (the default) checks only where it is
            free or needed: on CPU, for ``"runs"`` (it reads the ids to the
            host anyway) and for ``"torch"`` on CUDA (an out-of-range index
            there is a device-side assert). The Triton kernel never writes
            outside ``dst``: without the check it skips tokens whose block id
            is out of range (they are not written; nothing is raised).

    Raises:
        ValueError: on any shape, format, dtype or device mismatch, head
            slice out of range, too few ``dst_block_ids``, ids out of range,
            ``src`` too short for ``src_token_offset + num_tokens``, or an
            unknown/unavailable ``impl``; the message names the argument
            and both values.
    """
    if impl not in IMPLS:
        _fail("impl", repr(impl), f"one of {IMPLS}")
    nh = validate(src, src_fmt, dst, dst_fmt, dst_block_ids, num_tokens, src_token_offset,
                  src_head_start, dst_head_start, num_heads, check_block_ids=False)
    if impl == "auto":
        if dst.is_cuda:
            impl = "triton" if _triton_module() else "torch"
        else:
            impl = "runs" if min(src_fmt.block_size, dst_fmt.block_size) >= RUNS_MIN_BLOCK else "torch"
    if impl == "triton" and not (dst.is_cuda and _triton_module()):
        _fail("impl='triton' needs CUDA tensors and an importable triton (dst.device)", dst.device, "cuda")
    if num_tokens == 0 or src.shape[0] == 0:
        return
    if check_block_ids if check_block_ids is not None else (not dst.is_cuda or impl == "torch"):
        lo, hi = torch.stack(torch.aminmax(dst_block_ids[:-(-num_tokens // dst_fmt.block_size)])).tolist()
        _check_id_range(lo, hi, dst.shape[1])
    src_w, dst_w, c = _widen(src, dst, src_fmt.head_elems)
    args = (src_w, src_fmt, dst_w, dst_fmt, dst_block_ids, num_tokens, src_token_offset, src_head_start,
            dst_head_start, nh, c)
    if impl == "triton":
        _triton_module().fixup_triton(*args)
    elif impl == "runs":
        _fixup_runs(*args)
    else:
        _fixup_torch(*args)
