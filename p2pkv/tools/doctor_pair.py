"""``p2pkv doctor``'s pair check: which UCX transport moves a READ between two processes on this host.

A child process (``python -m p2pkv.tools.doctor_pair --serve DRAM|VRAM``)
plays the prefill side: it registers a buffer with a known byte pattern
(host memory, or GPU memory on the last GPU) and prints its NIXL metadata
on one line; this process plays the decode side, READs the buffer into its
own registered memory (host, or GPU 0), compares the bytes, and reads the
transport off UCX's own protocol selection
(:class:`p2pkv.dataplane.transport.TransportWatch`), exactly as a decode
worker does at its first pull from a peer.

For GPU memory the check fails when UCX moves the READ over TCP (the silent
fallback that makes VRAM pulls ~1000× slower than the device), naming the
fix; without a CUDA device it is skipped (reported ok, with the reason).
"""

from __future__ import annotations

import argparse
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
from p2pkv.dataplane.transport import VRAM_OVER_TCP_FIX, TransportReport

MARKER = "P2PKV-DOCTOR-PAIR "
"""Prefix of the child's one line of metadata on stdout (UCX and NIXL may print around it)."""


class PairError(RuntimeError):
    """The pair could not be set up or the READ failed; the message says where."""


@dataclass
class PairResult:
    """One READ between the two processes.

    Attributes:
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        nbytes: bytes READ.
        seconds: the fastest READ, posted to seen done.
        bytes_ok: the READ bytes equal the child's pattern.
        report: which UCX transport moved them.
    """

    mem_type: str
    nbytes: int
    seconds: float
    bytes_ok: bool
    report: TransportReport


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


def serve(mem_type: str, nbytes: int, max_life_s: float = 120.0) -> int:
    """The child: register the pattern, print the metadata line, progress NIXL until stdin says stop or closes."""
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
    agent = NixlTransferAgent(f"p2pkv-doctor-pair-src-{os.getpid()}", ["UCX"], report_transport=False)
    try:
        agent.register([Region(addr, nbytes)], mem_type, device)
        line = {"name": agent.name, "meta": agent.metadata().hex(), "addr": addr, "device": device}
        print(MARKER + json.dumps(line), flush=True)
        end = time.monotonic() + max_life_s
        while time.monotonic() < end:
            ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.001)
            if ready:  # "stop", or the parent went away
                break
            agent.get_notifs()  # progress: a READ from an unconnected peer needs the target's worker
    finally:
        agent.close()
        del buf
    return 0


def _child_line(child: subprocess.Popen, timeout_s: float) -> dict:
    """The child's metadata line (read on a thread: other output may come first)."""
    assert child.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def reader() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(MARKER):
                lines.put(line)
                return
        lines.put("")

    threading.Thread(target=reader, name="p2pkv-doctor-pair", daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        line = ""
    if not line:
        raise PairError(f"the prefill-side child process did not publish its NIXL metadata within {timeout_s:.0f} s "
                        f"(exit code {child.poll()})")
    return json.loads(line[len(MARKER):])


def _timed_read(agent: NixlTransferAgent, peer: str, local: np.ndarray, remote: np.ndarray, timeout_s: float) -> float:
    """One READ, posted to seen done (seconds)."""
    start = time.perf_counter()
    read = agent.start_read(peer, local, remote, b"")
    deadline = time.monotonic() + timeout_s
    while not agent.poll(read):
        if time.monotonic() > deadline:
            agent.cancel(read)
            raise PairError(f"a {int(local[0, 1]) >> 20} MiB READ did not finish within {timeout_s:.0f} s")
        time.sleep(0.0002)
    return time.perf_counter() - start


def pair_pull(mem_type: str = "DRAM", nbytes: int = 16 << 20, timeout_s: float = 60.0, reads: int = 3) -> PairResult:
    """READ ``nbytes`` of ``mem_type`` memory from a child process on this host (see the module docstring):
    a first READ (connection set-up), then ``reads`` more; the fastest one's time is reported.

    Raises:
        PairError: the child did not start, NIXL refused, or the READ did not finish within ``timeout_s``.
    """
    child = subprocess.Popen([sys.executable, "-m", "p2pkv.tools.doctor_pair", "--serve", mem_type,
                              "--nbytes", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    agent = None
    try:
        peer_line = _child_line(child, timeout_s)
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
        seconds = min(_timed_read(agent, peer, local, remote, timeout_s) for _ in range(1 + reads))
        got = dst.cpu().numpy() if mem_type == "VRAM" else dst
        return PairResult(mem_type, nbytes, seconds, bool(np.array_equal(got, pattern(nbytes))),
                          agent.transports[peer])
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


def verdict(result: PairResult) -> tuple[bool, str, str]:
    """``(ok, detail, fix)`` of a pair READ: bytes must match; GPU memory must not go over TCP."""
    r = result.report
    detail = (f"{result.mem_type} pair on this host: UCX moves READs with {r.transport} "
              f"({r.detail}); {result.nbytes >> 20} MiB in {result.seconds * 1e3:.2f} ms "
              f"({result.nbytes / result.seconds / 1e9:.2f} GB/s, the fastest of 4 READs)")
    if not result.bytes_ok:
        return False, detail + "; the bytes READ differ from the source", "report this with `p2pkv doctor --json`"
    if r.vram_over_tcp:
        return False, detail, VRAM_OVER_TCP_FIX
    return True, detail, ""


def main(argv: list[str] | None = None) -> int:
    """The child's entry point (``--serve``)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--serve", choices=["DRAM", "VRAM"], required=True)
    p.add_argument("--nbytes", type=int, default=16 << 20)
    args = p.parse_args(argv)
    return serve(args.serve, args.nbytes)


if __name__ == "__main__":
    sys.exit(main())
