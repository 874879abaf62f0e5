"""Pure parts of ``p2pkv bench serve``: the answer checks, the terminal report and the plot.

They work on the run's JSON document (see :mod:`p2pkv.tools.bench.serve`):
per system, one point per concurrency, each vLLM's own ``bench serve``
result dict (its keys, e.g. ``median_ttft_ms``, ``output_throughput``) with
p2pkv's numbers under ``p2pkv``. matplotlib only inside :func:`plot`.
Units: latencies in ms, throughput in requests/s and output tokens/s,
transfer sizes in bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover, plotting
from p2pkv.tools.bench.table import grid, number


class AnswerMismatch(Exception):
    """Two systems answered one prompt differently; the message names which, where and how."""


def answers_digest(texts: Sequence[str]) -> str:
    """SHA-256 over a point's generated texts, in request order (to compare runs without storing texts)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", errors="surrogatepass") + b"\x00")
    return h.hexdigest()


def request_errors(system: str, concurrency: int, result: Mapping[str, Any]) -> str | None:
    """A message when a point's requests (vLLM's result dict) did not all succeed, else None."""
    errors = [e for e in result.get("errors") or [] if e]
    failed = int(result.get("failed", 0))
    if not failed and not errors:
        return None
    first = (errors[0] if errors else "no error text").strip().splitlines()
    return (f"{system} at concurrency {concurrency}: {failed or len(errors)} of "
            f"{int(result.get('completed', 0)) + failed} requests failed; first error: {first[-1] if first else ''}")


def first_difference(answers: Mapping[str, Sequence[Any]]) -> tuple[int, str, str] | None:
    """``(prompt index, reference system, differing system)`` of the first prompt on which a system's answer
    differs from the first system's (a missing answer differs), or None when all are equal.

    Args:
        answers: system → answers in prompt order (texts or token-id lists).
    """
    names = list(answers)
    n = max((len(a) for a in answers.values()), default=0)
    for i in range(n if len(names) > 1 else 0):
        for other in names[1:]:
            a, b = answers[names[0]], answers[other]
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                return i, names[0], other
    return None


def check_answers(points: Mapping[int, Mapping[str, Sequence[Any]]], what: str = "generated text",
                  prompts: Mapping[int, Sequence[str]] | None = None) -> dict[str, Any]:
    """Compare every system's answer to every prompt, point by point (the aggregated engine, when run, is
    the reference).

    Args:
        points: concurrency → (system → answers in prompt order).
        what: what the answers are, for the message ("generated text", "token ids").
        prompts: concurrency → prompts, to quote the differing one.

    Returns:
        ``passed`` (True), ``compared`` (answers compared), ``systems``.

    Raises:
        AnswerMismatch: naming the concurrency, the prompt, the two systems, where and how they differ.
    """
    compared, systems = 0, set()
    for conc, answers in points.items():
        systems.update(answers)
        if "aggregated" in answers:
            answers = {"aggregated": answers["aggregated"], **answers}
        if (diff := first_difference(answers)) is not None:
            i, ref, other = diff
            a = answers[ref][i] if i < len(answers[ref]) else "<missing>"
            b = answers[other][i] if i < len(answers[other]) else "<missing>"
            same = [s for s in answers if s not in (ref, other) and i < len(answers[s]) and answers[s][i] == a]
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            quoted = f" {prompts[conc][i][:60]!r}" if prompts and i < len(prompts.get(conc, ())) else ""
            raise AnswerMismatch(
                f"{what} differs at concurrency {conc}, prompt #{i}{quoted}: {other} differs from {ref} from "
                f"position {at} on: {ref} gave ...{_short(a[at:])}, {other} gave ...{_short(b[at:])}"
                + (f"; {', '.join(same)} gave {ref}'s answer" if same else ""))
        compared += sum(len(a) for a in answers.values())
    return {"passed": True, "compared": compared, "systems": sorted(systems)}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _get(d: Mapping[str, Any] | None, *keys: str) -> Any:
    """``d[k0][k1]...``, None where a level is missing or None."""
    for k in keys:
        d = d.get(k) if isinstance(d, Mapping) else None
    return d


