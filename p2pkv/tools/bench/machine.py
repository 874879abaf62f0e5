"""Where and how a ``p2pkv bench`` run ran: its command line, the host, the device, library versions.

Every bench records these next to its numbers (the JSON's ``command`` and
``machine``), so that a result says what produced it. Standard library only
(torch inside :func:`device_info` for a GPU; the UCX version read from the
library bundled with the NIXL wheel). Units: bytes for memory sizes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.dataplane.transport import ucx_version


def command_line(argv: Sequence[str]) -> str:
    """The command as a user would type it (shell-quoted).

    ``p2pkv ...`` for the console script; ``python -m p2pkv.tools.bench.serve
    ...`` when ``argv[0]`` is a module file of the p2pkv package (how
    ``python -m`` fills it in); ``python scripts/<name>.py ...`` for a script
    of the checkout's ``scripts/`` folder; anything else as it is.
    """
    args = list(argv)
    if args:
        path = Path(args[0])
        parents = list(path.parts[:-1])
        if path.name == "p2pkv":
            args[0] = "p2pkv"
        elif path.suffix == ".py" and parents[-1:] == ["scripts"]:
            args[0:1] = ["python", f"scripts/{path.name}"]
        elif path.suffix == ".py" and "p2pkv" in parents:
            top = len(parents) - 1 - parents[::-1].index("p2pkv")
            args[0:1] = ["python", "-m", ".".join([*parents[top:], path.stem])]
    return shlex.join(args)


def _read(path: str) -> str:
    """A text file's content, or "" when it cannot be read (e.g. ``/proc`` off Linux)."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (else :func:`platform.processor`, else None)."""
    return next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                 if line.startswith("model name")), platform.processor() or None)


def version(*dists: str) -> str | None:
    """The installed version of the first of the distributions ``dists`` that is installed, else None."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def device_info(device: str) -> dict[str, Any]:
    """What holds the KV caches: ``type`` (``cpu``/``cuda``), ``name`` and, for a GPU, its details.

    Args:
        device: torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.

    Returns:
        ``type``, ``name`` (CPU model, or ``torch.cuda.get_device_name``),
        ``nixl_mem_type``; for a GPU also ``index``, ``total_memory_bytes``,
        ``compute_capability``, ``multiprocessors``, ``cuda_runtime`` (torch's
        CUDA version) and ``driver`` (NVIDIA kernel driver, when readable).
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return {"type": "cpu", "name": _cpu_model(), "nixl_mem_type": "DRAM"}
    import torch

    idx = int(index) if index else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    driver = next((w for w in _read("/proc/driver/nvidia/version").split() if w[:1].isdigit() and "." in w), None)
    return {"type": "cuda", "name": torch.cuda.get_device_name(idx), "index": idx, "nixl_mem_type": "VRAM",
            "total_memory_bytes": int(props.total_memory), "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": int(props.multi_processor_count), "cuda_runtime": torch.version.cuda,
            "driver": driver}


def machine_info(device: str | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM (bytes), kernel and library versions of this machine.

    Args:
        device: with a torch device string (``"cpu"``, ``"cuda:0"``), also
            ``device``: :func:`device_info` of it.

    Returns:
        ``cpu_model``, ``logical_cpus``, ``usable_cpus`` (this process's
        affinity), ``mem_total_bytes``, ``kernel``, ``python`` and
        ``versions`` (torch, numpy, the NIXL wheels, UCX: those installed).
    """
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    versions = {name: version(name) for name in ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12")}
    versions["ucx"] = ucx_version()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_bytes": mem_kib * 1024,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {k: v for k, v in versions.items() if v is not None},
    }
    if device is not None:
        info["device"] = device_info(device)
    return info
