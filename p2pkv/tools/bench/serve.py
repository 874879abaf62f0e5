"""``p2pkv bench serve``: a serving benchmark through the bundled proxy, answers checked.

Starts, group by group on this host (:mod:`p2pkv.tools.bench.serve_systems`),

* ``p2pkv-pull`` and ``p2pkv-push``: one prefill/decode pair with p2pkv, each
  system behind its own bundled proxy, whose ``--transfer-mode`` asks every
  decode leg for that direction (the decode engine READs, or the prefill
  engine WRITEs into the decode engine's blocks); their points are
  interleaved (c=1 pull, c=1 push, c=2 push, c=2 pull, ...) so that each
  comparison is made minutes apart on the same engines;
* ``nixl``: the same pair with vLLM's own NixlConnector behind the proxy;
* ``aggregated``: one engine without a connector;
* ``p2pkv`` (not by default): the p2pkv pair with the decode engine's own
  ``transfer_mode`` (``auto``), beside the two above on the same engines,

and drives each with vLLM's ``bench serve`` client (readable random ASCII
prompts by default, ``--dataset random`` for vLLM's random token ids; fixed
seed, greedy, EOS ignored) over a sweep of ``--max-concurrency`` values.
Every point scrapes the decode engine's ``/metrics`` (transfer statistics,
their directions), the prefill engine's and the proxy's before and after:
the prefill engine's own latency while it serves (and pushes) the point's
KV is in :mod:`p2pkv.tools.bench.serve_prefill`, with ``--prefill-probe``
also from requests of its own. Every generated text must be the same in
every system; the first point's first prompts are also replayed one by one
with ``return_token_ids`` and the token ids compared; every transfer of
``p2pkv-pull`` / ``p2pkv-push`` must have gone that way.
Engines run with prefix caching off unless asked, so every request's KV is
computed by prefill and moved in full (vLLM's random prompts decoded by a
byte-level tokenizer share long prefixes).

Ports: see :mod:`p2pkv.tools.bench.serve_options`. Units: ms, requests/s,
output tokens/s, bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover, serve_compare, serve_report
from p2pkv.tools.bench.serve_launch import Deployment, StartedGroup, start_group
from p2pkv.tools.bench.serve_metrics import Snapshot, delta, proxy_overhead, pull_stats, scrape
from p2pkv.tools.bench.serve_options import DATASETS, ServeBenchOptions, add_arguments, options_from_args
from p2pkv.tools.bench.serve_prefill import PrefillProbe, prefill_latency
from p2pkv.tools.bench.serve_results import Check, PointResult, ServeResult, SystemResult
from p2pkv.tools.bench.serve_systems import DEFAULT_SYSTEMS, EXPECTED_DIRECTION, SYSTEM_LABELS, SYSTEMS, plan_groups

__all__ = ["DATASETS", "DEFAULT_SYSTEMS", "SYSTEMS", "ServeBenchOptions", "add_arguments", "main", "run_serve_bench"]

WARMUP_REQUESTS = 4
"""Requests sent to each system before its sweep (handshakes, first transfers, allocator warm-up)."""

TOKEN_CHECK_PROMPTS = 4
"""How many of the first point's prompts are replayed one by one for the token-id check."""


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


def _wait_pulls(client: Any, dep: Deployment, before: Snapshot | None, expected: int,
                timeout_s: float = 20.0) -> Snapshot | None:
    """Scrape the decode engine until ``expected`` more transfers show (stats arrive after the answers)."""
    if dep.decode_url is None or before is None or dep.pull_names is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(client, dep.decode_url)
        count = delta(before, after).value(dep.pull_names["count"])
        if count is None or count >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def dataset_path(opts: ServeBenchOptions, work: Path, seed: int) -> str:
    """The prompts file of the point with ``seed`` ("" for vLLM's random dataset), written once."""
    if opts.dataset == "random":
        return ""
    from p2pkv.tools.bench.serve_client import write_text_prompts

    path = work / "prompts" / f"text-{opts.input_len}-{opts.num_prompts}-{seed}.jsonl"
    return str(path if path.exists() else write_text_prompts(path, opts.num_prompts, opts.input_len, seed))