def directions(p: Mapping[str, Any]) -> str:
    """A point's transfers by direction (``"pull 6 push 2"``), ``-`` where not exported."""
    return " ".join(f"{d} {n}" for d, n in sorted((_get(p, "p2pkv", "transfers", "directions") or {}).items())) or "-"


def point_line(name: str, p: Mapping[str, Any]) -> str:
    """One progress line for a finished point (ms, req/s, tok/s)."""
    x = p["p2pkv"]
    tr = f", transfers {x['transfers']['count']} x {number(x['transfers']['mean_ms'], '.2f')} ms " \
         f"({directions(p)})" if x.get("transfers") else ""
    legs = f", prefill legs mean {number(_get(x, 'prefill', 'legs', 'mean_ms'))} ms" if x.get("prefill") else ""
    probe = _get(x, "prefill", "probe")
    probe_txt = f", probe TPOT p50 {number(probe['tpot_p50_ms'], '.2f')} ms" if probe else ""
    return (f"[{name}] c={p['max_concurrency']}: {p['completed']}/{p['num_prompts']} ok in {p['duration']:.1f} s, "
            f"TTFT p50 {number(p.get('median_ttft_ms'))} p99 {number(p.get('p99_ttft_ms'))} ms, TPOT p50 "
            f"{number(p.get('median_tpot_ms'), '.2f')} ms, {p['output_throughput']:.1f} tok/s{tr}{legs}{probe_txt}")


def _rows(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(name, p) for name, s in doc["systems"].items() for p in s["points"]]


def ratio_lines(doc: Mapping[str, Any], system: str = "p2pkv-push", base: str = "p2pkv-pull") -> list[str]:
    """``system / base`` per concurrency, both measured in the same run (latency below 1, tok/s above 1 is
    better): TTFT p50, TPOT p50, output tok/s, prefill legs' mean, probe TTFT and TPOT p50; empty when
    either system did not run."""
    keys = (("median_ttft_ms",), ("median_tpot_ms",), ("output_throughput",), ("p2pkv", "prefill", "legs", "mean_ms"),
            ("p2pkv", "prefill", "probe", "ttft_p50_ms"), ("p2pkv", "prefill", "probe", "tpot_p50_ms"))
    pts = {n: {p["max_concurrency"]: p for p in doc["systems"].get(n, {}).get("points", [])} for n in (system, base)}
    rows = []
    for conc, p in pts[system].items():
        if (b := pts[base].get(conc)) is not None:
            rows.append([str(conc), *(number(a / c if a is not None and c else None, ".3f")
                                      for a, c in ((_get(p, *k), _get(b, *k)) for k in keys))])
    if not rows:
        return []
    header = ["conc", "TTFT p50", "TPOT p50", "tok/s", "prefill legs", "probe TTFT", "probe TPOT"]
    return [f"{system} / {base} in the same run (latency: < 1 is better; tok/s: > 1 is better):", grid(header, rows)]


