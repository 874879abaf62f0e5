"""Checks run before an engine starts: free ports, local addresses, GPUs, block sizes.

Every check raises :class:`~p2pkv.tools.deploy.processes.LaunchError` with a
message that names the flag to change and how.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from p2pkv.tools.deploy.processes import LaunchError

#: Any address outside this machine: connecting a UDP socket to it sends no
#: packet but makes the kernel pick the interface of the outward route.
_OUTWARD_PROBES = (("192.0.2.1", socket.AF_INET), ("2001:db8::1", socket.AF_INET6))


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def check_port_free(host: str, port: int, flag: str) -> None:
    """Fail fast when TCP ``host:port`` cannot be bound.

    Args:
        host: IP address to bind (``0.0.0.0`` checks every interface).
        port: TCP port, 1..65535.
        flag: the command-line flag that set the port, for the message.

    Raises:
        LaunchError: the port is out of range or in use; names ``flag``.
    """
    if not 0 < port < 65536:
        raise LaunchError(f"{flag}={port}: not a TCP port; use 1..65535")
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"{flag}={port}: cannot bind {host}:{port} ({exc.strerror}); pick a free port") from exc


def is_unroutable(ip: str) -> bool:
    """True for loopback and unspecified addresses (``127.x``, ``::1``, ``0.0.0.0``, ``::``)."""
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or addr.is_unspecified


def resolve_local_address(host: str, flag: str) -> str:
    """The IP address ``host`` names, checked to belong to this machine.

    A hostname is resolved with :func:`socket.getaddrinfo` (IPv4 first). The
    address must be bindable here: one that is not cannot be reached by
    peers on other nodes as this engine's side channel.

    Raises:
        LaunchError: ``host`` does not resolve, or is not an address of this
            machine; names ``flag``.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(f"{flag}={host}: cannot resolve it ({exc}); pass an IP address of this "
                          "machine (the pod IP) or a name that resolves to one") from exc
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    ip = str(infos[0][4][0])
    with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError as exc:
            why = "not an address of this machine" if exc.errno == errno.EADDRNOTAVAIL else exc.strerror
            raise LaunchError(f"{flag}={host}: cannot bind {ip} ({why}), so peers on other nodes could not "
                              "reach this engine's side channel there; pass this machine's own IP "
                              "(the pod IP), or leave the flag out to use it") from exc
    return ip


def outward_address() -> str | None:
    """The address of the interface that routes outward (None when there is no route).

    Connects a UDP socket to an address outside this machine and reads the
    local end; a UDP connect sends no packet.
    """
    for probe, family in _OUTWARD_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((probe, 9))
                ip = str(sock.getsockname()[0])
        except OSError:
            continue
        if not is_unroutable(ip):
            return ip
    return None


def default_side_channel_host(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """The side-channel address to use when none is given, and why.

    ``POD_IP`` when set (checked to be local), else the address of the
    outward interface, else a non-loopback address of this host's name.
    Never a loopback or unspecified address.

    Returns:
        ``(ip, reason)``.

    Raises:
        LaunchError: ``POD_IP`` is not an address of this machine, or no
            non-loopback address was found; names ``--side-channel-host``.
    """
    environ = dict(os.environ) if environ is None else environ
    pod_ip = environ.get("POD_IP", "").strip()
    if pod_ip:
        return resolve_local_address(pod_ip, "POD_IP"), "from POD_IP"
    ip = outward_address()
    if ip is not None:
        return ip, "POD_IP is not set: the address of the interface that routes outward"
    try:
        names = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        names = []
    for info in names:
        if not is_unroutable(str(info[4][0])):
            return str(info[4][0]), "POD_IP is not set and no outward route: an address of this host's name"
    raise LaunchError("--side-channel-host: found no address of this machine other than loopback; "
                      "set POD_IP or pass --side-channel-host with the address peers reach this node at")


def check_port_run(host: str, base: int, count: int, flag: str) -> None:
    """Fail fast unless TCP ports ``base .. base + count - 1`` are all free on ``host``.

    Raises:
        LaunchError: a port is out of range or in use; names ``flag`` and the rank.
    """
    if base + count - 1 > 65535:
        raise LaunchError(f"{flag}={base}: needs {count} consecutive ports (one per worker rank, TP x PP) "
                          f"but {base + count - 1} > 65535; pick a lower port")
    for rank in range(count):
        label = flag if count == 1 else f"{flag} (+{rank}, rank {rank} of {count}: needs {count} free ports)"
        check_port_free(host, base + rank, label)


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA or torch)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class GpuPlan:
    """Which GPUs an engine gets.

    Attributes:
        available: CUDA devices visible to the launcher.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` for the engine (None: inherit).
    """

    available: int
    visible_devices: str | None


