"""What a decode rank and a prefill rank agree on at handshake: copy blocks as they are, or fix them up.

Both sides describe their KV memory with :class:`handshake.KVLayoutDesc`.
Model shape (dtype, layers, head size, KV heads in total, MLA) must match
and is refused otherwise, before any READ, with a message naming both
sides' values. Block size, HND/NHD order and tensor-parallel size may
differ: the pair then pulls through a staging area and
:func:`p2pkv.dataplane.fixup.fixup_pages` re-blocks, permutes and places the head
slice on the device.

A *page* is one block of one layer (or one layer's K or V when a backend
splits them): ``[heads, block_size, head_bytes]`` (HND) or
``[block_size, heads, head_bytes]`` (NHD) bytes. A block is ``P`` pages,
in the order both peers agree on (ascending layer, K before V).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from handshake import KVLayoutDesc, KVRegion
from p2pkv.dataplane.layout import KVLayout, Segment
from p2pkv.dataplane.topology import RankRead, TopologyError, heads_per_rank, read_plan

HEAD_MAJOR = frozenset({"HND", "CPU"})
"""Page orders whose heads are outermost, so a head slice is one contiguous range.

``CPU`` is vLLM's CPU attention page: per head, K as ``[head_dim, block_size]``
(token-minor) followed by V as ``[block_size, head_dim]``."""

INTERLEAVED_LAYOUTS = frozenset({"BHLNC", "BNLHC", "BHNLC", "BNHLC"})
"""Block-outermost layouts whose layers interleave inside a block: no per-layer page to fix up."""


class PairRefused(RuntimeError):
    """A pull cannot run against this peer (model shape differs, or a pairing p2pkv cannot map)."""


@dataclass(frozen=True)
class ModelInfo:
    """What one engine's rank knows of its model and KV cache, beyond the tensors themselves.

    Attributes:
        kv_layout: vLLM's KV cache layout name (``BLHNC``, ``LBHNC``, ...).
        dtype: KV cache element type (``bfloat16``, ``float32``, ``fp8_e4m3``, ...).
        num_kv_heads: KV heads on this rank.
        head_dim: elements per head.
        block_size: tokens per block.
        total_num_kv_heads: KV heads over all ranks (0: ``num_kv_heads`` × TP size).
        is_mla: a latent (MLA) cache: one replicated row per token.
        attn_layout: page order when the platform dictates it (``"CPU"`` for vLLM's
            CPU attention, or a known ``"HND"``/``"NHD"``); None: read it off the
            tensor's strides (:func:`p2pkv.dataplane.layout.attn_layout_of`).
        local_attention: vLLM frees this cache's blocks behind an attention
            window (sliding-window or chunked-local attention), so a prompt's
            first blocks may be gone on either side.
        kv_groups: KV cache groups (vLLM's hybrid KV cache manager keeps one
            per attention type; 1 otherwise): with more than one, a pull pairs
            blocks one for one, so both engines must use one block size.
        state_groups: the KV cache holds Mamba/SSM state (a hybrid model):
            a state block's page is moved whole, so the pull must be direct
            (same block size, page order and TP size on both engines).
    """

    kv_layout: str
    dtype: str
    num_kv_heads: int
    head_dim: int
    block_size: int
    total_num_kv_heads: int = 0
    is_mla: bool = False
    attn_layout: str | None = None
    local_attention: bool = False
    kv_groups: int = 1
    state_groups: bool = False

    @property
    def load_fails_by_request(self) -> bool:
        """Whether vLLM must be told of a failed load by request (``failed_recving``: it recomputes the whole
        prompt) rather than by block: with several KV cache groups block ids are unique only within a group
        (vLLM stops the engine on block ids there), and behind an attention window a load does not begin at
        the prompt's first token, while vLLM recomputes a block-level failure from the first failed block on,
        which needs the KV before it (measured: a corrupted sliding-window load recomputed by block got other
        tokens than one engine's)."""
        return self.kv_groups > 1 or self.local_attention


def layout_desc(layout: KVLayout, model: ModelInfo, attn_layout: str, *, mem_type: str,
                device_id: int = 0) -> KVLayoutDesc:
    """The wire form of a :class:`KVLayout` (see :class:`handshake.KVLayoutDesc`); ``device_id`` is the
    GPU index of VRAM regions (0 for DRAM)."""
    return KVLayoutDesc(
        kv_layout=model.kv_layout, attn_layout=attn_layout, dtype=model.dtype, num_layers=layout.num_layers,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=model.block_size,
        num_blocks=layout.num_blocks, block_len=layout.segments[0].length,
        block_stride=layout.segments[0].block_stride, mem_type=mem_type,
        regions=[KVRegion(base_addr=s.addr, length=layout.num_blocks * s.block_stride, device_id=device_id,
                          layer_start=s.layer_start, num_layers=s.num_layers, kv_index=s.kv_index)
                 for s in layout.segments],
        total_num_kv_heads=model.total_num_kv_heads, is_mla=model.is_mla,
    )


def remote_segments(desc: KVLayoutDesc) -> list[Segment]:
    """Rebuild a peer's segments from its typed layout fields (never from its bytes)."""
    return [Segment(r.base_addr, desc.block_len, desc.block_stride, r.layer_start, r.num_layers, r.kv_index)
            for r in desc.regions]


def total_heads(desc: KVLayoutDesc, tp_size: int) -> int:
    """The model's KV heads over all ranks (1 for MLA)."""
    if desc.is_mla:
        return 1
    return desc.total_num_kv_heads or desc.num_kv_heads * tp_size


def pages_per_block(desc: KVLayoutDesc) -> int:
    """``P``: pages (layer, or layer's K or V) in one block."""
    return sum(r.num_layers for r in desc.regions)


def page_bytes(desc: KVLayoutDesc) -> int:
    """Bytes of one page (all segments of a peer have the same length)."""
    return desc.block_len // desc.regions[0].num_layers


def head_bytes(desc: KVLayoutDesc) -> int:
    """Bytes of one (token, head) row in a page."""
    return page_bytes(desc) // (desc.num_kv_heads * desc.block_size)


class Placement(str, enum.Enum):
    """Where one prefill rank's bytes land in a decode rank, and whether a fixup follows (pull and push alike)."""

    DIRECT = "direct"
    """Remote blocks are byte-identical to local ones (same block size, page order and heads):
    READ straight into the local blocks, runs of consecutive ids coalesced."""
    PAGED = "paged"
    """Same block size and page order, and each page's head slice is contiguous on both sides
    (HND, or all heads): READ every page's slice straight into the local page, one descriptor
    per block and page, no staging."""
    STAGED = "staged"
    """Anything else: READ whole remote blocks into staging, then fix up on the device
    (:func:`p2pkv.dataplane.fixup.fixup_pages`)."""


@dataclass(frozen=True)
class PeerPlan:
    """How this decode rank pulls from one prefill rank.

    Attributes:
        read: the head slice to read (:func:`p2pkv.dataplane.topology.read_plan`).
        placement: where the bytes land and whether a fixup follows (:class:`Placement`).
        reason: why the pull is not direct (``""`` when direct).
    """

    read: RankRead
    placement: Placement
    reason: str = ""


def _must_match(local: KVLayoutDesc, remote: KVLayoutDesc, local_tp: int, remote_tp: int) -> None:
    pairs = {name: (getattr(local, name), getattr(remote, name))
             for name in ("dtype", "num_layers", "head_dim", "is_mla")}
    pairs["total KV heads"] = (total_heads(local, local_tp), total_heads(remote, remote_tp))
    pairs["pages per block (layers x K/V split)"] = (pages_per_block(local), pages_per_block(remote))
    for name, (mine, theirs) in pairs.items():
        if mine != theirs:
            raise PairRefused(f"prefill and decode differ in {name}: prefill has {theirs!r}, decode has {mine!r}; "
                              f"run both engines with the same model and {name}")


def plan_peer(local: KVLayoutDesc, local_rank: int, local_tp: int, remote: KVLayoutDesc, remote_rank: int,
              remote_tp: int, model: ModelInfo | None = None) -> PeerPlan:
    """Decide how decode rank ``local_rank`` pulls from prefill rank ``remote_rank``.

    ``model``: the decode engine's :class:`ModelInfo`. When it frees blocks
    behind an attention window (``local_attention``), a decode block larger
    than the prefill engine's would start with tokens whose prefill block is
    already freed, and vLLM's prefix cache could later serve them: refused.
    With several KV cache groups (``kv_groups``) the pull's blocks pair one
    for one: a different block size is refused. A KV cache with Mamba/SSM
    state (``state_groups``) pulls only in :attr:`Placement.DIRECT`.

    Raises:
        PairRefused: model shape differs (names the field and both values),
            heads cannot be mapped between the TP sizes, the peer is not a
            rank this decode rank reads from, or the blocks differ in a way
            the fixup cannot handle (interleaved layer layouts, per-head row
            sizes that differ).
    """
    _must_match(local, remote, local_tp, remote_tp)
    model = model or ModelInfo("", "", 0, 0, local.block_size)
    if model.kv_groups > 1 and local.block_size != remote.block_size:
        raise PairRefused(f"the model has {model.kv_groups} KV cache groups (vLLM's hybrid KV cache manager), which "
                          f"p2pkv pulls block for block: prefill block_size={remote.block_size}, decode "
                          f"block_size={local.block_size}; start both engines with the same --block-size")
    if model.local_attention and local.block_size > remote.block_size:
        raise PairRefused(f"sliding-window (local attention) model: decode block_size={local.block_size} is larger "
                          f"than prefill block_size={remote.block_size}, so a decode block would hold tokens whose "
                          f"prefill block is already freed; start the decode engine with --block-size "
                          f"{remote.block_size} or smaller")
    try:
        reads = read_plan(local_rank, local_tp, remote_tp, total_heads(local, local_tp), local.is_mla)
        expected = (heads_per_rank(total_heads(local, local_tp), local_tp),
                    heads_per_rank(total_heads(remote, remote_tp), remote_tp))
    except TopologyError as exc:
        raise PairRefused(f"prefill tp_size={remote_tp}, decode tp_size={local_tp}: {exc}") from exc
    heads = (local.num_kv_heads, remote.num_kv_heads)
    if local.is_mla:
        heads = expected  # a latent cache reports no heads: one replicated row per token
    elif heads != expected:
        raise PairRefused(f"KV heads per rank: decode has {heads[0]} (expected {expected[0]} at tp_size={local_tp}), "
                          f"prefill has {heads[1]} (expected {expected[1]} at tp_size={remote_tp}); "
                          "check both engines' tensor-parallel sizes")
    read = next((r for r in reads if r.remote_rank == remote_rank), None)
    if read is None:
        read = RankRead(remote_rank, 0, 0, 0)  # notify-only peer: nothing to read from it
    same_blocks = (local.block_size == remote.block_size and local.attn_layout == remote.attn_layout
                   and local.num_kv_heads == remote.num_kv_heads == read.num_heads
                   and local.block_len == remote.block_len and len(local.regions) == len(remote.regions)
                   and [r.num_layers for r in local.regions] == [r.num_layers for r in remote.regions])
    if same_blocks or read.num_heads == 0:
        return PeerPlan(read, Placement.DIRECT)
    if "CPU" in (local.attn_layout, remote.attn_layout) and local.attn_layout != remote.attn_layout:
        raise PairRefused(f"prefill attn_layout={remote.attn_layout}, decode attn_layout={local.attn_layout}: vLLM's "
                          "CPU attention pages (K stored transposed) pair only with CPU attention pages; run both "
                          "engines on the same platform")
    for side, desc in (("prefill", remote), ("decode", local)):
        if desc.kv_layout in INTERLEAVED_LAYOUTS:
            raise PairRefused(f"{side} kv_layout={desc.kv_layout} interleaves layers inside a block, which p2pkv "
                              "cannot re-block or permute; use LBHNC/BLHNC (or the same block size, layout and "
                              "TP size on both engines)")
        if desc.block_len % desc.regions[0].num_layers or page_bytes(desc) % (desc.num_kv_heads * desc.block_size):
            raise PairRefused(f"{side} page of {desc.block_len} B is not [heads={desc.num_kv_heads}, "
                              f"block_size={desc.block_size}, row] bytes; p2pkv cannot fix up this layout")
    if head_bytes(local) != head_bytes(remote):
        raise PairRefused(f"bytes per (token, head): prefill {head_bytes(remote)}, decode {head_bytes(local)}; "
                          "run both engines with the same KV cache dtype and head size")
    diffs = [f"{name} {getattr(remote, name)}→{getattr(local, name)}" for name in ("block_size", "attn_layout")
             if getattr(local, name) != getattr(remote, name)]
    if remote_tp != local_tp:
        diffs.append(f"tp_size {remote_tp}→{local_tp}")
    whole = local.num_kv_heads == remote.num_kv_heads == read.num_heads
    paged = local.block_size == remote.block_size and local.attn_layout == remote.attn_layout and (
        local.attn_layout in HEAD_MAJOR or whole or local.is_mla)
    placement = Placement.PAGED if paged else Placement.STAGED
    if model.state_groups:
        raise PairRefused(f"the model keeps Mamba/SSM state, whose pages p2pkv moves whole, but the engines differ in "
                          f"{', '.join(diffs) or 'segment layout'}; start both engines with the same --block-size, "
                          "KV cache layout and --tensor-parallel-size")
    return PeerPlan(read, placement, reason=", ".join(diffs) or "segment layout")


def page_slices(desc: KVLayoutDesc, segments: list[Segment], head_start: int, num_heads: int) -> list[Segment]:
    """Per-page segments covering heads ``[head_start, head_start + num_heads)`` of every page.

    For :attr:`Placement.PAGED` pulls; valid where a page's head slice is
    contiguous (HND order, or all heads). The lists built for the two
    peers pair up page by page.
    """
    page, hb = page_bytes(desc), head_bytes(desc)
    heads_all = desc.num_kv_heads if not desc.is_mla else 1
    if num_heads == heads_all:
        offset, length = 0, page
    else:
        offset, length = head_start * desc.block_size * hb, num_heads * desc.block_size * hb
    return [Segment(seg.addr + q * page + offset, length, seg.block_stride, seg.layer_start + q, 1, seg.kv_index)
            for seg in segments for q in range(seg.length // page)]