def format_table(doc: Mapping[str, Any]) -> str:
    """The terminal report of a run's document: one row per system and concurrency (vLLM's client numbers,
    p2pkv's transfers and proxy), the handover breakdown, the prefill engine's own latency, push / pull,
    the checks."""
    cfg, mach = doc["config"], doc["machine"]
    main, prefill = [], []
    for name, p in _rows(doc):
        x, tr = p["p2pkv"], p["p2pkv"].get("transfers")
        kib = tr["bytes"] / tr["count"] / 1024 if tr and tr["count"] else None
        main.append([name, str(p["max_concurrency"]), *(number(p.get(k), f) for k, f in (
            ("median_ttft_ms", ".1f"), ("p99_ttft_ms", ".1f"), ("median_tpot_ms", ".2f"), ("p99_tpot_ms", ".2f"),
            ("request_throughput", ".2f"), ("output_throughput", ".1f"))),
            number(_get(tr, "mean_ms"), ".2f"), number(kib, ".0f"), directions(p),
            number(_get(x, "proxy", "mean_ms"), ".3f")])
        if pre := x.get("prefill"):
            probe = pre.get("probe") or {}
            prefill.append([name, str(p["max_concurrency"]), number(_get(pre, "legs", "mean_ms")),
                            number(_get(pre, "legs", "p99_ms")), number(_get(pre, "engine_ttft", "mean_ms")),
                            number(pre["engine_queue_mean_ms"], ".2f"), str(probe.get("requests", "-")),
                            number(probe.get("ttft_p50_ms")), number(probe.get("tpot_p50_ms"), ".2f")])
    lines = [f"p2pkv bench serve: {cfg['model']}; {cfg['num_prompts']} prompts per point, {cfg['input_len']} in / "
             f"{cfg['output_len']} out tokens, greedy; prefix caching {'on' if cfg['prefix_caching'] else 'off'}",
             f"  {mach['cpu_model']}, {mach['usable_cpus']} cores; " + ", ".join(
                 f"{k} {v}" for k, v in mach["versions"].items()), "",
             "(ms unless named; transfers: mean per transfer on the decode engine, KiB each, by direction; proxy: "
             "its own mean time per request)",
             grid(["system", "conc", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "req/s", "tok/s", "xfer ms",
                   "xfer KiB", "directions", "proxy"], main), "", *handover.format_breakdown(doc["systems"])]
    if prefill:
        lines += ["", "prefill engine's own latency (ms; legs: the proxy's prefill round trips, p99 from histogram "
                  "buckets; engine: its /metrics; probe: --prefill-probe):",
                  grid(["system", "conc", "legs mean", "legs p99~", "engine TTFT mean", "queue mean", "probe n",
                        "probe TTFT p50", "probe TPOT p50"], prefill)]
    if ratios := ratio_lines(doc):
        lines += ["", *ratios]
    lines += ["", "checks:", *(f"  {k}: {'passed' if c['passed'] else 'FAILED'} ({c['detail']})"
                               for k, c in doc["checks"].items())]
    return "\n".join(lines)


PANELS = (("TTFT p50 (ms)", ("median_ttft_ms",)), ("TPOT p50 (ms)", ("median_tpot_ms",)),
          ("prefill legs, mean round trip (ms)", ("p2pkv", "prefill", "legs", "mean_ms")),
          ("prefill engine, probe TPOT p50 (ms)", ("p2pkv", "prefill", "probe", "tpot_p50_ms")))
"""The plot's panels: title, and where the value is in a point (a panel without any value is left out)."""


def plot(doc: Mapping[str, Any], path: str | Path, labels: Mapping[str, str] | None = None) -> bool:
    """Per system vs concurrency: TTFT p50, TPOT p50, the prefill legs' mean round trip and the probe's
    TPOT p50 (ms); False without matplotlib."""
    plt = plotting.pyplot("p2pkv bench serve")
    if plt is None:
        return False
    panels = [(t, k) for t, k in PANELS if any(_get(p, *k) is not None for _, p in _rows(doc))]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    concs = list(doc["config"]["concurrency"])
    for ax, (title, keys) in zip(axes[0], panels, strict=True):
        for name, s in doc["systems"].items():
            pts = [(p["max_concurrency"], v) for p in s["points"] if (v := _get(p, *keys)) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=(labels or {}).get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    cfg, mach = doc["config"], doc["machine"]
    fig.suptitle(f"p2pkv bench serve: {Path(cfg['model']).name}, {cfg['input_len']} in / {cfg['output_len']} out "
                 f"tokens ({mach['cpu_model']}, {mach['usable_cpus']} cores)", fontsize=9)
    fig.tight_layout()
    plotting.save(fig, path)
    return True
