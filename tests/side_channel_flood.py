"""Hostile connections against a real side-channel server: what they cost it, and whether honest clients are
still answered meanwhile.

A :class:`handshake.HandshakeServer` with a secret (CURVE) runs in its own process
(:class:`tests.handshake_support.ServerProcess`), so its RSS is the server's alone. This process opens ``--hostile``
raw TCP connections to it, all of one kind:

* ``hello``: the ZMTP greeting offering CURVE, then a HELLO command announced as ``--hello-mib`` MiB and sent
  all but its last byte, then nothing (libzmq buffers the command until it is complete);
* ``idle``: the greeting, then nothing (a peer that never finishes the handshake).

Meanwhile it fetches the server's ``AgentInfo`` (a fresh connection each, as a decode worker's first handshake)
every 50 ms, and samples the server's RSS every 5 ms. Reports the RSS before, its peak growth, when (seconds
after the attack began) it was back within 8 MiB of where it started, how long opening the connections took,
how many were still open a second after, when the server had closed every one, and the honest fetches answered
and their latency.

Run (one line of JSON per run)::

    .venv/bin/python -m tests.side_channel_flood --hostile 16 --kind hello
    .venv/bin/python -m tests.side_channel_flood --hostile 256 --kind idle --hold-s 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

from handshake import Destination, HandshakeError, fetch_agent_info
from tests.handshake_support import ServerProcess, make_agent_info

HOST = "127.0.0.1"
COMPAT = "compat-test"
SECRET = b"side-channel-flood-secret"
ENGINE = "prefill-engine"
MiB = 1 << 20
SETTLED_BYTES = 8 * MiB
"""RSS within this many bytes of where it started counts as fallen back."""


def curve_greeting() -> bytes:
    """The ZMTP 3.0 greeting of a client offering the CURVE mechanism (64 bytes)."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def open_hostile(port: int, kind: str, hello_bytes: int) -> socket.socket:
    """One hostile connection of ``kind`` (``hello`` or ``idle``), left open; its bytes are sent by the time
    this returns (or the server cut it: then the socket is already closed by the peer)."""
    sock = socket.create_connection((HOST, port))
    with contextlib.suppress(OSError):
        sock.sendall(curve_greeting())
        if kind == "hello":  # a command frame (flags COMMAND | LONG) announced as hello_bytes, all but 1 byte sent
            sock.sendall(bytes([0x06]) + struct.pack(">Q", hello_bytes))
            chunk, left = b"\x00" * MiB, hello_bytes - 1
            while left > 0:
                left -= sock.send(memoryview(chunk)[:min(left, MiB)])
    return sock


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset; its greeting bytes are read and ignored)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class FloodResult:
    """What one attack cost the server (bytes, seconds after the attack began) and what honest clients saw."""

    hostile: int
    kind: str
    hello_mib: float
    rss_before_mib: float = 0.0
    peak_growth_mib: float = 0.0
    settled_after_s: float | None = None
    opened_in_s: float = 0.0
    open_1s_later: int = 0
    all_cut_after_s: float | None = None
    honest_ok: int = 0
    honest_failed: int = 0
    honest_p50_ms: float = 0.0
    honest_max_ms: float = 0.0
    honest_errors: list[str] = field(default_factory=list)


