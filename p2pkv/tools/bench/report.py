"""Output of ``p2pkv bench transfer``: machine description, table, JSON, plot, target checks.

A result's ``results`` has one entry per request size: ``methods`` holds the
in-process ``memcpy`` baseline and the pull methods (``--mode pull``: the
decode side READs; ``mode`` ``"pull"``, memcpy's ``None``), ``push`` (with
``--mode push``) the push methods (the prefill side WRITEs; ``mode``
``"push"``, :func:`push_stats`), each with ``ratio_to_memcpy`` against the
same run's memcpy.

Works on the plain results dict of
:func:`p2pkv.tools.bench.transfer.run_transfer_bench`; imports nothing heavy
(matplotlib only inside :func:`plot`, torch only inside
:func:`device_info` for a GPU). Units: GB/s are 1e9 bytes/s, MiB are
2**20 bytes, times in ms or µs as named.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGETS = {
    "cross_vs_memcpy": 0.9,
    "cross_vs_per_layer": 1.5,
    "setup_ms": 50.0,
    "llama8b_4k_time_vs_memcpy": 1.15,
    "cpu_cross_vs_memcpy": 0.6,
}
"""Target thresholds: throughput ratios (×), first-request setup (ms), time ratio (×)."""

_LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 16}


def command_line(argv: Sequence[str]) -> str:
    """The command as a user would type it.

    ``p2pkv ...`` for the console script; ``python -m p2pkv.tools.bench.transfer
    ...`` when ``argv[0]`` is a module file of the p2pkv package (how
    ``python -m`` fills it in).
    """
    args = list(argv)
    if args:
        path = Path(args[0])
        parents = list(path.parts[:-1])
        if path.name == "p2pkv":
            args[0] = "p2pkv"
        elif path.suffix == ".py" and "p2pkv" in parents:
            top = len(parents) - 1 - parents[::-1].index("p2pkv")
            args[0:1] = ["python", "-m", ".".join([*parents[top:], path.stem])]
    return shlex.join(args)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _ucx_version() -> str | None:
    """UCX version of the libucp bundled with the installed NIXL wheel."""
    for mod in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(mod)
        if spec is None or spec.origin is None:
            continue
        libs = Path(spec.origin).parent.parent / f"{mod}.libs"
        for lib in sorted(libs.glob("libucp*.so*")):
            try:
                fn = ctypes.CDLL(str(lib)).ucp_get_version_string
                fn.restype = ctypes.c_char_p
                return fn().decode()
            except (OSError, AttributeError):
                continue
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def summarize(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50 / p99 / mean / min / max of ``xs`` times ``scale`` (e.g. 1e3: seconds → ms).

    Percentiles interpolate linearly between samples (numpy's default), so
    with few samples p99 is close to the max.
    """
    import numpy as np

    a = np.asarray(xs, dtype=np.float64) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean()),
            "min": float(a.min()), "max": float(a.max())}


def counts(xs: Sequence[int]) -> dict[str, Any]:
    """mean / min / max of per-request counts, plus ``all`` of them."""
    return {"mean": sum(xs) / len(xs), "min": int(min(xs)), "max": int(max(xs)), "all": [int(x) for x in xs]}


def method_stats(label: str, nbytes: int, pull_s: Sequence[float], plan_s: Sequence[float],
                 descs: Sequence[int], warmup_s: float, verified: bool | None) -> dict[str, Any]:
    """Results of one method at one request size.

    Args:
        label: what the method is.
        nbytes: bytes per request.
        pull_s: seconds of each timed request.
        plan_s: seconds of each request's descriptor planning.
        descs: descriptors (memcpy: copies) of each request.
        warmup_s: seconds of the untimed warm-up/verified pull.
        verified: its bytes equal the source (None: not checked).

    Returns:
        ``gbps`` (1e9 B/s over all timed requests), ``gbps_best`` (of the
        fastest request: least disturbed by other load), ``latency_ms`` and
        ``plan_us`` summaries, ``descriptors_per_request`` counts, totals.
    """
    return {"label": label, "requests": len(pull_s), "bytes_per_request": nbytes,
            "bytes_total": nbytes * len(pull_s), "seconds_total": float(sum(pull_s)),
            "gbps": nbytes * len(pull_s) / sum(pull_s) / 1e9, "gbps_best": nbytes / min(pull_s) / 1e9,
            "descriptors_per_request": counts(descs),
            "latency_ms": summarize(pull_s, 1e3), "plan_us": summarize(plan_s, 1e6),
            "warmup_pull_ms": warmup_s * 1e3, "verified": verified}


