"""Verified KV, decode side: every part that landed is checked against its producer's digest before vLLM reads it.

With ``verify_kv`` on, each part of a pulled or pushed load is digested
twice over the same descriptor rows (:mod:`p2pkv.dataplane.digest`): by its
prefill rank over the memory the transfer read (a READ's rows in the fence
question after it, :class:`handshake.HoldQuery` ``digest_rows``; a push's
in its "pushed" notification, :class:`p2pkv.notification.PushedNotification`
``digest``: both signed, as everything on the side channel and in NIXL
notifications is) and here over the memory it wrote, when it lands and
before a staged part's fixup (:func:`landed`). A transfer is handed to vLLM
only when every part's two digests are equal (:func:`judge`, asked by
:class:`p2pkv.decode.confirmations.Confirmations` where every way passes
before ``DONE``); a mismatch, or a producer that gave no digest where one
was asked (fail closed), fails the load: its blocks are load errors, so vLLM
recomputes or fails the request by ``kv_load_failure_policy``. Never served.

A layer stream's part has no rows here (its prefill rank plans them as it
computes): its prefill rank digests each page of each destination block as
it posts its WRITE and sends the combined digest in the stream's last word;
this rank takes the same over the pages it landed in once it landed
(:func:`stream_pages`: its own pages, a slice of heads of each, or its
staging before the fixup; with several KV cache groups, each page with the
blocks of every group whose blocks lie in it, ``Part.layer_groups``). KV
caches in device memory are not checked yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from handshake import KVLayoutDesc
from p2pkv.dataplane.blockmap import staged_groups
from p2pkv.dataplane.digest import DIGEST_BYTES, differing_items, digest_rows, pages_digest
from p2pkv.dataplane.layers import heads_of, page_segments, pages_of
from p2pkv.dataplane.layout import LayoutError, Segment
from p2pkv.dataplane.negotiate import page_bytes
from p2pkv.decode.direction import Direction
from p2pkv.decode.transfer import Part, Transfer


class Check(str, enum.Enum):
    """One part's check (the value is the ``outcome`` label of ``p2pkv:kv_checks_total``)."""

    WAIT = "wait"
    """Not decided yet: its bytes have not landed, or its producer's digest has not come."""
    VERIFIED = "verified"
    """Both digests are equal."""
    MISMATCH = "mismatch"
    """The digests differ: the bytes that landed are not those the prefill rank sent."""
    MISSING = "missing"
    """The producer answered without a digest (it could not compute one, or held nothing): fail closed."""


def stream_pages(part: Part, desc: KVLayoutDesc) -> tuple[list[Segment], list[dict[int, list[int]]]]:
    """Where a layer stream's part landed, as its prefill rank WROTE it: ``(pages, blocks)``, page ``i`` into
    ``blocks[i][g]`` for each KV cache group ``g`` whose blocks lie in it (the prefill rank's page ``i`` into page
    ``i``): into staging, the staging's pages in the prefill rank's geometry and staging blocks ``0 ..`` (each
    group's after the previous group's); a slice of heads, that slice of each of this rank's pages; else this
    rank's pages whole (a pipeline stage's: the pages of its layers); in the last two, the load's local blocks
    (each group's its own).

    Args:
        part: a layer stream's part.
        desc: this rank's KV layout.
    """
    spec = part.transfer.spec
    groups = [list(g.block_ids) for g in spec.stream_groups] or [list(spec.local_block_ids)]
    if part.stage is not None:
        pages = page_segments(list(part.stage.segments), page_bytes(part.peer.info.layout))
        if spec.stream_groups:
            groups = [list(g.block_ids) for g in staged_groups(spec.stream_groups)]
        else:
            groups = [list(range(len(part.stage.read.remote_block_ids)))]
    else:
        pages = pages_of(desc)
        if part.peer.info.pp_size > 1:  # a pipeline stage's part: the pages of its layers (its view of this rank)
            pages = page_segments(part.peer.local_segments, page_bytes(desc))
        cut = part.head_slice
        if cut is not None:
            pages = [heads_of(page, desc.num_kv_heads, cut.local_head_start, cut.num_heads) for page in pages]
    blocks = [{g: groups[g] for g in part.layer_groups.get(page.layer_start, (0,)) if g < len(groups)}
              for page in pages]
    return pages, blocks


