"""Synthetic KV caches shaped like vLLM's, and block placements shaped like its allocator's.

Caches are one allocation with per-layer views, in the layouts of
:mod:`p2pkv.dataplane.layout`: ``LBHNC`` (layer-compact), ``BLHNC`` (cross-layer
blocks) and ``KV_SPLIT`` (per-layer K and V apart). Benchmarks fill them with
a *pattern*: the allocation read as int64 words holds ``word index + a
seed-dependent offset``, so every 8 bytes are distinct, any misplaced byte
range is caught, and the expected bytes of any range can be recomputed in
another process without holding the cache (:func:`pattern_bytes`).

Caches live on any torch device (host memory by default, or a GPU); the
pattern and its checks work on either. Also :func:`fixup_reference`, the
post-receive fixup as plain loops (the tests' oracle). Used by the tests (CPU
and GPU), ``scripts/bench_transfer.py`` and ``scripts/bench_fixup.py``; nothing in
the connector imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

    from p2pkv.dataplane.fixup import PageFormat
    from p2pkv.dataplane.negotiate import ModelInfo

KV_LAYOUTS = ("LBHNC", "BLHNC", "KV_SPLIT")
"""Layouts :func:`make_kv_caches` can build."""

GiB = 1 << 30
"""Bytes in one GiB."""

_PATTERN_CHUNK_WORDS = 8 << 20  # 64 MiB of int64 words per fill step

ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int8": 1, "uint8": 1}
"""Cache dtypes :class:`KVShape` accepts (torch names) → bytes per element (torch is imported lazily)."""


@dataclass(frozen=True)
class KVShape:
    """KV geometry of one model on one rank.

    Attributes:
        num_layers: attention layers.
        num_kv_heads: KV heads on this rank.
        head_dim: elements per head.
        dtype: torch dtype name of the cache (``"bfloat16"``, ``"float16"``, ...).
        block_size: tokens per KV block.
    """

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ITEMSIZES:
            raise ValueError(f"unsupported cache dtype {self.dtype!r}; one of {', '.join(ITEMSIZES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The cache's torch dtype."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return ITEMSIZES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, K and V (one per-layer descriptor)."""
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (one cross-layer descriptor)."""
        return self.page_bytes * self.num_layers

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)

    def key(self) -> str:
        """The geometry as one string, e.g. ``32:8:128:bfloat16:16`` (peers must agree on it)."""
        return f"{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:{self.dtype}:{self.block_size}"

    def model_info(self, layout: str) -> ModelInfo:
        """The :class:`~p2pkv.dataplane.negotiate.ModelInfo` of a synthetic cache in ``layout`` (HND pages)."""
        from p2pkv.dataplane.negotiate import ModelInfo

        return ModelInfo(kv_layout=layout, dtype=self.dtype, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         block_size=self.block_size, attn_layout="HND")

    def label(self) -> str:
        """Short human description, e.g. ``32 layers x 8 KV heads x 128 head_dim bfloat16, 16 tokens/block``."""
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} head_dim "
                f"{self.dtype}, {self.block_size} tokens/block")


LLAMA3_8B = KVShape()
"""Llama-3-8B's KV cache on one rank: 128 KiB per token, 2 MiB per 16-token block."""