def push_stats(label: str, nbytes: int, push_s: Sequence[float], writer_s: Sequence[float],
               plan_s: Sequence[float], descs: Sequence[int], warmup_s: float, warmup_writer_s: float,
               verified: bool | None) -> dict[str, Any]:
    """Results of one method pushed at one request size: :func:`method_stats` of the times the decode
    side saw, plus the writer's.

    Args:
        label: what the method is.
        nbytes: bytes per request.
        push_s: seconds of each timed request on the decode side, from its ask to the WRITE's notification.
        writer_s: seconds of each timed request's WRITE on the prefill side (post -> DONE).
        plan_s: seconds of each request's descriptor planning (on the prefill side).
        descs: descriptors of each request.
        warmup_s / warmup_writer_s: the untimed warm-up/verified push, as ``push_s`` / ``writer_s``.
        verified: its bytes equal the source (None: not checked).

    Returns:
        :func:`method_stats` keys (``gbps``, ``latency_ms``, ... of ``push_s``; ``warmup_push_ms`` in
        place of ``warmup_pull_ms``), ``mode`` ``"push"``, ``writer_xfer_ms`` (summary),
        ``writer_gbps`` (1e9 B/s over all timed WRITEs), ``ask_and_notify_ms`` (summary of each
        request's decode-side time minus its writer time: the ask's and the notification's way, and the
        polling on both sides) and ``warmup_writer_ms``.
    """
    out = method_stats(label, nbytes, push_s, plan_s, descs, warmup_s, verified)
    out["warmup_push_ms"] = out.pop("warmup_pull_ms")
    out.update(mode="push", writer_xfer_ms=summarize(writer_s, 1e3),
               writer_gbps=nbytes * len(writer_s) / sum(writer_s) / 1e9,
               ask_and_notify_ms=summarize([p - w for p, w in zip(push_s, writer_s, strict=True)], 1e3),
               warmup_writer_ms=warmup_writer_s * 1e3)
    return out


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes; Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
        cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                    if line.startswith("model name")), platform.processor() or None)
        return {"type": "cpu", "name": cpu, "nixl_mem_type": "DRAM"}
    import torch

    idx = int(index) if index else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    driver = next((w for w in _read("/proc/driver/nvidia/version").split() if w[:1].isdigit() and "." in w), None)
    return {"type": "cuda", "name": torch.cuda.get_device_name(idx), "index": idx, "nixl_mem_type": "VRAM",
            "total_memory_bytes": int(props.total_memory), "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": int(props.multi_processor_count), "cuda_runtime": torch.version.cuda,
            "driver": driver}


def device_text(result: dict[str, Any]) -> str:
    """One-line description of where a result's caches lived, e.g. ``cuda:0 NVIDIA H100 80GB HBM3 (VRAM)``."""
    dev = result.get("machine", {}).get("device") or {"type": "cpu", "nixl_mem_type": "DRAM"}
    if dev["type"] != "cuda":
        return "cpu (host memory, NIXL DRAM)"
    return f"cuda:{dev['index']} {dev['name']} (GPU memory, NIXL VRAM)"