def landed_rows(part: Part, desc: KVLayoutDesc) -> np.ndarray:
    """The rows ``part``'s bytes landed in: its local rows, or, for a layer stream (no rows here), one per page of
    each of its blocks (:func:`stream_pages`), in (page, group, block) order (uint64 ``[n, 3]``)."""
    if part.direction is not Direction.STREAM:
        return part.local_descs
    pages, blocks = stream_pages(part, desc)
    rows = [[page.addr + block * page.block_stride, page.length, 0]
            for page, groups in zip(pages, blocks, strict=True) for ids in groups.values() for block in ids]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def landed(part: Part, desc: KVLayoutDesc) -> None:
    """``part``'s bytes have landed (before any fixup): its digest over what landed, kept for :func:`judge`: over
    its local rows (a READ or push), or, for a layer stream (whose part has no rows here), over every page of its
    blocks (:func:`p2pkv.dataplane.digest.pages_digest`, as its prefill rank took it).

    Args:
        part: the part.
        desc: this rank's KV layout (a stream's pages).

    Raises:
        p2pkv.dataplane.digest.DigestError: its rows cannot be digested (malformed, or not host memory).
    """
    if part.direction is Direction.STREAM:
        part.landed_digest = pages_digest(*stream_pages(part, desc))
    else:
        part.landed_digest = digest_rows(part.local_descs)


def judge(part: Part) -> Check:
    """``part``'s check: its landed digest against its producer's (pure)."""
    if part.landed_digest is None or part.digest is None:
        return Check.WAIT
    if not part.digest:
        return Check.MISSING
    return Check.VERIFIED if part.digest == part.landed_digest else Check.MISMATCH


MAX_PLACES = 4
"""Most layers (with their blocks) a mismatch's log line names."""


def places(part: Part, desc: KVLayoutDesc) -> list[str]:
    """Where ``part``'s two digests differ (:func:`p2pkv.dataplane.digest.differing_items`): for each of the first
    :data:`MAX_PLACES` layers (K/V) in the buckets that differ, the blocks they cover there (this rank's, or its
    staging's before the fixup); ``[]`` when neither digest says (pure apart from reading ``desc``'s pages).

    Args:
        part: a part whose check is :attr:`Check.MISMATCH`.
        desc: this rank's KV layout.
    """
    if not part.digest or not part.landed_digest:
        return []
    try:
        items = _stream_items(part, desc) if part.direction is Direction.STREAM else _row_items(part, desc)
    except LayoutError:
        return []
    where = "staging block" if part.stage is not None else "block"
    by_layer: dict[str, set[int]] = {}
    unplaced = []
    for span in differing_items(part.digest, part.landed_digest, len(items)):
        for i in span:
            item = items[i]
            if item is None:
                unplaced.append(i)
                continue
            layer, kv, blocks = item
            by_layer.setdefault(f"{layer}{'KV'[kv] if kv >= 0 else ''}", set()).update(blocks)
    out = [f"layer {name}, {where}{'s' if len(ids) > 1 else ''} {_listed(sorted(ids))}"
           for name, ids in sorted(by_layer.items(), key=lambda kv: _layer_key(kv[0]))[:MAX_PLACES]]
    if len(by_layer) > MAX_PLACES:
        out.append(f"{len(by_layer) - MAX_PLACES} more layers")
    if unplaced:
        out.append(f"rows {_listed(unplaced)} (in no page)")
    return out


Place = tuple[int, int, tuple[int, ...]]
"""One row's or piece's place: ``(layer, kv index (-1: K and V together), block ids)``."""


def _layer_key(name: str) -> tuple[int, str]:
    digits = name.rstrip("KV")
    return int(digits), name[len(digits):]


