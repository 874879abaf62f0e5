"""Synthetic KV caches shaped like vLLM's, for transfer tests and benchmarks."""

from __future__ import annotations

import torch

LAYOUTS = ("LBHNC", "BLHNC", "KV_SPLIT")


def make_kv_caches(layout: str, num_layers: int = 4, num_blocks: int = 64, num_heads: int = 2,
                   block_size: int = 32, head_dim: int = 16, dtype: torch.dtype = torch.float32,
                   fill: float | None = None, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation plus per-layer views in a vLLM layout.

    Layouts: ``LBHNC`` (layer-compact, per-layer view [B, H, N, C]),
    ``BLHNC`` (cross-layer blocks, per-layer view [B, H, N, C] with block
    stride over all layers), ``KV_SPLIT`` (per-layer [2, B, N, H, D] tensors,
    K and V apart, as flash-attention backends hold them). ``C`` is
    ``2 * head_dim`` (K and V side by side) for the first two.

    Returns:
        ``(storage, kv_caches)``: the whole allocation (for byte checks) and
        layer name → view.
    """
    gen = torch.Generator().manual_seed(seed)
    shape_hnc = (num_heads, block_size, 2 * head_dim)
    if layout == "LBHNC":
        base = torch.empty((num_layers, num_blocks, *shape_hnc), dtype=dtype)
        views = {f"layers.{i}": base[i] for i in range(num_layers)}
    elif layout == "BLHNC":
        base = torch.empty((num_blocks, num_layers, *shape_hnc), dtype=dtype)
        views = {f"layers.{i}": base[:, i] for i in range(num_layers)}
    elif layout == "KV_SPLIT":
        base = torch.empty((num_layers, 2, num_blocks, block_size, num_heads, head_dim), dtype=dtype)
        views = {f"layers.{i}": base[i] for i in range(num_layers)}
    else:
        raise ValueError(f"unknown layout {layout}")
    if fill is None:
        base.copy_(torch.randn(base.shape, generator=gen, dtype=torch.float32).to(dtype))
    else:
        base.fill_(fill)
    return base, views


def block_bytes(views: dict[str, torch.Tensor], layout: str, block_id: int) -> bytes:
    """All bytes of one block over every layer (K and V), in a fixed order."""
    chunks = []
    for view in views.values():
        page = view[:, block_id] if layout == "KV_SPLIT" else view[block_id]
        chunks.append(page.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(chunks)