def machine_info(device: str | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM (bytes), kernel and library versions of this machine.

    Args:
        device: with a torch device string (``"cpu"``, ``"cuda:0"``), also
            ``device``: :func:`device_info` of it.
    """
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or None)
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    versions = {name: _version(name) for name in ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12")}
    versions["ucx"] = _ucx_version()
    info: dict[str, Any] = {
        "cpu_model": cpu,
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


def _method(result: dict[str, Any], tokens: int, method: str) -> dict[str, Any] | None:
    for entry in result["results"]:
        if entry["tokens"] == tokens:
            return entry["methods"].get(method)
    return None


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the measured numbers against :data:`TARGETS`.

    Returns:
        One dict per target: ``name``, ``target`` (text), ``measured``
        (numbers per token size or per peer) and ``met`` (bool, or None when
        this run could not measure it).
    """
    rows = result["results"]
    pulled = bool(rows) and all("cross_layer" in e["methods"] and "per_layer" in e["methods"] for e in rows)
    out: list[dict[str, Any]] = []
    cross_mem = {e["tokens"]: e["methods"]["cross_layer"]["ratio_to_memcpy"] for e in rows} if pulled else None
    out.append({"name": "cross_layer_vs_memcpy", "target": ">= 0.9x memcpy GB/s for 1k-32k tokens",
                "measured": cross_mem,
                "met": all(v >= TARGETS["cross_vs_memcpy"] for v in cross_mem.values()) if cross_mem else None})
    cross_pl = ({e["tokens"]: e["methods"]["cross_layer"]["gbps"] / e["methods"]["per_layer"]["gbps"] for e in rows}
                if pulled else None)
    out.append({"name": "cross_layer_vs_per_layer", "target": ">= 1.5x per-layer (NixlConnector scheme) GB/s",
                "measured": cross_pl,
                "met": all(v >= TARGETS["cross_vs_per_layer"] for v in cross_pl.values()) if cross_pl else None})
    desc = {e["tokens"]: {"descriptors": e["methods"]["cross_layer"]["descriptors_per_request"]["mean"],
                          "runs": e["runs_per_request"]["mean"]} for e in rows} if pulled else None
    desc_ok = all(d <= r for e in rows for d, r in zip(e["methods"]["cross_layer"]["descriptors_per_request"]["all"],
                                                       e["runs_per_request"]["all"], strict=True)) if pulled else None
    out.append({"name": "descriptors_le_runs", "target": "cross-layer descriptors per request <= contiguous block runs",
                "measured": desc, "met": desc_ok})
    setup = {k: v["setup_ms"] for k, v in result["setup"]["peers"].items()}
    out.append({"name": "first_request_setup_ms", "target": "handshake + add_remote_agent < 50 ms",
                "measured": setup, "met": max(setup.values()) < TARGETS["setup_ms"]})
    cross, mem = _method(result, 4096, "cross_layer"), _method(result, 4096, "memcpy")
    if result["config"]["shape"] == _LLAMA3_8B and cross is not None and mem is not None:
        ratio = cross["seconds_total"] / mem["seconds_total"]
        measured: Any = {"time_ratio_mean": ratio,
                         "time_ratio_p50": cross["latency_ms"]["p50"] / mem["latency_ms"]["p50"],
                         "cross_layer_p50_ms": cross["latency_ms"]["p50"], "memcpy_p50_ms": mem["latency_ms"]["p50"]}
        met: bool | None = ratio <= TARGETS["llama8b_4k_time_vs_memcpy"]
    else:
        measured, met = None, None
    out.append({"name": "llama3_8b_4k_pull_vs_memcpy",
                "target": "4k-token Llama-3-8B pull (512 MiB) <= 1.15x memcpy time", "measured": measured, "met": met})
    out.append(_ceiling_target(rows))
    return out


def _ceiling_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Host memory at 4k and 16k tokens: p2pkv's cross-layer pulls (the better of ``cross_layer`` and
    ``cross_layer_pool``) >= 0.6x memcpy, or this host's ceiling for a copy between two processes (the
    best ``readv`` method, same run) is itself below 0.6x memcpy."""
    measured: dict[int, dict[str, float]] = {}
    for e in rows:
        ceil = [m["ratio_to_memcpy"] for k, m in e["methods"].items() if k.startswith("readv")]
        if e["tokens"] in (4096, 16384) and ceil:
            ms = e["methods"]
            best = max(ms[k]["ratio_to_memcpy"] for k in ("cross_layer", "cross_layer_pool") if k in ms)
            measured[e["tokens"]] = {"cross_layer": ms["cross_layer"]["ratio_to_memcpy"], "best_p2pkv": best,
                                     "readv_ceiling": max(ceil), "best_vs_ceiling": best / max(ceil)}
            if "cross_layer_pool" in ms:
                measured[e["tokens"]]["cross_layer_pool"] = ms["cross_layer_pool"]["ratio_to_memcpy"]
    limit = TARGETS["cpu_cross_vs_memcpy"]
    met = (all(v["best_p2pkv"] >= limit or v["readv_ceiling"] < limit for v in measured.values())
           if len(measured) == 2 else None)
    return {"name": "cpu_cross_layer_vs_memcpy_or_ceiling",
            "target": ">= 0.6x memcpy GB/s at 4k and 16k tokens, or the host's process_vm_readv ceiling is lower",
            "measured": measured or None, "met": met}


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    fmt = [f"{h:>{w}}" for h, w in zip(header, widths, strict=True)]
    body = ["  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(["  ".join(fmt), line, *body])


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report: configuration, one row per size and method, setup, targets."""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"p2pkv bench transfer on {device_text(result)}: {cfg['shape_label']}",
        f"  {cfg['requests']} requests per size, fragmentation (max run) {cfg['fragmentation']}, "
        f"{cfg['num_blocks']} blocks per cache ({cfg['cache_bytes'] / 2**30:.2f} GiB), "
        f"progress thread {'on' if cfg['progress_thread'] else 'off'}, torch threads {cfg['torch_threads']}",
        f"  {mach['cpu_model']}, {mach['usable_cpus']} cores, {mach['mem_total_bytes'] / 2**30:.1f} GiB RAM; "
        + ", ".join(f"{k} {v}" for k, v in mach["versions"].items()),
    ]
    dev = mach.get("device") or {}
    if dev.get("type") == "cuda":
        lines.append(f"  GPU {dev['name']}: {dev['total_memory_bytes'] / 2**30:.1f} GiB, compute capability "
                     f"{dev['compute_capability']}, {dev['multiprocessors']} SMs, CUDA {dev['cuda_runtime']}, "
                     f"driver {dev.get('driver') or '?'}; both processes' caches on this GPU")
    lines.append("")
    header = ["tokens", "MiB/req", "method", "GB/s", "x memcpy", "best GB/s", "desc/req", "runs/req", "p50 ms",
              "p99 ms", "plan us", "bytes ok"]
    rows = []
    for e in result["results"]:
        for name, m in e["methods"].items():
            ok = {True: "yes", False: "NO", None: "-"}[m["verified"]]
            rows.append([str(e["tokens"]), f"{e['bytes_per_request'] / 2**20:.0f}", name, f"{m['gbps']:.2f}",
                         f"{m['ratio_to_memcpy']:.2f}", f"{m['gbps_best']:.2f}",
                         f"{m['descriptors_per_request']['mean']:.1f}",
                         f"{e['runs_per_request']['mean']:.1f}", f"{m['latency_ms']['p50']:.2f}",
                         f"{m['latency_ms']['p99']:.2f}", f"{m['plan_us']['p50']:.0f}", ok])
    lines.append(_grid(header, rows))
    if any("push" in e for e in result["results"]):
        lines += ["", "pull vs push (x memcpy: GB/s / the same run's memcpy GB/s; push timed on the decode side "
                      "from its ask to the WRITE's notification; writer: the prefill's post -> DONE; ask+notify: "
                      "push minus writer, per request):",
                  _mode_table(result)]
    lines.append("")
    lines.append(f"setup (decode register {result['setup']['decode_register_ms']:.1f} ms):")
    for peer, s in result["setup"]["peers"].items():
        lines.append(f"  {peer} peer: handshake {s['handshake_ms']:.2f} ms + add_remote_agent "
                     f"{s['add_remote_agent_ms']:.2f} ms = {s['setup_ms']:.2f} ms; first pull "
                     f"{s.get('first_pull_ms', float('nan')):.2f} ms; prefill register "
                     f"{s['prefill_register_ms']:.1f} ms")
    if "push_add_remote_agent_ms" in result["setup"]:
        lines.append("  push: prefill add_remote_agent of the decode " + ", ".join(
            f"{lay} {ms:.2f} ms" for lay, ms in result["setup"]["push_add_remote_agent_ms"].items()))
    lines.append("")
    lines.append("targets:")
    for t in result["targets"]:
        mark = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: {_fmt_measured(t['measured'])}")
    for w in result.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _mode_table(result: dict[str, Any]) -> str:
    """One row per size and pushed method, a GB/s and an x-memcpy column per mode (``-``: not measured)."""
    header = ["tokens", "MiB/req", "method", "memcpy GB/s", "pull GB/s", "pull x memcpy", "push GB/s",
              "push x memcpy", "pull p50 ms", "push p50 ms", "writer p50 ms", "ask+notify p50 ms",
              "bytes ok pull/push"]
    ok = {True: "yes", False: "NO", None: "-"}
    rows = []
    for e in result["results"]:
        for name, push in e.get("push", {}).items():
            pull = e["methods"].get(name)
            rows.append([str(e["tokens"]), f"{e['bytes_per_request'] / 2**20:.0f}", name,
                         f"{e['methods']['memcpy']['gbps']:.2f}",
                         f"{pull['gbps']:.2f}" if pull else "-", f"{pull['ratio_to_memcpy']:.2f}" if pull else "-",
                         f"{push['gbps']:.2f}", f"{push['ratio_to_memcpy']:.2f}",
                         f"{pull['latency_ms']['p50']:.2f}" if pull else "-", f"{push['latency_ms']['p50']:.2f}",
                         f"{push['writer_xfer_ms']['p50']:.2f}", f"{push['ask_and_notify_ms']['p50']:.2f}",
                         f"{ok[pull['verified']] if pull else '-'}/{ok[push['verified']]}"])
    return _grid(header, rows)


