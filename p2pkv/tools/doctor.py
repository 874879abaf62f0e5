"""``p2pkv doctor``: is this host's KV transfer path healthy?

Checks, each with a fix when it fails: NIXL installed and its UCX backend
starting (version, plugins), the UCX version and transport settings, RDMA
devices (``/sys/class/infiniband``), a GPU, the CPU features vLLM's CPU kernels use
(:mod:`p2pkv.tools.deploy.cpu_backend`), the side-channel port being
free, a loopback NIXL pull of host memory for about a second, bytes
compared, with its GB/s, and between two processes, of host memory and
(with a CUDA device) of GPU memory, a READ (the decode side pulls) and a
WRITE (the prefill side pushes), bytes compared, each with the UCX transport
UCX selected for it and whether that is zero-copy
(:mod:`p2pkv.tools.doctor_pair`; GPU memory over TCP either way fails the
check). Exit code 1 when any check fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from handshake import AgentInfo, KVLayoutDesc, KVRegion, compute_digest
from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import Region
from p2pkv.dataplane.transport import ucx_version
from p2pkv.tools.doctor_pair import PairError, pair_transfers, verdict


@dataclass
class Check:
    """One diagnosis: ``ok`` False means the path is broken; ``fix`` says what to do."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def loopback_info(agent: NixlTransferAgent) -> AgentInfo:
    """An :class:`AgentInfo` carrying ``agent``'s real NIXL metadata, for a pull
    within one process (the layout fields are placeholders)."""
    meta = agent.metadata()
    layout = KVLayoutDesc(kv_layout="BLHNC", attn_layout="HND", dtype="uint8", num_layers=1, num_kv_heads=1,
                          head_dim=1, block_size=1, num_blocks=1, block_len=1, block_stride=1, mem_type="DRAM",
                          regions=[KVRegion(base_addr=0, length=1)])
    return AgentInfo(engine_id="doctor", tp_rank=0, tp_size=1, agent_name=agent.name, agent_metadata=meta,
                     metadata_digest=compute_digest(meta), compat_hash="doctor", layout=layout)


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def check_nixl() -> Check:
    version = _version("nixl-cu13", "nixl-cu12", "nixl")
    if not version:
        return Check("nixl", False, "NIXL is not installed", "pip install 'p2pkv[nixl-cu13]' (or [nixl-cu12])")
    try:
        agent = NixlTransferAgent("p2pkv-doctor-probe", ["UCX"])
    except TransferError as exc:
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        return Check("nixl", False, f"{version}: {exc}",
                     f"the UCX backend does not start; check the UCX_* environment {env or '(none set)'}")
    plugins = ", ".join(agent._agent.plugin_list)
    agent.close()
    return Check("nixl", True, f"{version}; UCX backend starts; plugins: {plugins}")


def check_ucx() -> Check:
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return Check("ucx", True, f"UCX {ucx_version() or 'unknown'}; environment: {env or 'defaults'}")


def check_rdma() -> Check:
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if devices:
        return Check("rdma", True, f"RDMA devices: {', '.join(devices)} (UCX can use rc/ud/dc transports)")
    return Check("rdma", True, "no RDMA devices in /sys/class/infiniband: UCX uses shared memory (cma) on one "
                 "host and TCP across hosts; for RDMA install rdma-core and expose the HCA (e.g. rdma/ib "
                 "resource, IPC_LOCK)")


RDMA_TRANSPORTS = ("rc", "dc", "ud", "ib", "mlx", "verbs")
"""Substrings of UCX transport or device names that mean RDMA."""

_LANES = re.compile(r"(\S+) (intra-node|inter-node|self) cfg#\d+ (.*)$")


def parse_ucx_lanes(log: str) -> dict[str, str]:
    """``{"self" | "intra-node" | "inter-node": "rma_am(tcp/lo) am(tcp/lo cma/memory) ..."}`` from UCX's
    ``UCX_LOG_LEVEL=info`` output (the lanes UCX selected for each kind of endpoint)."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _LANES.search(line)
        if m:
            out[m.group(2)] = " ".join(m.group(3).split())
    return out


def rdma_reason(lanes: str, devices: list[str], env: dict[str, str]) -> tuple[bool, str]:
    """Whether ``lanes`` use RDMA, and why (not)."""
    if any(t in lanes for t in RDMA_TRANSPORTS):
        return True, "RDMA in use"
    if not devices:
        return False, "no RDMA devices in /sys/class/infiniband"
    tls = env.get("UCX_TLS", "")
    if tls and not any(t in tls for t in (*RDMA_TRANSPORTS, "all")):
        return False, f"UCX_TLS={tls} excludes the RDMA transports (add rc,ud or dc, or unset it)"
    nets = env.get("UCX_NET_DEVICES", "")
    if nets and not any(d in nets for d in devices) and nets != "all":
        return False, f"UCX_NET_DEVICES={nets} excludes {', '.join(devices)} (add e.g. {devices[0]}:1)"
    return False, ("RDMA devices exist but UCX did not pick them on this host (peers on one host use shared "
                   "memory / cuda_ipc); peers on other nodes will use them unless UCX_TLS/UCX_NET_DEVICES "
                   "exclude them")


def check_transports() -> Check:
    """The UCX lanes NIXL selects for a peer on this host, read off UCX's own log in a probe process."""
    env = {**os.environ, "UCX_LOG_LEVEL": "info"}
    probe = "from p2pkv.tools.doctor import check_loopback_pull; check_loopback_pull(0.05, 1 << 20)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return Check("transports", False, "the UCX probe did not finish in 60 s",
                     "check UCX_TLS / UCX_NET_DEVICES (e.g. UCX_NET_DEVICES=lo on a single host)")
    lanes = parse_ucx_lanes(out.stdout + out.stderr)
    chosen = lanes.get("intra-node") or lanes.get("self")
    if not chosen:
        return Check("transports", False, "UCX reported no transport lanes for a peer on this host",
                     "check UCX_TLS / UCX_NET_DEVICES; run with UCX_LOG_LEVEL=info to see UCX's choice")
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    uses_rdma, why = rdma_reason(" ".join(lanes.values()), devices, dict(os.environ))
    return Check("transports", True, f"peer on this host: {chosen}; RDMA: {'yes' if uses_rdma else 'no'} ({why})")


