"""``p2pkv doctor``'s pair check: which UCX transports move a READ and a WRITE between two processes on this host.

A child process (``python -m p2pkv.tools.doctor_pair --serve DRAM|VRAM``)
plays the prefill side: it registers a buffer with a known byte pattern
(host memory, or GPU memory on the last GPU) and prints its NIXL metadata
on one line. This process plays the decode side: it READs the buffer into
its own registered memory (host, or GPU 0), as a decode worker pulls, and
compares the bytes; then it clears its buffer and sends the child its own
metadata on stdin, and the child WRITEs its pattern into it, as a prefill
worker pushes, with a notification on the last WRITE; this process compares
the bytes again once the notification is in. Each side reads its op's
transport off UCX's own protocol selection
(:class:`p2pkv.dataplane.transport.TransportWatch`), exactly as a worker does
at its first xfer with a peer; the child prints its WRITE's report on stdout.

For GPU memory the check fails when UCX moves the WRITEs, or both directions,
over TCP (the silent fallback that makes VRAM transfers ~1000× slower than the
device), naming the fix. READs alone over TCP pass, saying so and still
naming the fix: ``transfer_mode: auto`` (the default) then has the prefill
side WRITE (UCX turns cuda_ipc GET off without NVLink, so this is what a
single-GPU or PCIe node shows). Without a CUDA device it is skipped (reported
ok, with the reason).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from handshake import AgentInfo, KVLayoutDesc, KVRegion, compute_digest
from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import Region
from p2pkv.dataplane.transport import TransportReport, is_zero_copy, vram_over_tcp_fix

MARKER = "P2PKV-DOCTOR-PAIR "
"""Prefix of the child's one line of metadata on stdout (UCX and NIXL may print around it)."""
WRITTEN = "P2PKV-DOCTOR-WRITTEN "
"""Prefix of the child's one line about its WRITEs: ``{"seconds", "report"}`` or ``{"error"}``."""
WRITE_CMD = "write "
"""Prefix of the line on the child's stdin asking for the WRITEs: the parent's metadata, address, device."""
NOTIF = b"p2pkv-doctor-pair-written"
"""The notification on the child's last WRITE."""


class PairError(RuntimeError):
    """The pair could not be set up or an xfer failed; the message says where."""


@dataclass
class PairResult:
    """One READ (decode side pulls) and one WRITE (prefill side pushes) between the two processes.

    Attributes:
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        nbytes: bytes of each xfer.
        seconds: the fastest READ, posted to seen done.
        bytes_ok: the bytes READ equal the child's pattern.
        report: which UCX transport moved the READs (this process's view).
        write_seconds: the fastest WRITE, posted to seen done (in the child).
        write_bytes_ok: the bytes WRITTEN equal the child's pattern.
        write_report: which UCX transport moved the WRITEs (the child's view).
        xfers: xfers timed each way (the first, connection set-up, included).
    """

    mem_type: str
    nbytes: int
    seconds: float
    bytes_ok: bool
    report: TransportReport
    write_seconds: float
    write_bytes_ok: bool
    write_report: TransportReport
    xfers: int = 4


def pattern(nbytes: int) -> np.ndarray:
    """The child's bytes: ``i % 251`` (uint8, ``[nbytes]``)."""
    return (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)


def _gpu_buffer(data: np.ndarray | None, nbytes: int, device: int):  # -> torch.Tensor
    import torch

    if data is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    return torch.from_numpy(data).to(f"cuda:{device}")


def info_for(name: str, meta: bytes, mem_type: str) -> AgentInfo:
    """An :class:`AgentInfo` for a peer's raw NIXL metadata (layout fields are placeholders)."""
    layout = KVLayoutDesc(kv_layout="BLHNC", attn_layout="HND", dtype="uint8", num_layers=1, num_kv_heads=1,
                          head_dim=1, block_size=1, num_blocks=1, block_len=1, block_stride=1, mem_type=mem_type,
                          regions=[KVRegion(base_addr=0, length=1)])
    return AgentInfo(engine_id="doctor", tp_rank=0, tp_size=1, agent_name=name, agent_metadata=meta,
                     metadata_digest=compute_digest(meta), compat_hash="doctor", layout=layout)


