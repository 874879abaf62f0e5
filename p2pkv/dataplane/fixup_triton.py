"""Triton kernel of :func:`p2pkv.dataplane.fixup.fixup_pages` for CUDA tensors.

Imported by :mod:`p2pkv.dataplane.fixup` only when the tensors are on CUDA and Triton
imports; CPU code never loads it. One program moves a
``[TOKENS, heads, head_elems]`` tile of one page: ``TOKENS`` consecutive
destination tokens, one block of heads. Per token it computes the staging
(block, slot) and the local (block id, slot); each ``head_elems`` row is
contiguous in both pages. One masked load, one masked store; tokens whose
block id is outside ``[0, num_blocks)`` are not written. Addresses
come from strides passed as integers, so HND and NHD on either side, any
block sizes and any page/block strides use the same kernel.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
import triton.language as tl

PageFormat = Any
"""A :class:`p2pkv.dataplane.fixup.PageFormat` (not imported: fixup imports this module)."""

TILE_BYTES = 4096
"""Bytes of one [heads, head_elems] tile at most (heads are split across programs beyond it)."""

PROGRAM_BYTES = 16384
"""Bytes one program aims to move (more tokens per program when tiles are small)."""


@triton.jit
def _fixup_kernel(src_ptr, dst_ptr, ids_ptr, num_tokens, src_token_offset, src_bs, dst_bs,
                  src_page_stride, src_block_stride, src_slot_stride, src_head_stride,
                  dst_page_stride, dst_block_stride, dst_slot_stride, dst_head_stride,
                  src_head_start, dst_head_start, num_heads, head_elems, num_blocks,
                  BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, TOKENS: tl.constexpr):
    k = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)  # destination token indices
    page = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    ok = k < num_tokens
    j = src_token_offset + k
    s = j // src_bs
    t = j - s * src_bs
    q = k // dst_bs
    u = k - q * dst_bs
    b = tl.load(ids_ptr + q, mask=ok, other=0)
    ok = ok & (b >= 0) & (b < num_blocks)  # never write outside dst, whatever the ids
    src_tok = page * src_page_stride + s.to(tl.int64) * src_block_stride + t.to(tl.int64) * src_slot_stride
    dst_tok = page * dst_page_stride + b * dst_block_stride + u.to(tl.int64) * dst_slot_stride
    src_row = (src_head_start + h).to(tl.int64) * src_head_stride
    dst_row = (dst_head_start + h).to(tl.int64) * dst_head_stride
    src_off = src_tok[:, None, None] + src_row[None, :, None] + c[None, None, :]
    dst_off = dst_tok[:, None, None] + dst_row[None, :, None] + c[None, None, :]
    mask = ok[:, None, None] & (h < num_heads)[None, :, None] & (c < head_elems)[None, None, :]
    vals = tl.load(src_ptr + src_off, mask=mask)
    tl.store(dst_ptr + dst_off, vals, mask=mask)


def launch_config(num_heads: int, head_elems: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_C, TOKENS, num_warps)`` for rows of ``head_elems`` words of ``itemsize`` bytes."""
    block_c = triton.next_power_of_2(head_elems)
    block_h = min(triton.next_power_of_2(num_heads), max(1, TILE_BYTES // (block_c * itemsize)))
    tile = block_h * block_c * itemsize
    tokens = max(1, min(64, PROGRAM_BYTES // tile))
    tokens = 1 << (tokens.bit_length() - 1)
    num_warps = max(1, min(8, tokens * tile // 2048))
    return block_h, block_c, tokens, num_warps


def fixup_triton(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
                 dst_block_ids: torch.Tensor, num_tokens: int, src_token_offset: int, src_head_start: int,
                 dst_head_start: int, num_heads: int, head_elems: int, *,
                 config: tuple[int, int, int, int] | None = None) -> None:
    """Launch the fixup kernel on the current CUDA stream (arguments already validated).

    ``src``/``dst`` are ``[P, N, page]`` pages possibly viewed as wider
    integer words: ``head_elems`` counts those words and the formats'
    ``head_elems`` is only used for the block sizes, head counts and layouts.
    ``config`` overrides :func:`launch_config` (for tuning).
    """
    c = head_elems
    dst_block_ids = dst_block_ids.contiguous()

    def strides(fmt: PageFormat) -> tuple[int, int]:  # (slot, head) strides in words
        return (c, fmt.block_size * c) if fmt.layout == "HND" else (fmt.num_heads * c, c)

    s_slot, s_head = strides(src_fmt)
    d_slot, d_head = strides(dst_fmt)
    block_h, block_c, tokens, warps = config or launch_config(num_heads, c, src.element_size())
    grid = (triton.cdiv(num_tokens, tokens), src.shape[0], triton.cdiv(num_heads, block_h))
    other_device = dst.is_cuda and dst.device.index != torch.cuda.current_device()
    with torch.cuda.device(dst.device) if other_device else contextlib.nullcontext():
        _fixup_kernel[grid](
            src, dst, dst_block_ids, num_tokens, src_token_offset, src_fmt.block_size, dst_fmt.block_size,
            src.stride(0), src.stride(1), s_slot, s_head, dst.stride(0), dst.stride(1), d_slot, d_head,
            src_head_start, dst_head_start, num_heads, c, dst.shape[1],
            BLOCK_H=block_h, BLOCK_C=block_c, TOKENS=tokens, num_warps=warps)