def check_gpu() -> Check:
    try:
        import torch

        if torch.cuda.is_available():
            return Check("gpu", True, f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}")
    except ImportError:
        pass
    return Check("gpu", True, "no CUDA device: KV lives in host memory (NIXL DRAM)")


def check_cpu() -> Check:
    """The CPU features vLLM's CPU build picks kernels by, and the MLA backend p2pkv's launchers choose from them."""
    from p2pkv.tools.deploy.cpu_backend import choose, read_cpu_report

    report = read_cpu_report()
    mla = choose(report, use_mla=True, dtype="float32", block_size=16).attention_backend
    return Check("cpu", True, f"{report.summary()}; an MLA model in float32 runs vLLM's {mla} backend here")


def check_port(host: str, port: int) -> Check:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return Check("side_channel_port", False, f"cannot bind {host}:{port}: {exc.strerror}",
                         "stop what holds the port or set side_channel_port / --side-channel-port to a free one")
    return Check("side_channel_port", True, f"{host}:{port} is free")


def check_loopback_pull(seconds: float = 1.0, nbytes: int = 64 << 20) -> Check:
    """Pull ``nbytes`` of host memory between two NIXL agents repeatedly for ``seconds``."""
    try:
        dst_agent = NixlTransferAgent("p2pkv-doctor-dst", ["UCX"])
        src_agent = NixlTransferAgent("p2pkv-doctor-src", ["UCX"])
    except TransferError as exc:
        return Check("loopback_pull", False, str(exc), "fix the nixl check first")
    try:
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        dst_agent.register([Region(dst.ctypes.data, nbytes)], "DRAM")
        src_agent.register([Region(src.ctypes.data, nbytes)], "DRAM")
        peer = dst_agent.add_peer(loopback_info(src_agent))
        local = np.array([[dst.ctypes.data, nbytes, 0]], dtype=np.uint64)
        remote = np.array([[src.ctypes.data, nbytes, 0]], dtype=np.uint64)
        moved, start = 0, time.perf_counter()
        while moved == 0 or time.perf_counter() - start < seconds:
            pull = dst_agent.start_read(peer, local, remote, b"")
            deadline = time.monotonic() + 10
            while not dst_agent.poll(pull):
                src_agent.get_notifs()  # progress the target's worker too
                if time.monotonic() > deadline:
                    dst_agent.cancel(pull)
                    raise TransferError("a 64 MiB READ did not finish within 10 s")
            moved += nbytes
        elapsed = time.perf_counter() - start
        if not np.array_equal(src, dst):
            return Check("loopback_pull", False, "pulled bytes differ from the source",
                         "report this with `p2pkv doctor --json` output")
        return Check("loopback_pull", True, f"{moved >> 20} MiB in {elapsed:.2f} s: {moved / elapsed / 1e9:.2f} GB/s")
    except TransferError as exc:
        return Check("loopback_pull", False, str(exc),
                     "check UCX_TLS / UCX_NET_DEVICES (e.g. UCX_NET_DEVICES=lo on a single host)")
    finally:
        dst_agent.close()
        src_agent.close()


def check_pair(mem_type: str) -> Check:
    """READ host (``DRAM``) or GPU (``VRAM``) memory from a second process and have it WRITE them back; name
    UCX's transport for each direction."""
    name = f"pair_{mem_type.lower()}"
    if mem_type == "VRAM":
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            return Check(name, True, "skipped: no CUDA device (the GPU-memory pair check needs one)")
    try:
        result = pair_transfers(mem_type)
    except PairError as exc:
        return Check(name, False, str(exc), "check UCX_TLS / UCX_NET_DEVICES and that processes may "
                     "read and write each other's memory (cma: ptrace scope / CAP_SYS_PTRACE)")
    ok, detail, fix = verdict(result)
    return Check(name, ok, detail, fix)


def run_checks(host: str = "127.0.0.1", port: int = 5600, seconds: float = 1.0) -> list[Check]:
    """All checks, in order."""
    checks = [check_nixl(), check_ucx(), check_rdma(), check_gpu(), check_cpu(), check_port(host, port)]
    if checks[0].ok:
        checks.append(check_transports())
        checks.append(check_loopback_pull(seconds))
        checks.append(check_pair("DRAM"))
        checks.append(check_pair("VRAM"))
    return checks


def main(host: str, port: int, seconds: float, as_json: bool) -> int:
    """Print the report; 0 when every check passed, 1 otherwise."""
    checks = run_checks(host, port, seconds)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}".replace("\n", "\n       "))
            if not c.ok:
                print(f"       fix: {c.fix}")
    return 0 if all(c.ok for c in checks) else 1