def _delta(before: Snapshot | None, after: Snapshot | None) -> Snapshot | None:
    return delta(before, after) if before is not None and after is not None else None


def run_point(client: Any, dep: Deployment, opts: ServeBenchOptions, model: str, conc: int, seed: int,
              work: Path) -> tuple[PointResult, dict[str, Any]]:
    """One point of the sweep against a started system.

    Returns:
        (the point's result, vLLM's full result dict).

    Raises:
        Exception: what vLLM's client raises (e.g. the server is unreachable).
    """
    from p2pkv.tools.bench.serve_client import ClientPoint, run_bench_serve

    point = ClientPoint(base_url=dep.url, model=model, label=dep.name, concurrency=conc,
                        num_prompts=opts.num_prompts, input_len=opts.input_len, output_len=opts.output_len,
                        seed=seed, result_dir=str(work / "results"), result_filename=f"{dep.name}-c{conc}.json",
                        request_id_prefix=f"{dep.name}-c{conc}-{uuid.uuid4().hex[:8]}-",
                        dataset_path=dataset_path(opts, work, seed),
                        cache_salt=f"{dep.name}-{uuid.uuid4().hex[:8]}")
    decode0, proxy0, prefill0 = (_scrape(client, u) for u in (dep.decode_url, dep.proxy_url, dep.prefill_url))
    probe = PrefillProbe(dep.prefill_url, opts.input_len, opts.output_len, seed).start() \
        if opts.prefill_probe and dep.prefill_url else None
    try:
        raw = run_bench_serve(point.argv(), work / "logs" / f"client-{dep.name}-c{conc}.log")
    finally:
        probed = probe.stop() if probe is not None else None
    decode1 = _wait_pulls(client, dep, decode0, int(raw.get("completed", 0)))
    proxy1, prefill1 = _scrape(client, dep.proxy_url), _scrape(client, dep.prefill_url)
    decode, proxy = _delta(decode0, decode1), _delta(proxy0, proxy1)
    result = PointResult.from_client(raw, concurrency=conc, seed=seed, num_prompts=opts.num_prompts)
    result.second_token_ms = handover.second_token_ms(raw)
    result.pull = pull_stats(decode, dep.pull_names) if decode is not None and dep.pull_names else None
    result.proxy_overhead = proxy_overhead(proxy) if proxy is not None else None
    result.handover = handover.breakdown(decode, proxy) if dep.proxy_url else None
    result.prefill = prefill_latency(_delta(prefill0, prefill1), proxy, probed) if dep.prefill_url else None
    result.answers_sha256 = serve_report.answers_digest(raw.get("generated_texts") or [])
    return result, raw


def _warm_up(client: Any, dep: Deployment, opts: ServeBenchOptions) -> list[str]:
    """Send :data:`WARMUP_REQUESTS` requests of about ``input_len`` characters and 4 output tokens (not
    measured: handshakes, first transfers of the real size); the failures' messages."""
    import httpx

    errors = []
    for i in range(WARMUP_REQUESTS):
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


