"""Output of ``scripts/bench_transfer.py``: per-method statistics, table, plot.

A result's ``results`` has one entry per request size: ``methods`` holds the
in-process ``memcpy`` baseline and the pull methods (``--mode pull``: the
decode side READs; ``mode`` ``"pull"``, memcpy's ``None``), ``push`` (with
``--mode push``) the push methods (the prefill side WRITEs; ``mode``
``"push"``, :func:`push_stats`), each with ``ratio_to_memcpy`` against the
same run's memcpy.

Works on the plain results dict of
``bench_transfer.run_transfer_bench`` (its ``machine`` and
``command``: :mod:`p2pkv.tools.bench.machine`); imports nothing heavy
(matplotlib only inside :func:`plot`, through :mod:`p2pkv.tools.bench.plotting`).
The JSON file: :func:`p2pkv.tools.bench.results.write_json`. Units: GB/s are 1e9
bytes/s, MiB are 2**20 bytes, times in ms or µs as named.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from p2pkv.tools.bench import plotting
from p2pkv.tools.bench.results import summarize
from p2pkv.tools.bench.table import grid, yes_no


def device_text(result: dict[str, Any]) -> str:
    """One-line description of where a result's caches lived, e.g. ``cuda:0 NVIDIA H100 80GB HBM3 (VRAM)``.

    Args:
        result: a bench result with a ``machine`` (:func:`p2pkv.tools.bench.machine.machine_info`), its
            ``device`` optional (CPU then).
    """
    dev = result.get("machine", {}).get("device") or {"type": "cpu", "nixl_mem_type": "DRAM"}
    if dev["type"] != "cuda":
        return "cpu (host memory, NIXL DRAM)"
    return f"cuda:{dev['index']} {dev['name']} (GPU memory, NIXL VRAM)"


def counts(xs: Sequence[int]) -> dict[str, Any]:
    """mean / min / max of per-request counts, plus ``all`` of them."""
    return {"mean": sum(xs) / len(xs), "min": int(min(xs)), "max": int(max(xs)), "all": [int(x) for x in xs]}


def method_stats(nbytes: int, pull_s: Sequence[float], plan_s: Sequence[float], descs: Sequence[int],
                 verified: bool | None) -> dict[str, Any]:
    """Results of one method at one request size.

    Args:
        nbytes: bytes per request.
        pull_s: seconds of each timed request.
        plan_s: seconds of each request's descriptor planning.
        descs: descriptors (memcpy: copies) of each request.
        verified: the untimed warm-up's bytes equal the source (None: not checked).

    Returns:
        ``gbps`` (1e9 B/s over all timed requests), ``gbps_best`` (of the
        fastest request: least disturbed by other load), ``latency_ms`` and
        ``plan_us`` summaries, ``descriptors_per_request`` counts, totals.
    """
    return {"requests": len(pull_s), "bytes_per_request": nbytes,
            "bytes_total": nbytes * len(pull_s), "seconds_total": float(sum(pull_s)),
            "gbps": nbytes * len(pull_s) / sum(pull_s) / 1e9, "gbps_best": nbytes / min(pull_s) / 1e9,
            "descriptors_per_request": counts(descs),
            "latency_ms": summarize(pull_s, 1e3), "plan_us": summarize(plan_s, 1e6), "verified": verified}


def push_stats(nbytes: int, push_s: Sequence[float], writer_s: Sequence[float], plan_s: Sequence[float],
               descs: Sequence[int], verified: bool | None) -> dict[str, Any]:
    """Results of one method pushed at one request size: :func:`method_stats` of the times the decode
    side saw, plus the writer's.

    Args:
        nbytes: bytes per request.
        push_s: seconds of each timed request on the decode side, from its ask to the WRITE's notification.
        writer_s: seconds of each timed request's WRITE on the prefill side (post -> DONE).
        plan_s: seconds of each request's descriptor planning (on the prefill side).
        descs: descriptors of each request.
        verified: the untimed warm-up's bytes equal the source (None: not checked).

    Returns:
        :func:`method_stats` keys (``gbps``, ``latency_ms``, ... of ``push_s``), ``mode`` ``"push"``,
        ``writer_xfer_ms`` (summary) and ``ask_and_notify_ms`` (summary of each request's decode-side
        time minus its writer time: the ask's and the notification's way, and the polling on both sides).
    """
    return {**method_stats(nbytes, push_s, plan_s, descs, verified), "mode": "push",
            "writer_xfer_ms": summarize(writer_s, 1e3),
            "ask_and_notify_ms": summarize([p - w for p, w in zip(push_s, writer_s, strict=True)], 1e3)}


def stream_stats(samples: dict[str, list[dict[str, float]]], verified: dict[str, bool | None],
                 num_layers: int) -> dict[str, Any]:
    """Results of stream mode at one request size, per ``<method>/<way>``.

    Args:
        samples: ``<method>/<way>`` → each timed request's
            :func:`transfer_bench.stream.timed_stream` times (seconds).
        verified: the untimed warm-up's bytes equal the source (None: not checked).
        num_layers: layers of the model shape.

    Returns:
        Per name: ``wait_after_last_layer_ms``, ``total_ms`` and ``compute_ms``
        summaries, ``writes`` and ``descriptors_per_request`` counts,
        ``verified``; for ``stream`` ways also ``layer_transfer_ms`` (the
        same method's bulk wait p50 / ``num_layers``: one layer's transfer)
        and ``wait_in_layer_transfers`` (the stream's wait p50 over it).
    """
    out: dict[str, Any] = {}
    for name, runs in samples.items():
        out[name] = {"requests": len(runs), "verified": verified[name],
                     "wait_after_last_layer_ms": summarize([r["wait_s"] for r in runs], 1e3),
                     "total_ms": summarize([r["total_s"] for r in runs], 1e3),
                     "compute_ms": summarize([r["compute_s"] for r in runs], 1e3),
                     "writes": counts([int(r["writes"]) for r in runs]),
                     "descriptors_per_request": counts([int(r["descs"]) for r in runs])}
    for name, res in out.items():
        method, way = name.split("/")
        bulk = out.get(f"{method}/bulk")
        if way == "stream" and bulk is not None:
            res["layer_transfer_ms"] = bulk["wait_after_last_layer_ms"]["p50"] / num_layers
            res["wait_in_layer_transfers"] = res["wait_after_last_layer_ms"]["p50"] / res["layer_transfer_ms"]
    return out


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report: configuration, one row per size and method, setup."""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"bench transfer on {device_text(result)}: {cfg['shape_label']}",
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
            rows.append([str(e["tokens"]), f"{e['bytes_per_request'] / 2**20:.0f}", name, f"{m['gbps']:.2f}",
                         f"{m['ratio_to_memcpy']:.2f}", f"{m['gbps_best']:.2f}",
                         f"{m['descriptors_per_request']['mean']:.1f}",
                         f"{e['runs_per_request']['mean']:.1f}", f"{m['latency_ms']['p50']:.2f}",
                         f"{m['latency_ms']['p99']:.2f}", f"{m['plan_us']['p50']:.0f}", yes_no(m["verified"])])
    lines.append(grid(header, rows))
    if any("push" in e for e in result["results"]):
        lines += ["", "pull vs push (x memcpy: GB/s / the same run's memcpy GB/s; push timed on the decode side "
                      "from its ask to the WRITE's notification; writer: the prefill's post -> DONE; ask+notify: "
                      "push minus writer, per request):",
                  _mode_table(result)]
    if any("stream" in e for e in result["results"]):
        per_layer = (f"{result['config']['layer_ms']:g} ms" if result["config"]["layer_ms"] > 0
                     else "a Llama-3-8B layer's GEMM")
        lines += ["", f"stream vs bulk push ({per_layer} per layer of a stand-in forward; "
                      "wait: the notification's arrival minus the last layer's end; one layer: the bulk wait / "
                      "layers):", _stream_table(result)]
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
    for w in result.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _stream_table(result: dict[str, Any]) -> str:
    """One row per size, method and way of stream mode."""
    header = ["tokens", "MiB/req", "method/way", "compute p50 ms", "wait p50 ms", "wait p90 ms", "total p50 ms",
              "one layer ms", "wait / one layer", "writes", "desc/req", "bytes ok"]
    rows = []
    for e in result["results"]:
        for name, r in e.get("stream", {}).items():
            w = r["wait_after_last_layer_ms"]
            rows.append([str(e["tokens"]), f"{e['bytes_per_request'] / 2**20:.0f}", name,
                         f"{r['compute_ms']['p50']:.2f}", f"{w['p50']:.3f}", f"{w['p90']:.3f}",
                         f"{r['total_ms']['p50']:.2f}",
                         f"{r['layer_transfer_ms']:.3f}" if "layer_transfer_ms" in r else "-",
                         f"{r['wait_in_layer_transfers']:.2f}" if "wait_in_layer_transfers" in r else "-",
                         f"{r['writes']['mean']:.0f}", f"{r['descriptors_per_request']['mean']:.0f}",
                         yes_no(r["verified"])])
    return grid(header, rows)


def _mode_table(result: dict[str, Any]) -> str:
    """One row per size and pushed method, a GB/s and an x-memcpy column per mode (``-``: not measured)."""
    header = ["tokens", "MiB/req", "method", "memcpy GB/s", "pull GB/s", "pull x memcpy", "push GB/s",
              "push x memcpy", "pull p50 ms", "push p50 ms", "writer p50 ms", "ask+notify p50 ms",
              "bytes ok pull/push"]
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
                         f"{yes_no(pull['verified']) if pull else '-'}/{yes_no(push['verified'])}"])
    return grid(header, rows)


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Plot GB/s, p50 latency (ms) and descriptors per request per size and method, pushes (hatched)
    next to pulls (stream mode: :func:`_plot_stream`); False without matplotlib."""
    plt = plotting.pyplot("p2pkv bench")
    if plt is None:
        return False
    entries = result["results"]
    if entries and "stream" in entries[0]:
        return _plot_stream(plt, result, path)
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
    fig.suptitle(f"bench transfer, {modes}: {result['config']['shape_label']} ({where})", fontsize=10)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    plotting.save(fig, path)
    return True


def _plot_stream(plt: Any, result: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Stream mode: per size, each method/way's wait after the last layer and its total time (p50, ms), the
    forward's own time marked on the second panel."""
    entries = result["results"]
    names = list(entries[0]["stream"])
    x = list(range(len(entries)))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = [("wait after the last layer, p50 (ms)", "wait_after_last_layer_ms"), ("ask to notification, p50 (ms)",
                                                                                  "total_ms")]
    for ax, (title, key) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            ax.bar([v + (i - (len(names) - 1) / 2) * width for v in x],
                   [e["stream"][name][key]["p50"] for e in entries], width, label=name, color=f"C{i // 2}",
                   hatch="" if name.endswith("/stream") else "//", edgecolor="white")
        ax.set_xticks(x, [f"{e['tokens']} tok\n{e['bytes_per_request'] / 2**20:.0f} MiB" for e in entries])
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[1].plot(x, [e["stream"][names[0]]["compute_ms"]["p50"] for e in entries], "k_", markersize=30,
                 label="the forward alone (p50)")
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=len(names) + 1, fontsize=8)
    dev = result["machine"].get("device") or {}
    where = (f"{dev['name']} GPU memory" if dev.get("type") == "cuda"
             else f"{result['machine']['cpu_model']}, {result['machine']['usable_cpus']} cores")
    per_layer = (f"{result['config']['layer_ms']:g} ms" if result["config"]["layer_ms"] > 0
                 else "a Llama-3-8B layer's GEMM")
    fig.suptitle(f"bench transfer, stream (plain) vs bulk (hatched), {per_layer} per layer, poster "
                 f"{result['config'].get('poster', 'thread')}\n{result['config']['shape_label']} ({where})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plotting.save(fig, path)
    return True