def _timed(agent: NixlTransferAgent, op: str, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes,
           timeout_s: float) -> float:
    """One ``op`` xfer, posted to seen done (seconds)."""
    start = time.perf_counter()
    xfer = agent.start_xfer(op, peer, local, remote, notif)
    deadline = time.monotonic() + timeout_s
    while not agent.poll(xfer):
        if time.monotonic() > deadline:
            agent.cancel(xfer)
            raise PairError(f"a {int(local[0, 1]) >> 20} MiB {op} did not finish within {timeout_s:.0f} s")
        time.sleep(0.0002)
    return time.perf_counter() - start


def _serve_writes(agent: NixlTransferAgent, addr: int, device: int, nbytes: int, mem_type: str, ask: dict) -> dict:
    """The child's WRITEs of its buffer into the parent's (``ask``: name, meta, addr, device, xfers, timeout_s)."""
    reports: list[TransportReport] = []
    agent.on_transport = reports.append
    try:
        peer = agent.add_peer(info_for(ask["name"], bytes.fromhex(ask["meta"]), mem_type))
        local = np.array([[addr, nbytes, device]], dtype=np.uint64)
        remote = np.array([[ask["addr"], nbytes, ask["device"]]], dtype=np.uint64)
        n = int(ask["xfers"])
        seconds = min(_timed(agent, "WRITE", peer, local, remote, NOTIF if i == n - 1 else b"", ask["timeout_s"])
                      for i in range(n))
    except (TransferError, PairError) as exc:
        return {"error": str(exc)}
    report = next((r for r in reports if r.op == "WRITE"), None)
    return {"seconds": seconds, "report": dataclasses.asdict(report) if report else None}


def serve(mem_type: str, nbytes: int, max_life_s: float = 120.0) -> int:
    """The child: register the pattern, print the metadata line, WRITE when stdin asks, progress NIXL until
    stdin says stop or closes."""
    src = pattern(nbytes)
    device = 0
    if mem_type == "VRAM":
        import torch

        device = torch.cuda.device_count() - 1
        torch.cuda.set_device(device)
        buf = _gpu_buffer(src, nbytes, device)
        addr = buf.data_ptr()
    else:
        buf, addr = src, src.ctypes.data
    agent = NixlTransferAgent(f"p2pkv-doctor-pair-src-{os.getpid()}", ["UCX"])
    try:
        agent.register([Region(addr, nbytes)], mem_type, device)
        line = {"name": agent.name, "meta": agent.metadata().hex(), "addr": addr, "device": device}
        print(MARKER + json.dumps(line), flush=True)
        end, pending, fd = time.monotonic() + max_life_s, b"", sys.stdin.fileno()
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.001)
            chunk = os.read(fd, 1 << 20) if ready else b""
            if ready and not chunk:  # the parent went away
                break
            pending += chunk
            if b"\n" in pending:
                cmd, pending = pending.split(b"\n", 1)
                if not cmd.startswith(WRITE_CMD.encode()):  # "stop"
                    break
                ask = json.loads(cmd[len(WRITE_CMD):])
                print(WRITTEN + json.dumps(_serve_writes(agent, addr, device, nbytes, mem_type, ask)), flush=True)
            agent.get_notifs()  # progress: an xfer from an unconnected peer needs the target's worker
    finally:
        agent.close()
        del buf
    return 0