def _measure_group(client: Any, group: StartedGroup, opts: ServeBenchOptions, model: str, work: Path,
                   result: ServeResult, answers: _Answers) -> None:
    """Warm every system of a started group up, run the sweep with the systems' points interleaved (the
    order turns round at every concurrency), replay prompts for the token check. A system that fails is
    recorded and left out of the rest; the others go on."""
    live: list[Deployment] = []
    for dep in group.systems:
        progress(f"[{dep.name}] ready in {dep.startup_s:.0f} s; warming up")
        result.systems[dep.name].warmup_errors = _warm_up(client, dep, opts)
        live.append(dep)
    seeds = result.seeds
    for i, conc in enumerate(opts.concurrency):
        for dep in list(live if i % 2 == 0 else reversed(live)):
            try:
                point, raw = run_point(client, dep, opts, model, conc, seeds[conc], work)
            except Exception as exc:  # a broken system must not hide the others' results
                _failed(result, answers, dep, exc)
                live.remove(dep)
                continue
            result.systems[dep.name].points.append(point)
            answers.texts[conc][dep.name] = list(raw.get("generated_texts") or [])
            if (err := serve_report.request_errors(dep.name, conc, raw)) is not None:
                answers.failures.append(err)
            progress(serve_report.point_line(dep.name, point))
    first = opts.concurrency[0]
    replay = answers.prompts[first][:TOKEN_CHECK_PROMPTS]
    for dep in live:
        try:
            answers.tokens[first][dep.name] = [_complete(client, dep.url, p, n).get("token_ids") for p, _, n in replay]
        except Exception as exc:
            _failed(result, answers, dep, exc)
            continue
        progress(f"[{dep.name}] replayed {len(replay)} prompts one by one for the token-id check")


def _failed(result: ServeResult, answers: _Answers, dep: Deployment, exc: Exception) -> None:
    answers.failures.append(f"{dep.name}: {type(exc).__name__}: {exc}")
    result.systems[dep.name].error = f"{type(exc).__name__}: {exc}"
    progress(f"[{dep.name}] FAILED: {type(exc).__name__}: {exc}")


def check_directions(result: ServeResult) -> Check:
    """Every transfer of a system with a fixed direction (``p2pkv-pull``, ``p2pkv-push``) went that way,
    by the decode engine's ``p2pkv:pulls_by_direction_total`` over its points."""
    problems, seen = [], []
    for name, want in EXPECTED_DIRECTION.items():
        sys_result = result.systems.get(name)
        if sys_result is None or not sys_result.points:
            continue
        counts: dict[str, int] = {}
        for p in sys_result.points:
            for direction, n in (p.pull.directions if p.pull else {}).items():
                counts[direction] = counts.get(direction, 0) + n
        total = sum(counts.values())
        if total == 0:
            problems.append(f"{name}: no transfer by direction seen (p2pkv:pulls_by_direction_total)")
        elif counts.get(want, 0) != total:
            problems.append(f"{name}: {counts.get(want, 0)} of {total} transfers went {want}: {counts}")
        else:
            seen.append(f"{name}: all {total} {want}")
    if problems:
        return Check(False, "; ".join(problems))
    return Check(True, "; ".join(seen) or "no system with a fixed direction ran")


def _check_answers(result: ServeResult, opts: ServeBenchOptions, answers: _Answers) -> None:
    """Fill ``result.checks``: every request succeeded; every system's answers equal per prompt; the directions."""
    result.checks["requests"] = Check(not answers.failures,
                                      "; ".join(answers.failures) or "every request of every point succeeded")
    prompt_texts = {c: [p for p, _, _ in ps] for c, ps in answers.prompts.items()}
    one = " (one system: nothing to compare)" if len(opts.systems) < 2 else ""
    for key, got, what in (("answers", answers.texts, "generated text"), ("tokens", answers.tokens, "token ids")):
        try:
            ok = serve_report.check_answers(got, what, prompt_texts)
            result.checks[key] = Check(True, f"{ok['compared']} answers of {', '.join(ok['systems'])} compared, "
                                             f"all equal per prompt{one}", ok["compared"], ok["systems"])
        except serve_report.AnswerMismatch as exc:
            result.checks[key] = Check(False, str(exc))
    result.checks["directions"] = check_directions(result)


