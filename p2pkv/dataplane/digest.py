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
the ``xxhash`` package) streamed over the rows' bytes in row order: rows that
touch (one ends where the next begins) are read as one range, which gives the
same digest since the bytes are the same. About 0.6-0.7 of a copy of the same
bytes on one CPU core (docs/benchmarks/digest-cpu.md). A digest is 8 bytes,
big-endian (:data:`DIGEST_BYTES`).

A layer stream's bytes come chunk by chunk, a block sent again when a later
chunk fills it further, so its digest is not taken over rows in order but
per page of each destination block (:func:`page_block_digest`; the last one
taken of a page and block stands), the pieces then digested in (page, block)
order (:func:`combine`); the consumer takes the same over its pages and
blocks once everything landed (:func:`pages_digest`).

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

from handshake.messages import DIGEST_BYTES
from p2pkv.dataplane.layout import Segment

__all__ = ["ALGORITHM", "DIGEST_BYTES", "DigestError", "check_host", "combine", "digest_rows", "merged_ranges",
           "page_block_digest", "pages_digest"]

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


def merged_ranges(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges ``rows`` name, in order, consecutive rows that touch merged into one.

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``.

    Returns:
        ``(addrs, lengths)``: int64 ``[m]`` each, ``m <= n``; the same bytes in the same order.

    Raises:
        DigestError: ``rows`` is not ``[n, 3]``, or a row has zero bytes or an address/length beyond 2**62.
    """
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise DigestError(f"descriptor rows must be [n, 3], got shape {rows.shape}")
    if not rows.shape[0]:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if int(rows[:, :2].max()) >= 1 << 62 or int(rows[:, 1].min()) == 0 or int(rows[:, 0].min()) == 0:
        raise DigestError("a descriptor row has zero bytes, address 0, or an address/length beyond 2**62")
    addr, length = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    starts = np.ones(addr.size, dtype=bool)
    starts[1:] = addr[1:] != addr[:-1] + length[:-1]  # a row that does not begin where the last ended
    first = np.flatnonzero(starts)
    return addr[first], np.add.reduceat(length, first)


def digest_rows(rows: np.ndarray) -> bytes:
    """The XXH3-64 digest of the bytes ``rows`` name, in row order (host memory only: :func:`check_host`).

    Args:
        rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``, every byte in memory this process owns.

    Returns:
        :data:`DIGEST_BYTES` bytes (big-endian); the digest of no bytes when ``rows`` is empty.

    Raises:
        DigestError: malformed rows (:func:`merged_ranges`).
    """
    hasher = xxhash.xxh3_64()
    for addr, length in zip(*merged_ranges(rows), strict=True):
        hasher.update((ctypes.c_char * int(length)).from_address(int(addr)))
    return hasher.digest()


def page_block_digest(page: Segment, block: int) -> bytes:
    """The XXH3-64 digest of page ``page`` of block ``block``: bytes ``[page.addr + block * page.block_stride,
    + page.length)`` (host memory of this process; the caller checked ``block`` against its cache).

    Returns:
        :data:`DIGEST_BYTES` bytes.
    """
    start = page.addr + block * page.block_stride
    return xxhash.xxh3_64((ctypes.c_char * page.length).from_address(start)).digest()


def combine(pieces: Mapping[tuple[int, int], bytes]) -> bytes:
    """One digest of per-(page, block) digests: XXH3-64 over them in ``(page index, block index)`` order.

    Args:
        pieces: ``(page index, destination block index)`` → :func:`page_block_digest`.
    """
    hasher = xxhash.xxh3_64()
    for key in sorted(pieces):
        hasher.update(pieces[key])
    return hasher.digest()


def pages_digest(pages: Sequence[Segment], block_ids: Sequence[int]) -> bytes:
    """:func:`combine` of every page of every block: ``(i, j)`` → ``page_block_digest(pages[i], block_ids[j])``
    (what a layer stream's producer sends when it WROTE each of ``pages`` into each of ``block_ids``)."""
    return combine({(i, j): page_block_digest(page, block) for i, page in enumerate(pages)
                    for j, block in enumerate(block_ids)})