class _Sampler:
    """Samples a process's RSS every 5 ms on a thread: peak, and the last time it was above a level."""

    def __init__(self, pid: int, before: int) -> None:
        self.pid, self.before, self.peak, self.t0 = pid, before, before, time.monotonic()
        self.last_high = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            rss = rss_bytes(self.pid)
            self.peak = max(self.peak, rss)
            if rss - self.before > SETTLED_BYTES:
                self.last_high = time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _honest(port: int, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    while not stop.wait(0.05):
        t = time.monotonic()
        try:
            fetch_agent_info(Destination(HOST, port, ENGINE, 0), "decode-engine", COMPAT, secret=SECRET, timeout_s=2.0,
                             retries=1)
            latencies.append(time.monotonic() - t)
        except HandshakeError as exc:
            errors.append(f"{exc.code}: {str(exc)[:80]}")


@contextlib.contextmanager
def hostile_connections(port: int, n: int, kind: str, hello_bytes: int) -> Iterator[list[socket.socket]]:
    """``n`` hostile connections of ``kind`` opened from 8 threads; closed on exit."""
    socks: list[socket.socket] = []
    lock = threading.Lock()

    def opener(count: int) -> None:
        for _ in range(count):
            sock = open_hostile(port, kind, hello_bytes)
            with lock:
                socks.append(sock)

    threads = [threading.Thread(target=opener, args=(n // 8 + (i < n % 8),), daemon=True) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        yield socks
    finally:
        for sock in socks:
            sock.close()


def run(hostile: int, kind: str, hello_mib: float = 31.0, hold_s: float = 12.0,
        server_options: dict[str, float] | None = None) -> FloodResult:
    """One attack of ``hostile`` connections of ``kind`` held open ``hold_s`` seconds (see the module's text).

    Args:
        server_options: extra keyword arguments of :class:`handshake.HandshakeServer` (its connection limits).
    """
    hello_bytes = int(hello_mib * MiB)
    result = FloodResult(hostile, kind, hello_mib)
    with ServerProcess(COMPAT, [make_agent_info(0)], secret=SECRET, server_options=server_options) as proc:
        assert proc.pid is not None
        for _ in range(3):  # warm up: lazily allocated state exists before the baseline is taken
            fetch_agent_info(Destination(HOST, proc.port, ENGINE, 0), "decode-engine", COMPAT, secret=SECRET,
                             timeout_s=5.0)
        time.sleep(0.2)
        before = rss_bytes(proc.pid)
        result.rss_before_mib = before / MiB
        sampler = _Sampler(proc.pid, before)
        stop, latencies, errors = threading.Event(), [], []
        honest = threading.Thread(target=_honest, args=(proc.port, stop, latencies, errors), daemon=True)
        honest.start()
        t0 = sampler.t0
        with hostile_connections(proc.port, hostile, kind, hello_bytes) as socks:
            opened = time.monotonic()
            result.opened_in_s = round(opened - t0, 2)
            deadline, open_socks, counted = t0 + hold_s, list(socks), False
            while time.monotonic() < deadline and open_socks:
                open_socks = [s for s in open_socks if not is_closed(s)]
                if not counted and time.monotonic() >= opened + 1.0:
                    result.open_1s_later, counted = len(open_socks), True
                if not open_socks:
                    result.all_cut_after_s = round(time.monotonic() - t0, 2)
                time.sleep(0.02)
            time.sleep(max(0.0, deadline - time.monotonic()))
        stop.set()
        honest.join(5)
        sampler.stop()
        result.peak_growth_mib = round((sampler.peak - before) / MiB, 1)
        result.settled_after_s = round(sampler.last_high, 2) if sampler.last_high < hold_s - 0.05 else None
    result.honest_ok, result.honest_failed = len(latencies), len(errors)
    if latencies:
        latencies.sort()
        result.honest_p50_ms = round(latencies[len(latencies) // 2] * 1e3, 1)
        result.honest_max_ms = round(latencies[-1] * 1e3, 1)
    result.honest_errors = sorted(set(errors))[:4]
    return result


def main(argv: list[str] | None = None) -> int:
    """Run one attack and print its :class:`FloodResult` (and the machine) as one line of JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostile", type=int, default=16, help="hostile connections (default 16)")
    p.add_argument("--kind", choices=("hello", "idle"), default="hello")
    p.add_argument("--hello-mib", type=float, default=31.0, help="announced HELLO size (MiB, default 31)")
    p.add_argument("--hold-s", type=float, default=12.0, help="how long the attack lasts (seconds, default 12)")
    args = p.parse_args(argv)
    result = run(args.hostile, args.kind, args.hello_mib, args.hold_s)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "libzmq": zmq.zmq_version(),
               "pyzmq": zmq.pyzmq_version(), "kernel": platform.release()}
    print(json.dumps({**asdict(result), "machine": machine}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