def run_serve_bench(opts: ServeBenchOptions, argv: list[str] | None = None) -> ServeResult:
    """Run the whole benchmark; every engine is stopped before this returns or raises.

    Args:
        opts: the settings.
        argv: the command line to record (default ``sys.argv``).

    Returns:
        The result. A failed check does not raise: ``checks`` says so.

    Raises:
        ValueError: bad options.
        KeyboardInterrupt: Ctrl-C or SIGTERM (engines stopped).
    """
    import httpx

    from p2pkv.tools.bench.machine import command_line
    from p2pkv.tools.bench.serve_client import ClientPoint, sample_prompts
    from p2pkv.tools.deploy.processes import LaunchError

    opts.validate()
    work = Path(opts.work_dir).resolve()
    if opts.model:
        model = str(Path(opts.model).resolve()) if Path(opts.model).is_dir() else opts.model
    else:
        from p2pkv.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "tiny-model").resolve())
    seeds = opts.seeds()
    result = ServeResult(command=command_line(argv if argv is not None else sys.argv),
                         machine=serve_report.machine(), config=dataclasses.replace(opts, model=model), seeds=seeds)
    groups = plan_groups(opts.systems, share_engines=not opts.prefix_caching or bool(opts.p2pkv_engines))
    progress(f"model {model}; systems {' then '.join('+'.join(g) for g in groups)}; concurrency "
             f"{list(opts.concurrency)}; {opts.num_prompts} prompts per point; work dir {work}")
    prompts = {c: sample_prompts(ClientPoint("http://unused", model, "prompts", c, opts.num_prompts, opts.input_len,
                                             opts.output_len, seeds[c], str(work), "unused.json", "p-",
                                             dataset_path(opts, work, seeds[c])).argv())
               for c in opts.concurrency}
    answers = _Answers(prompts, {c: {} for c in opts.concurrency}, {opts.concurrency[0]: {}}, [])
    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        for names in groups:
            log_dir = work / "logs" / "+".join(names)
            progress(f"[{'+'.join(names)}] starting {'; '.join(SYSTEM_LABELS[n] for n in names)} (logs in {log_dir})")
            for n in names:
                result.systems[n] = SystemResult(SYSTEM_LABELS[n], engines=list(names))
            try:
                group = start_group(names, opts, model, log_dir)
            except LaunchError as exc:
                for n in names:
                    answers.failures.append(f"{n} did not start: {exc}")
                    result.systems[n].error = str(exc)
                progress(f"[{'+'.join(names)}] FAILED to start: {str(exc).splitlines()[0]}")
                continue
            for dep in group.systems:
                result.systems[dep.name].url, result.systems[dep.name].startup_s = dep.url, dep.startup_s
            try:
                _measure_group(client, group, opts, model, work, result, answers)
            finally:
                group.stop()
                progress(f"[{'+'.join(names)}] stopped")
    result.machine["loadavg_end"] = list(os.getloadavg())
    _check_answers(result, opts, answers)
    result.ratios = serve_compare.ratios(result)
    result.targets = serve_compare.evaluate_targets(result) + handover.evaluate(result)
    return result


def main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench serve``; 0 when every request succeeded, all systems answered alike and every
    transfer went the way its system asks, else 1.

    Exit codes: 0 ok, 1 a failed request, engine or check, 2 bad flags,
    130 interrupted (Ctrl-C or SIGTERM; engines stopped).
    """
    from p2pkv.tools.bench.report import write_json

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
        result = run_serve_bench(opts)
    except KeyboardInterrupt:
        print("p2pkv bench serve: interrupted; every engine was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(serve_report.format_table(result))
    if args.json:
        write_json(result.to_json(), args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and serve_report.plot(result, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.plot and handover.plot(result, bars := Path(args.plot).with_name(Path(args.plot).stem + "-handover.png")):
        print(f"wrote {bars}", file=sys.stderr)
    failed = [f"{k}: {c.detail}" for k, c in result.checks.items() if not c.passed]
    for line in failed:
        print(f"p2pkv bench serve: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0
