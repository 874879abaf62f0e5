"""``p2pkv bench serve``: a serving benchmark through the bundled proxy, answers checked.

Starts, one system at a time on this host,

* ``p2pkv``: a prefill/decode pair with p2pkv behind the bundled proxy,
* ``nixl``: the same pair with vLLM's own NixlConnector behind the same proxy,
* ``aggregated``: one engine without a connector,

and drives each with vLLM's ``bench serve`` client (readable random ASCII
prompts by default, ``--dataset random`` for vLLM's random token ids; fixed
seed, greedy, EOS ignored) over a sweep of ``--max-concurrency`` values.
Every point scrapes the decode engine's ``/metrics`` (pull statistics) and
the proxy's (its own added latency) before and after. Every generated text
must be the same in every system; the first point's first prompts are
also replayed one by one with ``return_token_ids`` and the token ids
compared.
Engines run with prefix caching off unless asked, so every request's KV is
computed by prefill and moved in full (vLLM's random prompts decoded by a
byte-level tokenizer share long prefixes).

Ports: proxy ``BASE``, prefill ``BASE+100``, decode ``BASE+200``,
aggregated ``BASE+300``, side channels ``BASE+400`` (prefill) and
``BASE+500`` (decode). Units: ms, requests/s, output tokens/s, bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from p2pkv.tools.bench import handover, serve_report
from p2pkv.tools.bench.serve_metrics import NIXL_PULL, P2PKV_PULL, Snapshot, delta, proxy_overhead, pull_stats, scrape

SYSTEMS = ("p2pkv", "nixl", "aggregated")
"""Systems this benchmark can run, in its default order."""
DATASETS = ("text", "random")
"""``--dataset`` choices (see :class:`ServeBenchOptions`)."""

WARMUP_REQUESTS = 4
"""Short requests sent to each system before its sweep (handshakes, first pulls, allocator warm-up)."""

TOKEN_CHECK_PROMPTS = 4
"""How many of the first point's prompts are replayed one by one for the token-id check."""


@dataclass
class ServeBenchOptions:
    """Settings of one ``p2pkv bench serve`` run.

    Attributes:
        model: model directory ("" : make the tiny random-weight model in ``work_dir``).
        systems: which of :data:`SYSTEMS` to run, in this order.
        concurrency: ``--max-concurrency`` values of the sweep (requests in flight).
        num_prompts: requests per point.
        input_len / output_len: prompt and generated tokens per request.
        block_size: tokens per KV block.
        dtype: model dtype.
        seed: dataset seed of the first point; point *i* uses ``seed + i``.
        base_port: first of the ports (see the module docstring).
        host: address everything binds to.
        work_dir: tiny model, engine logs, vLLM's per-point result files.
        tensor_parallel_size: TP size of every engine.
        extra_engine_args: more ``vllm serve`` flags for every engine.
        prefix_caching: leave vLLM's prefix caching on.
        first_token_from: the proxy's ``--first-token-from`` (``prefill`` or ``decode``).
        dataset: ``text`` (readable random ASCII prompts of ``input_len``
            characters, :func:`~p2pkv.tools.bench.serve_client.write_text_prompts`)
            or ``random`` (vLLM's random token ids).
        start_timeout_s: how long engines may take to become healthy (seconds).
    """

    model: str = ""
    systems: tuple[str, ...] = SYSTEMS
    concurrency: tuple[int, ...] = (1, 2, 4)
    num_prompts: int = 8
    input_len: int = 256
    output_len: int = 32
    block_size: int = 32
    dtype: str = "float32"
    seed: int = 0
    base_port: int = 8800
    host: str = "127.0.0.1"
    work_dir: str = ".p2pkv/bench-serve"
    tensor_parallel_size: int = 1
    extra_engine_args: tuple[str, ...] = field(default_factory=tuple)
    prefix_caching: bool = False
    first_token_from: str = "prefill"
    dataset: str = "text"
    start_timeout_s: float = 900.0

    def validate(self) -> None:
        """Raises ValueError naming the bad flag."""
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"--systems {','.join(self.systems)}: choose from {','.join(SYSTEMS)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency {self.concurrency}: positive integers")
        for flag, v in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                        ("--output-len", self.output_len), ("--block-size", self.block_size)):
            if v < 1:
                raise ValueError(f"{flag} {v}: must be >= 1")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset {self.dataset}: choose from {', '.join(DATASETS)}")
        if self.dataset == "text" and importlib.util.find_spec("pandas") is None:
            raise ValueError("--dataset text: vLLM's client reads the prompts with pandas, which is not installed "
                             "(pip install 'p2pkv[bench]'), or pass --dataset random")
        if self.first_token_from not in ("prefill", "decode"):
            raise ValueError(f"--first-token-from {self.first_token_from}: choose prefill or decode")

    def engine_args(self) -> tuple[str, ...]:
        """Extra ``vllm serve`` flags of every engine."""
        return (() if self.prefix_caching else ("--no-enable-prefix-caching",)) + tuple(self.extra_engine_args)


