"""A digest of the bytes descriptor rows name: what verified KV compares on both sides of a transfer.

A transfer's rows pair up one for one (:mod:`p2pkv.dataplane.plan`): row
``i`` on the sending side holds exactly the bytes row ``i`` on the receiving
side is to hold once the READ or WRITE has landed. So the producer digests
its rows (the memory the transfer reads) and the consumer digests its rows
(the memory the transfer wrote: its own blocks, or staging before the fixup),
in the same order, and the two digests are equal exactly when every byte
landed where it belongs: a WRITE into the wrong blocks, a READ of reused
blocks, a partial write or a fixup fed the wrong bytes all change one side's.

The digest is XXH3-64 (xxHash, Yann Collet, https://github.com/Cyan4973/xxHash;
the ``xxhash`` package). The rows are cut into at most :data:`DIGEST_BUCKETS`
buckets of consecutive rows (row ``i`` of ``n`` in bucket ``i * m // n``,
``m = min(n, DIGEST_BUCKETS)``: :func:`bucket_items`), each bucket's bytes
digested in row order (rows of one bucket that touch, one ending where the
next begins, read as one range: the same bytes); the digest is XXH3-64 over
the buckets' digests in order (:data:`DIGEST_BYTES`, big-endian), followed by
the first :data:`BUCKET_BYTES` of each bucket's: equal digests decide that
every byte landed where it belongs, and the buckets that differ say where a
mismatch lies (:func:`differing_items`). About 0.6-0.7 of a copy of the same
bytes on one CPU core (docs/benchmarks/digest-cpu.md).

A layer stream's bytes come chunk by chunk, a block sent again when a later
chunk fills it further, so its digest is not taken over rows in order but
per page of each destination block (:func:`page_block_digest`; the last one
taken of a page and block stands), the pieces then digested in (page, KV
cache group, block) order and bucketed as rows are (:func:`combine`; a model with several KV cache
groups writes several groups' blocks into one layer's pages, vLLM's hybrid
KV cache sharing the tensors); the consumer takes the same over its pages
and each one's groups' blocks once everything landed (:func:`pages_digest`).

Only host memory is read here (a KV cache on the CPU, and its staging): the
caller checks that the rows lie in memory of its own KV cache or staging on
the host before asking (:func:`check_host`). Reading a device pointer as host
memory would crash the process.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import numpy as np
import xxhash

from handshake.messages import BUCKET_BYTES, DIGEST_BUCKETS, DIGEST_BYTES
from p2pkv.dataplane.layout import Segment

__all__ = ["ALGORITHM", "BUCKET_BYTES", "DIGEST_BUCKETS", "DIGEST_BYTES", "DigestError", "bucket_items",
           "check_host", "combine", "differing_items", "digest_rows", "merged_ranges", "page_block_digest",
           "pages_digest"]

ALGORITHM = "xxh3-64"
"""The digest's algorithm, as docs and log lines name it."""


class DigestError(ValueError):
    """Rows that cannot be digested here; the message names why."""


def check_host(device: str) -> None:
    """Refuse to digest memory that is not the host's.

    Args:
        device: the KV cache's torch device type (``"cpu"``, ``"cuda"``, ...).

    Raises:
        DigestError: ``device`` is not ``"cpu"`` (this release digests host memory only; names the setting).
    """
    if device != "cpu":
        raise DigestError(f"verify_kv digests KV caches in host memory only, and this one is on {device!r}; "
                          "set verify_kv=false for this engine (docs/reliability.md, \"Verified KV\")")


def bucket_items(n: int) -> np.ndarray:
    """The bucket of each of ``n`` items (rows, or a stream's pieces): ``i * m // n`` with
    ``m = min(n, DIGEST_BUCKETS)`` (int64 ``[n]``, non-decreasing, every bucket ``0 .. m-1`` used)."""
    m = min(n, DIGEST_BUCKETS)
    return (np.arange(n, dtype=np.int64) * m) // max(n, 1)