class _ChildLines:
    """The child's stdout and stderr, drained on a thread: marker lines by prefix, the rest kept as a tail."""

    def __init__(self, child: subprocess.Popen) -> None:
        self._child = child
        self._lines: dict[str, queue.Queue[str]] = {MARKER: queue.Queue(), WRITTEN: queue.Queue()}
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.ended = threading.Event()
        """Set once the child's output ended (it exited or closed it)."""
        threading.Thread(target=self._drain, name="p2pkv-doctor-pair", daemon=True).start()

    def _drain(self) -> None:
        assert self._child.stdout is not None
        for line in self._child.stdout:
            prefix = next((p for p in self._lines if line.startswith(p)), None)
            if prefix is None:
                self.tail.append(line.rstrip())
            else:
                self._lines[prefix].put(line[len(prefix):])
        for q in self._lines.values():
            q.put("")
        self.ended.set()

    def poll(self, prefix: str) -> dict | None:
        """The JSON of the next ``prefix`` line if one is in, else None (a child that ended gives None too)."""
        try:
            text = self._lines[prefix].get_nowait()
        except queue.Empty:
            return None
        if not text:
            self._lines[prefix].put("")  # keep the end visible to get()
            return None
        return json.loads(text)

    def get(self, prefix: str, timeout_s: float, what: str) -> dict:
        """The JSON of the next ``prefix`` line.

        Raises:
            PairError: none within ``timeout_s`` (seconds), or the child ended; names ``what`` and the child's tail.
        """
        try:
            text = self._lines[prefix].get(timeout=timeout_s)
        except queue.Empty:
            text = ""
        if not text:
            raise self.error(what, timeout_s)
        return json.loads(text)

    def error(self, what: str, timeout_s: float) -> PairError:
        """``"the prefill-side child process did not <what> within <timeout_s> s (exit code, last lines)"``."""
        tail = " | ".join(list(self.tail)[-5:]) or "no output"
        return PairError(f"the prefill-side child process did not {what} within {timeout_s:.0f} s "
                         f"(exit code {self._child.poll()}; its last lines: {tail})")