def make_kv_caches(layout: str, num_layers: int = 4, num_blocks: int = 64, num_heads: int = 2,
                   block_size: int = 32, head_dim: int = 16, dtype: torch.dtype | None = None,
                   fill: float | Literal["pattern"] | None = None,
                   seed: int = 0, device: str | torch.device = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation plus per-layer views in a vLLM layout.

    Layouts: ``LBHNC`` (layer-compact, per-layer view [B, H, N, C]),
    ``BLHNC`` (cross-layer blocks, per-layer view [B, H, N, C] with block
    stride over all layers), ``KV_SPLIT`` (per-layer [2, B, N, H, D] tensors,
    K and V apart, as flash-attention backends hold them). ``C`` is
    ``2 * head_dim`` (K and V side by side) for the first two.

    Args:
        dtype: element dtype (``None``: float32).
        fill: ``None``: standard normal values (seeded; allocates a float32
            copy, so only for small caches); a number: that value
            everywhere; ``"pattern"``: :func:`fill_pattern_` (cheap, any size).
        seed: seeds the random values or the pattern.
        device: torch device of the allocation (``"cpu"``, ``"cuda:0"``, ...).

    Returns:
        ``(storage, kv_caches)``: the whole allocation (for byte checks) and
        layer name → view.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape_hnc = (num_heads, block_size, 2 * head_dim)
    if layout == "LBHNC":
        base = torch.empty((num_layers, num_blocks, *shape_hnc), dtype=dtype, device=device)
        views = {f"layers.{i}": base[i] for i in range(num_layers)}
    elif layout == "BLHNC":
        base = torch.empty((num_blocks, num_layers, *shape_hnc), dtype=dtype, device=device)
        views = {f"layers.{i}": base[:, i] for i in range(num_layers)}
    elif layout == "KV_SPLIT":
        base = torch.empty((num_layers, 2, num_blocks, block_size, num_heads, head_dim), dtype=dtype,
                           device=device)
        views = {f"layers.{i}": base[i] for i in range(num_layers)}
    else:
        raise ValueError(f"unknown layout {layout}")
    if fill is None:
        gen = torch.Generator().manual_seed(seed)
        base.copy_(torch.randn(base.shape, generator=gen, dtype=torch.float32).to(dtype))
    elif fill == "pattern":
        fill_pattern_(base, seed)
    else:
        base.fill_(fill)
    return base, views


def make_shaped_kv_caches(layout: str, shape: KVShape, num_blocks: int,
                          fill: float | Literal["pattern"] | None = "pattern", seed: int = 0,
                          device: str | torch.device = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`make_kv_caches` for a :class:`KVShape` (``num_blocks * shape.block_bytes`` bytes on ``device``)."""
    return make_kv_caches(layout, shape.num_layers, num_blocks, shape.num_kv_heads, shape.block_size,
                          shape.head_dim, shape.torch_dtype, fill=fill, seed=seed, device=device)


def _words(base: torch.Tensor) -> torch.Tensor:
    import torch

    raw = base.view(-1).view(torch.uint8)
    if raw.numel() % 8:
        raise ValueError(f"pattern fill needs a multiple of 8 bytes, got {raw.numel()}")
    return raw.view(torch.int64)


def pattern_offset(seed: int) -> int:
    """What :func:`fill_pattern_` adds to every word index for ``seed`` (seeds never collide)."""
    return (seed + 1) << 44


def fill_pattern_(base: torch.Tensor, seed: int) -> None:
    """Write the pattern into a contiguous tensor: int64 word ``i`` := ``i + pattern_offset(seed)``.

    Touches every page (no lazily mapped zero pages left) at about memory
    bandwidth, in 64 MiB steps so no temporary copy is made. On a GPU the
    fill is queued on the current stream: synchronize before another
    process or a NIXL transfer reads the memory.
    """
    import torch

    words = _words(base)
    off = pattern_offset(seed)
    for lo in range(0, words.numel(), _PATTERN_CHUNK_WORDS):
        hi = min(words.numel(), lo + _PATTERN_CHUNK_WORDS)
        torch.arange(lo + off, hi + off, dtype=torch.int64, out=words[lo:hi])


def pattern_bytes(offset: int, length: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The bytes :func:`fill_pattern_` wrote at ``[offset, offset + length)`` of an allocation.

    Args:
        offset: byte offset into the allocation (multiple of 8).
        length: bytes (multiple of 8).
        seed: the fill's seed.
        device: where to build the bytes (compare on the device that holds the copy).

    Returns:
        A uint8 tensor of ``length`` bytes on ``device``.
    """
    if offset % 8 or length % 8:
        raise ValueError(f"pattern ranges are whole int64 words, got offset {offset} length {length}")
    import torch

    lo = offset // 8 + pattern_offset(seed)
    return torch.arange(lo, lo + length // 8, dtype=torch.int64, device=device).view(torch.uint8)


def block_bytes(views: dict[str, torch.Tensor], layout: str, block_id: int) -> bytes:
    """All bytes of one block over every layer (K and V), in a fixed order."""
    import torch

    chunks = []
    for view in views.values():
        page = view[:, block_id] if layout == "KV_SPLIT" else view[block_id]
        chunks.append(page.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(chunks)


def allocate_blocks(rng: np.random.Generator, num_blocks: int, count: int, max_run: int) -> np.ndarray:
    """Block ids a fragmented allocator might hand one request, in request order.

    The free list ``[0, num_blocks)`` is cut into chunks of consecutive ids,
    each of random length ``1..max_run``; the chunks are shuffled and the
    request takes them in that order until it has ``count`` ids (the last
    chunk cut short). So ids are random, but come in runs of consecutive ids
    as a real allocator's free list gives after some churn.

    Args:
        rng: random source.
        num_blocks: blocks in the cache.
        count: blocks the request needs (``<= num_blocks``).
        max_run: longest chunk (blocks); ``1``: every block on its own;
            ``0``: no fragmentation, one contiguous run at a random start.

    Returns:
        int64 array of ``count`` distinct ids in ``[0, num_blocks)``.
    """
    if not 0 <= count <= num_blocks:
        raise ValueError(f"cannot take {count} blocks from a cache of {num_blocks}")
    if max_run < 0:
        raise ValueError(f"max_run must be >= 0, got {max_run}")
    if max_run == 0:
        start = int(rng.integers(0, num_blocks - count + 1))
        return np.arange(start, start + count, dtype=np.int64)
    lens = rng.integers(1, max_run + 1, size=num_blocks)
    ends = np.cumsum(lens)
    starts = ends - lens
    keep = starts < num_blocks
    starts, ends = starts[keep], np.minimum(ends[keep], num_blocks)
    order = rng.permutation(starts.size)
    starts, lens = starts[order], (ends - starts)[order]
    taken = int(np.searchsorted(np.cumsum(lens), count)) + 1
    starts, lens = starts[:taken], lens[:taken]
    first = np.cumsum(lens) - lens
    ids = np.repeat(starts - first, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    return ids[:count].astype(np.int64)


def make_placements(seed: int, tokens: int, shape: KVShape, num_blocks: int, requests: int,
                    max_run: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(local_ids, remote_ids)`` of ``requests`` requests of ``tokens`` tokens each.

    Local (decode) and remote (prefill) ids are drawn independently with
    :func:`allocate_blocks`, deterministically from ``(seed, tokens)``.
    """
    rng = np.random.default_rng([seed, tokens])
    count = shape.blocks_for(tokens)
    return [
        (allocate_blocks(rng, num_blocks, count, max_run), allocate_blocks(rng, num_blocks, count, max_run))
        for _ in range(requests)
    ]


def size_cache(shape: KVShape, tokens: tuple[int, ...], requests: int, num_blocks: int, max_mem_bytes: int,
               caches: int = 2) -> tuple[int, list[int], list[str]]:
    """Blocks per cache so ``caches`` caches fit ``max_mem_bytes`` and hold the requests.

    Args:
        shape: KV geometry.
        tokens: request sizes (tokens).
        requests: requests per size; ``num_blocks=0`` asks for room for all of
            the largest size at once (else requests reuse blocks).
        num_blocks: blocks asked for (0: automatic); shrunk to the budget.
        max_mem_bytes: bytes all ``caches`` caches may take together.
        caches: caches held at once.

    Returns:
        ``(num_blocks, token sizes whose requests fit, warnings)``.

    Raises:
        ValueError: not even the smallest request fits.
    """
    warnings = []
    max_blocks = max(0, max_mem_bytes) // (caches * shape.block_bytes)
    num_blocks = num_blocks or min(shape.blocks_for(max(tokens)) * requests, max_blocks)
    if num_blocks > max_blocks:
        warnings.append(f"--num-blocks {num_blocks} needs {caches * num_blocks * shape.block_bytes / GiB:.2f} GiB "
                        f"for {caches} caches; shrunk to {max_blocks} blocks to stay within the memory budget")
        num_blocks = max_blocks
    num_blocks = max(num_blocks, 4)
    fits = [t for t in tokens if shape.blocks_for(t) <= num_blocks]
    for t in sorted(set(tokens) - set(fits)):
        warnings.append(f"skipping {t} tokens: {shape.blocks_for(t)} blocks do not fit a cache of {num_blocks} "
                        f"blocks ({num_blocks * shape.block_bytes / GiB:.2f} GiB) within the memory budget")
    if not fits:
        raise ValueError("no requested token size fits in memory; raise --max-mem-gib or lower --tokens")
    return num_blocks, fits, warnings


def run_ranges(segs: list[tuple[int, int, int]], dst_starts: np.ndarray, src_starts: np.ndarray,
               lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """``(dst_offset, src_offset, nbytes)`` byte ranges of block runs over segments.

    Args:
        segs: ``(offset, block_stride, length)`` bytes of each segment,
            relative to its allocation; blocks must touch (stride == length).
        dst_starts, src_starts, lengths: runs from :func:`p2pkv.dataplane.plan.coalesce_runs`.
    """
    out = []
    for off, stride, length in segs:
        if stride != length:
            raise ValueError(f"segment blocks do not touch (stride {stride} B, length {length} B)")
        out.extend((off + int(a) * stride, off + int(b) * stride, int(n) * length)
                   for a, b, n in zip(dst_starts, src_starts, lengths, strict=True))
    return out


def ranges_equal(dst: torch.Tensor, ranges: list[tuple[int, int, int]], src: torch.Tensor | None,
                 seed: int, chunk_bytes: int = 64 << 20) -> bool:
    """True when every destination range equals its source range, byte for byte.

    Compares on ``dst``'s device (a GPU copy is checked on the GPU; the
    expected pattern is built there).

    Args:
        dst: uint8 view of the destination allocation (any device).
        ranges: from :func:`run_ranges`.
        src: uint8 view of the source allocation (on ``dst``'s device), or ``None`` when the source
            is a :func:`fill_pattern_` allocation of ``seed`` in another process.
        seed: the source pattern's seed (when ``src`` is None).
        chunk_bytes: compare this many bytes at a time (bounds temporaries).
    """
    import torch

    for d, s, n in ranges:
        for k in range(0, n, chunk_bytes):
            m = min(chunk_bytes, n - k)
            want = src[s + k:s + k + m] if src is not None else pattern_bytes(s + k, m, seed, dst.device)
            if not torch.equal(dst[d + k:d + k + m], want):
                return False
    return True


def fixup_reference(src: torch.Tensor, src_fmt: PageFormat, dst: torch.Tensor, dst_fmt: PageFormat,
                    dst_block_ids: torch.Tensor, num_tokens: int, src_token_offset: int = 0,
                    src_head_start: int = 0, dst_head_start: int = 0, num_heads: int | None = None) -> None:
    """:func:`p2pkv.dataplane.fixup.fixup_pages` as plain loops over tokens and heads (slow; the oracle of
    the tests and of ``scripts/bench_fixup.py``'s check).

    Same arguments, semantics and errors as ``fixup_pages``.
    """
    from p2pkv.dataplane.fixup import validate

    nh = validate(src, src_fmt, dst, dst_fmt, dst_block_ids, num_tokens, src_token_offset,
                  src_head_start, dst_head_start, num_heads)
    c = src_fmt.head_elems
    ids = dst_block_ids.tolist()
    for k in range(num_tokens):
        s, t = divmod(src_token_offset + k, src_fmt.block_size)
        b, u = ids[k // dst_fmt.block_size], k % dst_fmt.block_size
        for h in range(nh):
            a = src_fmt.row_offset(t, src_head_start + h)
            z = dst_fmt.row_offset(u, dst_head_start + h)
            dst[:, b, z:z + c] = src[:, s, a:a + c]