def _fmt_measured(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt_measured(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the results as indented JSON (creates the parent folder)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Plot GB/s, p50 latency (ms) and descriptors per request per size and method, pushes (hatched)
    next to pulls; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("p2pkv bench: matplotlib is not installed (pip install 'p2pkv[bench]'); no plot", file=sys.stderr)
        return False
    entries = result["results"]
    pushed = list(entries[0].get("push", {})) if entries else []
    series = []  # each push next to the pull of the same method
    for name in [*result["methods"], *(m for m in pushed if m not in result["methods"])]:
        series += [(name, "methods", name, "")] if name in result["methods"] else []
        series += [(f"{name} push", "push", name, "//")] if name in pushed else []
    x = list(range(len(entries)))
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 3, figsize=(15 + 2 * bool(pushed), 4.5))
    panels = [("GB/s (1e9 B/s)", lambda m: m["gbps"], False),
              ("p50 latency (ms)" if pushed else "p50 pull latency (ms)", lambda m: m["latency_ms"]["p50"], True),
              ("descriptors per request", lambda m: max(m["descriptors_per_request"]["mean"], 1), True)]
    colors = {name: f"C{i}" for i, name in enumerate(result["methods"])}
    for ax, (title, get, log) in zip(axes, panels, strict=True):
        for i, (label, group, name, hatch) in enumerate(series):
            ax.bar([v + (i - (len(series) - 1) / 2) * width for v in x], [get(e[group][name]) for e in entries],
                   width, label=label, color=colors.get(name), hatch=hatch, edgecolor="white" if hatch else None)
        ax.set_xticks(x, [f"{e['tokens']} tok\n{e['bytes_per_request'] / 2**20:.0f} MiB" for e in entries])
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    rows = -(-len(series) // 6)  # legend below the panels, 6 entries per row
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(series), 6), fontsize=8)
    dev = result["machine"].get("device") or {}
    where = (f"{dev['name']} GPU memory" if dev.get("type") == "cuda"
             else f"{result['machine']['cpu_model']}, {result['machine']['usable_cpus']} cores")
    modes = "pull and push (hatched: the prefill WRITEs)" if pushed and result["results"][0]["methods"].get(
        "cross_layer") else "push (hatched: the prefill WRITEs)" if pushed else "pull"
    fig.suptitle(f"p2pkv bench transfer, {modes}: {result['config']['shape_label']} ({where})", fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