@dataclass
class Deployment:
    """A started system: where to send requests, what to scrape, how to stop it."""

    name: str
    url: str
    stop: Callable[[], None]
    decode_url: str | None = None
    proxy_url: str | None = None
    pull_names: dict[str, str] | None = None


def progress(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_system(name: str, opts: ServeBenchOptions, model: str, log_dir: Path) -> Deployment:
    """Start one system and wait until it is healthy.

    Raises:
        LaunchError: a process died or never became healthy (everything it started is stopped).
    """
    from p2pkv.tools.deploy.engines import EngineSpec
    from p2pkv.tools.deploy.local import LocalPair, check_port_free
    from p2pkv.tools.deploy.processes import start_child, stop_children, wait_healthy

    b, host = opts.base_port, opts.host
    max_len = max(2048, opts.input_len + opts.output_len)
    if name == "aggregated":
        check_port_free(host, b + 300, "--base-port (+300, aggregated)")
        spec = EngineSpec(name="aggregated", model=model, port=b + 300, host=host, block_size=opts.block_size,
                          dtype=opts.dtype, max_model_len=max_len, tensor_parallel_size=opts.tensor_parallel_size,
                          env={"UCX_NET_DEVICES": "lo"}, extra_args=opts.engine_args())
        children = [start_child(spec.name, spec.command(), spec.environment(), log_dir,
                                f"http://{host}:{spec.port}/health")]
        try:
            wait_healthy(children, opts.start_timeout_s)
        except BaseException:
            stop_children(children)
            raise
        return Deployment(name, f"http://{host}:{spec.port}", lambda: stop_children(children))
    pair = LocalPair(model=model, host=host, proxy_port=b, prefill_port=b + 100, decode_port=b + 200,
                     side_channel_port=b + 400, block_size=opts.block_size, dtype=opts.dtype,
                     max_model_len=max_len, log_dir=log_dir, connector=name,
                     tensor_parallel_size=opts.tensor_parallel_size, engine_args=opts.engine_args(),
                     proxy_args=("--first-token-from", opts.first_token_from))
    pair.start(timeout_s=opts.start_timeout_s)
    return Deployment(name, pair.url("proxy"), pair.stop, decode_url=pair.url("decode"),
                      proxy_url=pair.url("proxy"), pull_names=P2PKV_PULL if name == "p2pkv" else NIXL_PULL)


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
    """Scrape the decode engine until ``expected`` more pulls show (stats arrive after the answers)."""
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


def run_point(client: Any, dep: Deployment, opts: ServeBenchOptions, model: str, conc: int, seed: int,
              work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One point of the sweep against a started system.

    Returns:
        (the point's summary for the result, vLLM's full result dict).

    Raises:
        Exception: what vLLM's client raises (e.g. the server is unreachable).
    """
    from p2pkv.tools.bench.serve_client import ClientPoint, run_bench_serve

    point = ClientPoint(base_url=dep.url, model=model, label=dep.name, concurrency=conc,
                        num_prompts=opts.num_prompts, input_len=opts.input_len, output_len=opts.output_len,
                        seed=seed, result_dir=str(work / "results"), result_filename=f"{dep.name}-c{conc}.json",
                        request_id_prefix=f"{dep.name}-c{conc}-{uuid.uuid4().hex[:8]}-",
                        dataset_path=dataset_path(opts, work, seed))
    decode0, proxy0 = _scrape(client, dep.decode_url), _scrape(client, dep.proxy_url)
    raw = run_bench_serve(point.argv(), work / "logs" / f"client-{dep.name}-c{conc}.log")
    decode1 = _wait_pulls(client, dep, decode0, int(raw.get("completed", 0)))
    proxy1 = _scrape(client, dep.proxy_url)
    summary = {"concurrency": conc, "seed": seed, "num_prompts": opts.num_prompts,
               **serve_report.point_summary(raw),
               "pull": pull_stats(delta(decode0, decode1), dep.pull_names)
               if decode0 is not None and decode1 is not None and dep.pull_names else None,
               "proxy_overhead": proxy_overhead(delta(proxy0, proxy1))
               if proxy0 is not None and proxy1 is not None else None,
               "second_token_ms": handover.second_token_ms(raw),
               "handover": handover.breakdown(delta(decode0, decode1) if decode0 and decode1 else None,
                                              delta(proxy0, proxy1) if proxy0 and proxy1 else None),
               "answers_sha256": serve_report.answers_digest(raw.get("generated_texts") or [])}
    return summary, raw


def _measure_system(client: Any, dep: Any, name: str, opts: ServeBenchOptions, model: str, seeds: dict[int, int],
                    prompts: dict[int, list[Any]], work: Path, sys_result: dict[str, Any],
                    texts: dict[int, dict[str, list[str]]], tokens: dict[int, dict[str, list[Any]]],
                    failures: list[str]) -> None:
    """Warm one started system up, run every concurrency point, replay prompts for the token check."""
    import httpx

    progress(f"[{name}] ready in {sys_result['startup_s']:.0f} s; warming up")
    warm_errors = []
    for i in range(WARMUP_REQUESTS):  # not measured; a failure here is recorded, not fatal
        try:
            _complete(client, dep.url, f"warm-up request {i}: " + "w" * opts.block_size, 4)
        except httpx.HTTPError as exc:
            warm_errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            progress(f"[{name}] warm-up request {i} failed: {warm_errors[-1]}")
    sys_result["warmup_errors"] = warm_errors
    for conc in opts.concurrency:
        summary, raw = run_point(client, dep, opts, model, conc, seeds[conc], work)
        sys_result["points"].append(summary)
        texts[conc][name] = list(raw.get("generated_texts") or [])
        if (err := serve_report.request_errors(name, conc, raw)) is not None:
            failures.append(err)
        progress(serve_report.point_line(name, summary))
    first = opts.concurrency[0]
    replay = prompts[first][:TOKEN_CHECK_PROMPTS]
    tokens[first][name] = [_complete(client, dep.url, p, n).get("token_ids") for p, _, n in replay]
    progress(f"[{name}] replayed {len(replay)} prompts one by one for the token-id check")


def _check_answers(result: dict[str, Any], opts: ServeBenchOptions, prompts: dict[int, list[Any]],
                   texts: dict[int, dict[str, list[str]]], tokens: dict[int, dict[str, list[Any]]],
                   failures: list[str]) -> None:
    """Fill ``result["checks"]``: every request succeeded; every system's answers equal per prompt."""
    result["checks"]["requests"] = {"passed": not failures,
                                    "detail": "; ".join(failures) or "every request of every point succeeded"}
    prompt_texts = {c: [p for p, _, _ in ps] for c, ps in prompts.items()}
    for key, answers, what in (("answers", texts, "generated text"), ("tokens", tokens, "token ids")):
        try:
            ok = serve_report.check_answers(answers, what, prompt_texts)
            result["checks"][key] = {**ok, "detail": f"{ok['compared']} answers of {', '.join(ok['systems'])} "
                                                     f"compared, all equal per prompt"}
        except serve_report.AnswerMismatch as exc:
            result["checks"][key] = {"passed": False, "detail": str(exc)}
    if len(opts.systems) < 2:
        for key in ("answers", "tokens"):
            result["checks"][key]["detail"] += " (one system: nothing to compare)"


def run_serve_bench(opts: ServeBenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the whole benchmark; every engine is stopped before this returns or raises.

    Args:
        opts: the settings.
        argv: the command line to record (default ``sys.argv``).

    Returns:
        The result: ``command``, ``machine``, ``config``, ``systems`` (name →
        ``points``, ``startup_s``, ``warmup_errors``, or ``error``), ``checks`` (``answers``,
        ``tokens``, ``requests``: ``passed`` and ``detail``), ``ratios`` and
        ``targets``. A failed check does not raise: ``checks`` says so.

    Raises:
        ValueError: bad options.
        KeyboardInterrupt: Ctrl-C or SIGTERM (engines stopped).
    """
    import httpx

    from p2pkv.tools.bench.report import command_line
    from p2pkv.tools.bench.serve_client import ClientPoint, sample_prompts
    from p2pkv.tools.deploy.processes import LaunchError

    opts.validate()
    work = Path(opts.work_dir).resolve()
    if opts.model:
        model = str(Path(opts.model).resolve()) if Path(opts.model).is_dir() else opts.model
    else:
        from p2pkv.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "tiny-model").resolve())
    seeds = {c: opts.seed + i for i, c in enumerate(opts.concurrency)}
    result: dict[str, Any] = {
        "command": command_line(argv if argv is not None else sys.argv), "machine": serve_report.machine(),
        "config": {**asdict(opts), "model": model, "systems": list(opts.systems),
                   "concurrency": list(opts.concurrency), "extra_engine_args": list(opts.extra_engine_args),
                   "engine_args": list(opts.engine_args()), "seeds": {str(c): s for c, s in seeds.items()}},
        "systems": {}, "checks": {}}
    progress(f"model {model}; systems {','.join(opts.systems)}; concurrency {list(opts.concurrency)}; "
             f"{opts.num_prompts} prompts per point; work dir {work}")
    prompts = {c: sample_prompts(ClientPoint("http://unused", model, "prompts", c, opts.num_prompts, opts.input_len,
                                             opts.output_len, seeds[c], str(work), "unused.json", "p-",
                                             dataset_path(opts, work, seeds[c])).argv())
               for c in opts.concurrency}
    texts: dict[int, dict[str, list[str]]] = {c: {} for c in opts.concurrency}
    tokens: dict[int, dict[str, list[Any]]] = {opts.concurrency[0]: {}}
    failures: list[str] = []
    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        for name in opts.systems:
            progress(f"[{name}] starting {serve_report.SYSTEM_LABELS[name]} (logs in {work / 'logs' / name})")
            t0 = time.monotonic()
            try:
                dep = start_system(name, opts, model, work / "logs" / name)
            except LaunchError as exc:
                failures.append(f"{name} did not start: {exc}")
                result["systems"][name] = {"label": serve_report.SYSTEM_LABELS[name], "error": str(exc),
                                           "points": []}
                progress(f"[{name}] FAILED to start: {str(exc).splitlines()[0]}")
                continue
            sys_result: dict[str, Any] = {"label": serve_report.SYSTEM_LABELS[name], "url": dep.url,
                                          "startup_s": time.monotonic() - t0, "points": []}
            result["systems"][name] = sys_result
            try:
                _measure_system(client, dep, name, opts, model, seeds, prompts, work, sys_result, texts, tokens,
                                failures)
            except Exception as exc:  # a broken system must not hide the others' results
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                sys_result["error"] = f"{type(exc).__name__}: {exc}"
                progress(f"[{name}] FAILED: {type(exc).__name__}: {exc}")
            finally:
                dep.stop()
                progress(f"[{name}] stopped")
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    _check_answers(result, opts, prompts, texts, tokens, failures)
    result["ratios"] = serve_report.ratios(result)
    result["targets"] = serve_report.evaluate_targets(result) + handover.evaluate(result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``p2pkv bench serve``."""
    d = ServeBenchOptions()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    p.add_argument("--model", default="", help="model directory (default: the tiny random-weight model, "
                                               "made in the work dir)")
    p.add_argument("--systems", default=",".join(d.systems),
                   help=f"comma-separated, run in this order (default {','.join(d.systems)})")
    p.add_argument("--concurrency", type=ints, default=d.concurrency,
                   help="max requests in flight, a comma-separated sweep (default 1,2,4)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per point")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len, help="generated tokens per request")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--dtype", default=d.dtype, help="model dtype")
    p.add_argument("--seed", type=int, default=d.seed, help="dataset seed of the first point (+1 per point)")
    p.add_argument("--base-port", type=int, default=d.base_port,
                   help="proxy port; prefill, decode, aggregated +100/+200/+300, side channels +400/+500")
    p.add_argument("--host", default=d.host, help="address everything binds to")
    p.add_argument("--work-dir", default=d.work_dir, help="tiny model, engine and client logs, vLLM result files")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size, help="TP size of every engine")
    p.add_argument("--extra-engine-args", default="",
                   help="more `vllm serve` flags for every engine, one shell-quoted string")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave vLLM's prefix caching on (default off: every request's KV is moved in full)")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="prompts: 'text' (default: readable random ASCII, --input-len characters) or 'random' "
                        "(vLLM's random token ids; byte soup with a byte-level tokenizer)")
    p.add_argument("--first-token-from", choices=("prefill", "decode"), default=d.first_token_from,
                   help="the proxy's --first-token-from: a streaming request's first token from the prefill "
                        "engine's answer (default) or from the decode engine")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s, help="seconds for engines to start")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="TTFT/TPOT p50 vs concurrency (needs matplotlib: p2pkv[bench])")