def pair_transfers(mem_type: str = "DRAM", nbytes: int = 16 << 20, timeout_s: float = 60.0,
                   xfers: int = 4) -> PairResult:
    """READ ``nbytes`` of ``mem_type`` memory from a child process on this host, then have the child WRITE them
    back (see the module docstring); ``xfers`` each way, the first one setting up the connection, the fastest
    one's time reported.

    Raises:
        PairError: the child did not start, NIXL refused, an xfer did not finish within ``timeout_s``, or the
            WRITE's notification did not arrive within ``timeout_s``.
    """
    child = subprocess.Popen([sys.executable, "-m", "p2pkv.tools.doctor_pair", "--serve", mem_type,
                              "--nbytes", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines = _ChildLines(child)
    agent = None
    try:
        peer_line = lines.get(MARKER, timeout_s, "publish its NIXL metadata")
        if mem_type == "VRAM":
            dst = _gpu_buffer(None, nbytes, 0)
            addr = dst.data_ptr()
        else:
            dst = np.zeros(nbytes, dtype=np.uint8)
            addr = dst.ctypes.data
        agent = NixlTransferAgent(f"p2pkv-doctor-pair-dst-{os.getpid()}", ["UCX"])
        agent.register([Region(addr, nbytes)], mem_type, 0)
        peer = agent.add_peer(info_for(peer_line["name"], bytes.fromhex(peer_line["meta"]), mem_type))
        local = np.array([[addr, nbytes, 0]], dtype=np.uint64)
        remote = np.array([[peer_line["addr"], nbytes, peer_line["device"]]], dtype=np.uint64)
        seconds = min(_timed(agent, "READ", peer, local, remote, b"", timeout_s) for _ in range(xfers))
        read_ok = _equal(dst, mem_type, nbytes)
        dst[:] = 0
        if mem_type == "VRAM":
            import torch

            torch.cuda.synchronize()  # the zeros land before the child's WRITEs
        ask = {"name": agent.name, "meta": agent.metadata().hex(), "addr": addr, "device": 0, "xfers": xfers,
               "timeout_s": timeout_s}
        assert child.stdin is not None
        child.stdin.write(WRITE_CMD + json.dumps(ask) + "\n")
        child.stdin.flush()
        written = _await_writes(agent, lines, timeout_s)
        write_report = (TransportReport(**written["report"]) if written["report"] else
                        TransportReport(agent.name, mem_type, "unknown", "", "the child reported no WRITE "
                                        "transport", "WRITE"))
        return PairResult(mem_type, nbytes, seconds, read_ok, agent.transports[peer], written["seconds"],
                          _equal(dst, mem_type, nbytes), write_report, xfers)
    except TransferError as exc:
        raise PairError(str(exc)) from exc
    finally:
        if agent is not None:
            agent.close()
        try:
            if child.stdin is not None:
                child.stdin.write("stop\n")
                child.stdin.close()
            child.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()


def _equal(buf, mem_type: str, nbytes: int) -> bool:  # buf: np.ndarray or torch.Tensor
    got = buf.cpu().numpy() if mem_type == "VRAM" else buf
    return bool(np.array_equal(got, pattern(nbytes)))


def _await_writes(agent: NixlTransferAgent, lines: _ChildLines, timeout_s: float) -> dict:
    """Progress this agent until the child has reported its WRITEs and its last WRITE's notification is in (the
    bytes land before it); the child's report.

    Raises:
        PairError: the child's WRITE failed, or either did not come within ``timeout_s`` (seconds).
    """
    deadline, notified, written = time.monotonic() + timeout_s, False, None
    while not (notified and written):
        notified = notified or NOTIF in agent.get_notifs()
        ended = lines.ended.is_set()  # before polling: every line of an ended child is queued by then
        written = written or lines.poll(WRITTEN)
        if written and "error" in written:
            raise PairError(f"the prefill-side child's WRITE failed: {written['error']}")
        if not written and ended:
            raise lines.error("report its WRITEs (its output ended)", timeout_s)
        if time.monotonic() > deadline:
            raise lines.error("deliver the notification of its last WRITE" if written else "report its WRITEs",
                              timeout_s)
        time.sleep(0.0005)
    return written


def _copy_label(report: TransportReport) -> str:
    if report.transport == "unknown":
        return "unknown"
    return "zero-copy" if is_zero_copy(report) else "not zero-copy"


def _line(result: PairResult, op: str) -> str:
    """``"READ  decode←prefill: cma (zero-copy), 2.10 ms, 7.99 GB/s; UCX: ..."`` (or the WRITE's)."""
    r, s = (result.report, result.seconds) if op == "READ" else (result.write_report, result.write_seconds)
    label = "READ  decode←prefill" if op == "READ" else "WRITE prefill→decode"
    return (f"{label}: {r.transport} ({_copy_label(r)}), {s * 1e3:.2f} ms, {result.nbytes / s / 1e9:.2f} GB/s; "
            f"UCX: {r.detail}")


def verdict(result: PairResult) -> tuple[bool, str, str]:
    """``(ok, detail, fix)`` of a pair's READ and WRITE: bytes must match; GPU memory must not go over TCP.

    ``detail`` is three lines: the pair, then one line per direction; a fourth
    when only the READs go over TCP while the WRITEs are zero-copy, which
    passes (``transfer_mode: auto`` pushes there) with ``fix`` naming what
    would make READs fast too.
    """
    detail = (f"{result.mem_type} pair on this host, {result.nbytes >> 20} MiB each way "
              f"(the fastest of {result.xfers}):\n{_line(result, 'READ')}\n{_line(result, 'WRITE')}")
    wrong = [op for op, ok in (("READ", result.bytes_ok), ("WRITE", result.write_bytes_ok)) if not ok]
    if wrong:
        return (False, detail + f"\nthe bytes of the {' and the '.join(wrong)} differ from the source",
                "report this with `p2pkv doctor --json`")
    slow = [r for r in (result.report, result.write_report) if r.vram_over_tcp]
    if not slow:
        return True, detail, ""
    fix = "; ".join(f"{r.op}s: {vram_over_tcp_fix(r.op)}" for r in slow)
    if [r.op for r in slow] == ["READ"] and is_zero_copy(result.write_report):
        return True, detail + (f"\ntransfer_mode auto (the default) and push move this pair's KV by "
                               f"{result.write_report.transport} WRITEs; transfer_mode pull would READ over "
                               f"TCP"), fix
    return False, detail, fix


def main(argv: list[str] | None = None) -> int:
    """The child's entry point (``--serve``)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--serve", choices=["DRAM", "VRAM"], required=True)
    p.add_argument("--nbytes", type=int, default=16 << 20)
    args = p.parse_args(argv)
    return serve(args.serve, args.nbytes)


if __name__ == "__main__":
    sys.exit(main())