def differing_items(a: bytes, b: bytes, n: int) -> list[range]:
    """The items (of ``n``) in the buckets where digests ``a`` and ``b`` of them differ, one range per bucket.

    Args:
        a / b: two digests of the same ``n`` items (:func:`digest_rows` or :func:`combine`).
        n: how many items they cover.

    Returns:
        For each bucket whose :data:`BUCKET_BYTES` differ, its items (``range``); all ``n`` items as one range when
        a digest carries no buckets (or another number of them).
    """
    m = min(n, DIGEST_BUCKETS)
    want = DIGEST_BYTES + m * BUCKET_BYTES
    if len(a) != want or len(b) != want:
        return [range(n)] if n else []
    out = []
    for j in range(m):
        at = DIGEST_BYTES + j * BUCKET_BYTES
        if a[at:at + BUCKET_BYTES] != b[at:at + BUCKET_BYTES]:
            out.append(range(-(-j * n // m), -(-(j + 1) * n // m)))
    return out


def merged_ranges(rows: np.ndarray, buckets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges ``rows`` name, in order, consecutive rows that touch (and share a bucket) merged into one.

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``.
        buckets: int64 ``[n]``, each row's bucket (:func:`bucket_items`); None: one bucket.

    Returns:
        ``(addrs, lengths)``: int64 ``[m]`` each, ``m <= n``; the same bytes in the same order.

    Raises:
        DigestError: ``rows`` is not ``[n, 3]``, or a row has zero bytes or an address/length beyond 2**62.
    """
    first = _runs(rows, buckets)
    addr, length = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    if not first.size:
        return addr, length
    return addr[first], np.add.reduceat(length, first)


def _runs(rows: np.ndarray, buckets: np.ndarray | None) -> np.ndarray:
    """The index of each merged range's first row (int64; see :func:`merged_ranges`; raises as it does)."""
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise DigestError(f"descriptor rows must be [n, 3], got shape {rows.shape}")
    if not rows.shape[0]:
        return np.zeros(0, dtype=np.int64)
    if int(rows[:, :2].max()) >= 1 << 62 or int(rows[:, 1].min()) == 0 or int(rows[:, 0].min()) == 0:
        raise DigestError("a descriptor row has zero bytes, address 0, or an address/length beyond 2**62")
    addr, length = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    starts = np.ones(addr.size, dtype=bool)
    starts[1:] = addr[1:] != addr[:-1] + length[:-1]  # a row that does not begin where the last ended
    if buckets is not None:
        starts[1:] |= buckets[1:] != buckets[:-1]
    return np.flatnonzero(starts)


def _finish(hashers: list[xxhash.xxh3_64]) -> bytes:
    """XXH3-64 of the buckets' digests in order, then the first :data:`BUCKET_BYTES` of each."""
    digests = [h.digest() for h in hashers]
    return xxhash.xxh3_64(b"".join(digests)).digest() + b"".join(d[:BUCKET_BYTES] for d in digests)


def digest_rows(rows: np.ndarray) -> bytes:
    """The digest of the bytes ``rows`` name, bucketed in row order (host memory only: :func:`check_host`).

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``, every byte in memory this process owns.

    Returns:
        :data:`DIGEST_BYTES` bytes (big-endian), then :data:`BUCKET_BYTES` per bucket (``min(n, DIGEST_BUCKETS)``);
        the digest of no bytes when ``rows`` is empty.

    Raises:
        DigestError: malformed rows (:func:`merged_ranges`).
    """
    buckets = bucket_items(int(rows.shape[0])) if rows.ndim == 2 else None
    first = _runs(rows, buckets)
    hashers = [xxhash.xxh3_64() for _ in range(min(int(rows.shape[0]), DIGEST_BUCKETS))]
    if first.size:
        addrs, lengths = rows[first, 0].astype(np.int64), np.add.reduceat(rows[:, 1].astype(np.int64), first)
        for addr, length, bucket in zip(addrs, lengths, buckets[first], strict=True):  # type: ignore[index]
            hashers[int(bucket)].update((ctypes.c_char * int(length)).from_address(int(addr)))
    return _finish(hashers)


def page_block_digest(page: Segment, block: int) -> bytes:
    """The XXH3-64 digest of page ``page`` of block ``block``: bytes ``[page.addr + block * page.block_stride,
    + page.length)`` (host memory of this process; the caller checked ``block`` against its cache).

    Returns:
        :data:`DIGEST_BYTES` bytes.
    """
    start = page.addr + block * page.block_stride
    return xxhash.xxh3_64((ctypes.c_char * page.length).from_address(start)).digest()


def combine(pieces: Mapping[tuple[int, int, int], bytes]) -> bytes:
    """One digest of per-(page, group, block) digests, in ``(page index, KV cache group, block index)`` order,
    bucketed as :func:`digest_rows` buckets rows (piece ``i`` of ``n`` in bucket ``i * m // n``).

    Args:
        pieces: ``(page index, KV cache group, index in that group's destination blocks)`` →
            :func:`page_block_digest`.
    """
    keys = sorted(pieces)
    hashers = [xxhash.xxh3_64() for _ in range(min(len(keys), DIGEST_BUCKETS))]
    for key, bucket in zip(keys, bucket_items(len(keys)), strict=True):
        hashers[int(bucket)].update(pieces[key])
    return _finish(hashers)


def pages_digest(pages: Sequence[Segment], blocks: Sequence[Mapping[int, Sequence[int]]]) -> bytes:
    """:func:`combine` of every page of each of its groups' blocks: ``(i, g, j)`` →
    ``page_block_digest(pages[i], blocks[i][g][j])`` (what a layer stream's producer sends when it WROTE page
    ``i`` into each of ``blocks[i][g]``, for each KV cache group ``g`` whose blocks lie in that page).

    Args:
        pages: the pages (one per layer, or K and V apart).
        blocks: for each of ``pages``, KV cache group → its block ids (in that page's block numbering).
    """
    return combine({(i, group, j): page_block_digest(page, block) for i, page in enumerate(pages)
                    for group, ids in blocks[i].items() for j, block in enumerate(ids)})