def parse_gpu_ids(text: str) -> list[int]:
    """``"0,1"`` → ``[0, 1]``.

    Raises:
        LaunchError: not a comma-separated list of distinct non-negative integers; names ``--gpu-ids``.
    """
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise LaunchError(f"--gpu-ids={text}: expected comma-separated GPU indices such as 0,1") from exc
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise LaunchError(f"--gpu-ids={text}: indices must be distinct and >= 0, such as 0,1")
    return ids


def plan_gpus(tensor_parallel_size: int, gpu_ids: str | None, environ: dict[str, str],
              pipeline_parallel_size: int = 1) -> GpuPlan:
    """Check TP x PP (one GPU per worker rank) against the GPUs and pick the engine's ``CUDA_VISIBLE_DEVICES``.

    ``--gpu-ids`` index the devices visible to the launcher: under an
    inherited ``CUDA_VISIBLE_DEVICES=4,5``, ``--gpu-ids 1`` gives the engine
    device 5. Without CUDA, only TP 1 is supported; pipeline stages run
    there too, one worker process each (:meth:`p2pkv.tools.deploy.engines.EngineSpec.cpu_stages`).

    Raises:
        LaunchError: TP < 1, TP x PP larger than the GPUs, ``--gpu-ids`` naming
            GPUs that do not exist; names the flag(s).
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1:
        raise LaunchError(f"--tensor-parallel-size={tp}: must be >= 1")
    available = cuda_device_count()
    ids = parse_gpu_ids(gpu_ids) if gpu_ids else None
    if ids is not None and available == 0:
        raise LaunchError(f"--gpu-ids={gpu_ids}: this machine has no CUDA device; leave --gpu-ids out")
    if ids is not None and max(ids) >= available:
        raise LaunchError(f"--gpu-ids={gpu_ids}: GPU {max(ids)} does not exist; this machine has "
                          f"{available} (indices 0..{available - 1})")
    if available == 0 and tp > 1:
        raise LaunchError(f"--tensor-parallel-size={tp}: no CUDA device here, and engines without one "
                          "run with TP 1 only; use --tensor-parallel-size 1")
    if available == 0:
        return GpuPlan(0, None)
    usable = len(ids) if ids is not None else available
    if tp * pp > usable:
        source = f"--gpu-ids={gpu_ids} names" if ids is not None else "this machine has"
        asked = f"--tensor-parallel-size={tp}" if pp == 1 else \
            f"--tensor-parallel-size={tp} x --pipeline-parallel-size={pp} = {tp * pp} GPUs"
        raise LaunchError(f"{asked}: {source} {usable} GPU(s); lower the TP or PP size"
                          + (" or list more GPUs in --gpu-ids" if ids is not None else ""))
    if ids is None:
        return GpuPlan(available, None)
    inherited = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    chosen = [inherited[i] if i < len(inherited) else str(i) for i in ids]
    return GpuPlan(available, ",".join(chosen))


def check_block_size(block_size: int, has_cuda: bool) -> None:
    """Block size > 0, and a multiple of 32 without CUDA (vLLM's CPU attention needs it).

    Raises:
        LaunchError: names ``--block-size``.
    """
    if block_size <= 0:
        raise LaunchError(f"--block-size={block_size}: must be > 0 (tokens per KV block)")
    if not has_cuda and block_size % 32:
        raise LaunchError(f"--block-size={block_size}: vLLM's CPU attention needs a multiple of 32 "
                          "without a GPU; use 32, 64 or 128")


def check_proxy_url(url: str) -> str:
    """A proxy base URL ``http(s)://host:port``, without a trailing slash.

    Raises:
        LaunchError: not an http(s) URL with a host; names ``--proxy-url``.
    """
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise LaunchError(f"--proxy-url={url}: bad port; use http://HOST:PORT") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LaunchError(f"--proxy-url={url}: expected http://HOST:PORT (the p2pkv proxy)")
    return url.rstrip("/")