def _listed(values: list[int]) -> str:
    """``values`` joined, at most 8 of them (then how many more)."""
    more = f" and {len(values) - 8} more" if len(values) > 8 else ""
    return ", ".join(map(str, values[:8])) + more


def _stream_items(part: Part, desc: KVLayoutDesc) -> list[Place | None]:
    """A layer stream's pieces in :func:`p2pkv.dataplane.digest.combine`'s order, each a page of one block, named
    by this rank's layer (a pipeline stage's pages count its layers from 0: its first layer is added)."""
    pages, blocks = stream_pages(part, desc)
    first = part.peer.info.layout.first_layer if part.peer.info.pp_size > 1 else 0
    keys = sorted((i, g, j) for i, groups in enumerate(blocks) for g, ids in groups.items() for j in range(len(ids)))
    return [(first + pages[i].layer_start, pages[i].kv_index, (blocks[i][g][j],)) for i, g, j in keys]


def _row_items(part: Part, desc: KVLayoutDesc) -> list[Place | None]:
    """Each of ``part``'s local rows: the page it lies in (this rank's, or its staging's in the prefill rank's
    geometry) and the blocks it spans (None: in no page)."""
    if part.stage is not None:
        pages = page_segments(list(part.stage.segments), page_bytes(part.peer.info.layout))
        num_blocks = len(part.stage.read.remote_block_ids)
    else:
        pages, num_blocks = pages_of(desc), desc.num_blocks
    out: list[Place | None] = []
    for addr, length, _ in part.local_descs.tolist():
        out.append(None)
        for page in pages:
            block, offset = divmod(addr - page.addr, page.block_stride)
            if 0 <= block < num_blocks and offset < page.length:
                last = block + (offset + length - 1) // page.block_stride
                out[-1] = (page.layer_start, page.kv_index, tuple(range(block, last + 1)))
                break
    return out


@dataclass(frozen=True)
class Finding:
    """A part whose check failed, as the log line and the load's failure name it.

    Attributes:
        part: the part.
        check: :attr:`Check.MISMATCH` or :attr:`Check.MISSING`.
    """

    part: Part
    check: Check

    def describe(self, desc: KVLayoutDesc) -> str:
        """The failure's reason: request, prefill rank, direction, what moved, both digests and, for a mismatch,
        where the bytes differ (:func:`places`; ``desc``: this rank's KV layout)."""
        p = self.part
        spec = p.transfer.spec
        rows = "every page" if p.direction is Direction.STREAM else f"{int(p.local_descs.shape[0])} rows"
        moved = (f"request {spec.request_id!r} (prefill request {spec.remote.request_id!r}), "
                 f"{len(spec.local_block_ids)} blocks from prefill rank {p.peer.agent_name}, "
                 f"{p.direction.value if p.direction else 'unposted'}, {rows}, {p.num_bytes} bytes"
                 f"{', into staging' if p.stage is not None else ''}")
        if self.check is Check.MISSING:
            return (f"verify_kv: no digest from the prefill rank for {moved}: it could not digest its KV "
                    "(see its log); the load fails closed")
        landed = p.landed_digest or b""
        sent = p.digest or b""
        where = places(p, desc)
        return (f"verify_kv: KV digest mismatch for {moved}"
                f"{': differs at ' + '; '.join(where) if where else ''}: landed {landed[:DIGEST_BYTES].hex()}, "
                f"prefill sent {sent[:DIGEST_BYTES].hex()}; the bytes that landed are not the prefill's")


def findings(transfer: Transfer) -> tuple[list[Finding], bool]:
    """``transfer``'s failed checks, and whether every part is decided (pure).

    Returns:
        ``(failed, decided)``: the parts whose check is :attr:`Check.MISMATCH` or :attr:`Check.MISSING`, and
        False while any part is still :attr:`Check.WAIT`.
    """
    checks = [(part, judge(part)) for part in transfer.parts]
    failed = [Finding(part, check) for part, check in checks if check in (Check.MISMATCH, Check.MISSING)]
    return failed, all(check is not Check.WAIT for _, check in checks)
