"""The host's cross-process copy ceiling: ``process_vm_readv`` of a pull's byte ranges, without NIXL or UCX.

On one host without ``xpmem``/``knem``, UCX READs host memory of another
process with ``cma``: ``process_vm_readv`` system calls made by the reading
process. :class:`Readv` makes the same calls directly (one ``iovec`` pair per
call, at most ``chunk`` bytes each), from one or several threads, so
``p2pkv bench transfer`` can measure in the same run how fast this host can
copy between two processes at all. Linux only; the reader needs the right
to read the target's memory (same user and ``kernel.yama.ptrace_scope`` ≤ 1
for a child, or ``CAP_SYS_PTRACE``).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np


class ReadvError(OSError):
    """``process_vm_readv`` failed or moved fewer bytes; the message names the call."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                   ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return libc


def shares(local: np.ndarray, remote: np.ndarray, parts: int) -> list[list[tuple[int, int, int]]]:
    """Split descriptor rows into ``parts`` lists of ``(local addr, remote addr, bytes)`` with equal bytes
    (rows cut where a share ends).

    Args:
        local / remote: uint64 ``[n, 3]`` ``(addr, len, device)`` rows, lengths equal row by row.
        parts: number of shares (threads), >= 1.
    """
    total = int(local[:, 1].sum())
    target = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = target
    for la, ra, n in zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist(), strict=True):
        while n > 0:
            if room == 0:
                out.append([])
                room = target
            take = min(n, room)
            out[-1].append((la, ra, take))
            la, ra, n, room = la + take, ra + take, n - take, room - take
    return out


class Readv:
    """``process_vm_readv`` from process ``pid`` into this one.

    Args:
        pid: the process that owns the remote addresses.
        chunk: most bytes per call (default 64 MiB).

    Raises:
        ReadvError: the C library has no ``process_vm_readv``.
    """

    def __init__(self, pid: int, chunk: int = 64 << 20) -> None:
        try:
            self._fn = _libc().process_vm_readv
        except (OSError, AttributeError) as exc:
            raise ReadvError(f"process_vm_readv is not available: {exc}") from exc
        self.pid, self.chunk = pid, chunk

    def _run(self, rows: list[tuple[int, int, int]], errors: list[str]) -> None:
        lv, rv = _Iovec(), _Iovec()
        for la, ra, n in rows:
            off = 0
            while off < n:
                c = min(self.chunk, n - off)
                lv.base, lv.len, rv.base, rv.len = la + off, c, ra + off, c
                got = self._fn(self.pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
                if got != c:
                    errors.append(f"process_vm_readv(pid {self.pid}, {c} B at {ra + off:#x}) returned {got} "
                                  f"(errno {ctypes.get_errno()})")
                    return
                off += c

    def read(self, local: np.ndarray, remote: np.ndarray, threads: int = 1) -> None:
        """Copy every remote row into its local row, split over ``threads`` threads (1: this thread only).

        Raises:
            ReadvError: a call failed (e.g. ``EPERM``: no right to read the process) or read short.
        """
        parts, errors = shares(local, remote, threads), []
        if len(parts) == 1:
            self._run(parts[0], errors)
        else:
            workers = [threading.Thread(target=self._run, args=(p, errors), daemon=True) for p in parts]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        if errors:
            raise ReadvError(errors[0])