def main(args: argparse.Namespace) -> int:
    """Run ``p2pkv bench serve``; 0 when every request succeeded and all systems answered alike, else 1.

    Exit codes: 0 ok, 1 a failed request, engine or answer check, 2 bad
    flags, 130 interrupted (Ctrl-C or SIGTERM; engines stopped).
    """
    import shlex

    from p2pkv.tools.bench.report import write_json

    opts = ServeBenchOptions(
        model=args.model, systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        concurrency=tuple(args.concurrency), num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, block_size=args.block_size, dtype=args.dtype, seed=args.seed,
        base_port=args.base_port, host=args.host, work_dir=args.work_dir,
        tensor_parallel_size=args.tensor_parallel_size, extra_engine_args=tuple(shlex.split(args.extra_engine_args)),
        prefix_caching=args.prefix_caching, first_token_from=args.first_token_from, dataset=args.dataset,
        start_timeout_s=args.start_timeout)

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
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and serve_report.plot(result, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.plot and handover.plot(result, bars := Path(args.plot).with_name(Path(args.plot).stem + "-handover.png")):
        print(f"wrote {bars}", file=sys.stderr)
    failed = [f"{k}: {c['detail']}" for k, c in result["checks"].items() if not c["passed"]]
    for line in failed:
        print(f"p2pkv bench serve: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0
