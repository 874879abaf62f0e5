"""CPU seconds a decode engine spends while a layer stream waits for its prefill, by decode setting.

Where both engines share the cores (a CPU host), what a decode engine burns
while its stream waits is taken from the prefill's forward. For each decode
setting given, this launches a local P/D pair (``p2pkv launch local``, UCX
over ``cma``, stream proxy) plus a push proxy on the same engines, sends
``--requests`` prompts of ``--length`` random tokens through each proxy, one
at a time, alternating (push, stream, push, ...: the host's drift falls on
both alike), and records per request its wall time and the CPU seconds of
the decode engine's and the prefill engine's processes (``psutil``, each
engine's API server and its children), and per mode the CPU seconds per
request of each thread of both engine cores (``threads``: ``D:`` decode,
``P:`` prefill; named by ``py-spy dump`` when ``py-spy`` is installed, else
by thread id), which tells what a stream costs where. Each request also
records ``prefill_s``, the prefill engine's own prefill time for it
(``vllm:request_prefill_time_seconds``), and each mode's summary the
stream-over-push ratio of the medians and of each alternating pair.

``--pin "P D"`` pins every thread of the prefill engine's processes to cores
``P`` and the decode engine's to ``D`` once they serve (``taskset``'s lists);
``--transfer-cores C`` then moves the prefill engine's transfer threads
(``p2pkv-write``: named by ``py-spy``) to ``C``, to
tell the forward's time from the sending's. ``--transfer-cpus C`` does the
same through p2pkv's own setting (``P2PKV_TRANSFER_CPUS`` for both engines):
pinning then leaves alone the threads the setting already placed on ``C``,
and each result records where the named transfer threads and the prefill
engine's forward thread (``P:MainThread``) ran.

Several ``--length`` values are measured in turn on one pair (its
``max_model_len`` fits the longest), each with its own warm-up pair; several
``--ucx-tls`` values launch a pair each (regimes, e.g. ``tcp,self`` for a
link-bound pair and ``cma,tcp,self`` for a fast one). The JSON file is
rewritten after every point, so a run stopped early keeps what it measured.

    python scripts/stream_wait_cpu.py --model .p2pkv/bench-stream/llama-32l-kv8x128 \\
        --json docs/benchmarks/stream-wait-cpu.json \\
        --setting '{}' --setting '{"transfer_cpus": "1"}'

(The runs recorded with ``stream_idle_wait_s`` and ``stream_poll_interval_s`` settings predate their becoming
constants: ``p2pkv.worker.STREAM_IDLE_WAIT_S``, ``p2pkv.decode.transfer.STREAM_POLL_MIN_S``.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from p2pkv.config import parse_cpus
from p2pkv.tools.bench.results import median_interval
from p2pkv.tools.bench.serve_metrics import ENGINE_PREFILL, Snapshot, delta, scrape

BASE_PORT = 9300
TRANSFER_THREADS = {"P:p2pkv-write"}
"""The prefill engine's threads that move a request's bytes (``--transfer-cores``)."""


def _engine_processes(port: int) -> list[psutil.Process]:
    """The API server listening on ``port`` (found by its command line) and every process under it."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in " ".join(cmd) and "--port" in cmd \
                and cmd[cmd.index("--port") + 1] == str(port):
            return [proc, *proc.children(recursive=True)]
    raise RuntimeError(f"no vLLM API server on port {port}")


def cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` so far (a process gone counts 0)."""
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _wait_ready(url: str, launcher: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise RuntimeError("p2pkv launch local died: see its log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


def _request(url: str, length: int, rng: random.Random, decode: list[psutil.Process],
             prefill: list[psutil.Process], prefill_url: str) -> dict[str, float]:
    """One prompt of ``length`` random tokens: its wall seconds, each engine's CPU seconds, and the prefill
    engine's prefill seconds for it."""
    prompt = [rng.randrange(10, 250) for _ in range(length)]  # inside a tiny model's 259-token vocabulary
    before = scrape(httpx, prefill_url)
    cpu_d, cpu_p, start = cpu_s(decode), cpu_s(prefill), time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": 2,
                                                     "temperature": 0}, timeout=600)
    resp.raise_for_status()
    row = {"wall_s": time.monotonic() - start, "decode_cpu_s": cpu_s(decode) - cpu_d,
           "prefill_cpu_s": cpu_s(prefill) - cpu_p}
    return {**row, "prefill_s": _prefill_s(prefill_url, before)}


def _prefill_s(prefill_url: str, before: Snapshot, timeout_s: float = 10.0) -> float:
    """The prefill engine's prefill seconds since ``before`` (waits for its one request to be counted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = delta(before, scrape(httpx, prefill_url))
        if (d.value(f"{ENGINE_PREFILL}_count") or 0) >= 1 or time.monotonic() > deadline:
            return d.value(f"{ENGINE_PREFILL}_sum") or math.nan
        time.sleep(0.1)


def _pin(procs: list[psutil.Process], cores: str, keep: frozenset[int] = frozenset()) -> None:
    """Every thread of ``procs`` to ``cores`` (a ``taskset`` list such as ``0`` or ``2-3``), but for the threads
    already placed on exactly ``keep`` (by ``transfer_cpus``), which stay there."""
    wanted = parse_cpus(cores)
    for proc in procs:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                if keep and os.sched_getaffinity(int(tid)) == keep:
                    continue
                os.sched_setaffinity(int(tid), wanted)
            except (ProcessLookupError, FileNotFoundError):
                continue  # a thread that ended meanwhile


def _placement(names: dict[str, str], wanted: set[str]) -> dict[str, str]:
    """Where each named thread in ``wanted`` may run: ``name`` → its cores, e.g. ``"1"`` or ``"0,1"``."""
    out = {}
    for tid, name in names.items():
        if name in wanted:
            try:
                out[name] = ",".join(str(c) for c in sorted(os.sched_getaffinity(int(tid))))
            except ProcessLookupError:
                continue
    return out


def _move_threads(names: dict[str, str], wanted: set[str], cores: str) -> list[str]:
    """The threads whose names (``P:<name>``) are in ``wanted`` to ``cores``; the names moved."""
    moved = []
    for tid, name in names.items():
        if name in wanted:
            subprocess.run(["taskset", "-cp", cores, tid], check=True, stdout=subprocess.DEVNULL)
            moved.append(name)
    return sorted(moved)


def _engine_core(procs: list[psutil.Process]) -> int:
    """The pid of the engine core process among an engine's processes (vLLM names it ``VLLM::EngineCore``)."""
    for proc in procs:
        if proc.name().startswith("VLLM"):
            return proc.pid
    raise RuntimeError("no VLLM::EngineCore process")


def _thread_names(pid: int) -> dict[str, str]:
    """Thread id → Python thread name of process ``pid``, by ``py-spy dump`` (empty without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {line.split()[1]: line.split('"')[1] for line in dump.splitlines()
            if line.startswith("Thread ") and '"' in line}


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """Thread id → user + system CPU seconds of each thread of process ``pid`` so far (``/proc``)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def _ratios(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Stream over push of the prefill seconds: of the medians, and of each pair (the push request and the
    stream request after it), with the pairs' median, its 95 % bootstrap interval and their geometric mean."""
    pairs = [s["prefill_s"] / p["prefill_s"] for p, s in zip(rows["push"], rows["stream"], strict=True)]
    medians = statistics.median(r["prefill_s"] for r in rows["stream"]) / statistics.median(
        r["prefill_s"] for r in rows["push"])
    lo, hi = median_interval(pairs)
    return {"prefill_s_medians": round(medians, 4), "prefill_s_pairs": [round(r, 4) for r in pairs],
            "prefill_s_pairs_median": round(statistics.median(pairs), 4),
            "prefill_s_pairs_median_ci95": [round(lo, 4), round(hi, 4)],
            "prefill_s_pairs_geomean": round(statistics.geometric_mean(pairs), 4)}


def _launch(model: str, setting: dict[str, Any], max_len: int, work: Path, env: dict[str, str]
            ) -> tuple[subprocess.Popen, subprocess.Popen | None]:
    """A ``p2pkv launch local`` pair with a stream proxy (``setting`` on the decode engine, ``max_len`` tokens),
    and a push proxy on the same engines; both processes, once they serve."""
    b = BASE_PORT
    argv = [sys.executable, "-m", "p2pkv.tools.cli", "launch", "local", "--model", model, "--proxy-port", str(b),
            "--prefill-port", str(b + 1), "--decode-port", str(b + 2), "--side-channel-port", str(b + 10),
            "--block-size", "32", "--max-model-len", str(max_len), "--log-dir", str(work / "logs"),
            "--decode-extra-config", json.dumps(setting), "--proxy-args", "--transfer-mode stream"]
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "launch.log", "w") as log:
        launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    push = None
    try:
        _wait_ready(f"http://127.0.0.1:{b}", launcher)
        push = subprocess.Popen([sys.executable, "-m", "p2pkv.tools.cli", "proxy", "--port", str(b + 3),
                                 "--prefill", f"127.0.0.1:{b + 1}", "--decode", f"127.0.0.1:{b + 2}",
                                 "--transfer-mode", "push"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env)
        _wait_ready(f"http://127.0.0.1:{b + 3}", push)
    except BaseException:
        _stop(push, launcher)
        raise
    return launcher, push


def _stop(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def _measure(length: int, requests: int, cores: dict[str, int], names: dict[str, str],
             engines: dict[str, list[psutil.Process]]) -> dict[str, Any]:
    """``requests`` alternating push and stream prompts of ``length`` tokens after one warm-up pair: per mode
    each request's row, the medians and each thread's CPU seconds per request, and the stream-over-push ratios."""
    b = BASE_PORT
    rng = random.Random(length)
    urls = {"push": f"http://127.0.0.1:{b + 3}", "stream": f"http://127.0.0.1:{b}"}
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in urls}
    threads: dict[str, dict[str, float]] = {mode: {} for mode in urls}
    for i in range(requests + 1):  # the first of each mode warms up
        for mode, url in urls.items():
            before = {tid: cpu for pid in cores.values() for tid, cpu in _thread_cpu_s(pid).items()}
            row = _request(url, length, rng, engines["D"], engines["P"], f"http://127.0.0.1:{b + 1}")
            after = {tid: cpu for pid in cores.values() for tid, cpu in _thread_cpu_s(pid).items()}
            if i > 0:
                rows[mode].append(row)
                for tid, cpu in after.items():
                    name = names.get(tid, tid)
                    threads[mode][name] = threads[mode].get(name, 0.0) + (cpu - before.get(tid, 0.0)) / requests
    out: dict[str, Any] = {"length": length, "stream_over_push": _ratios(rows)}
    for mode in urls:
        busiest = sorted(threads[mode].items(), key=lambda kv: -kv[1])[:12]
        out[mode] = {"requests": rows[mode], "median": _summary(rows[mode]),
                     "threads": {name: round(cpu, 3) for name, cpu in busiest}}
        print(f"{length} tokens {mode}: {out[mode]['median']}", flush=True)
    print(f"{length} tokens stream/push prefill: {out['stream_over_push']}", flush=True)
    return out


def run_setting(model: str, setting: dict[str, Any], lengths: list[int], requests: int, work: Path,
                ucx_tls: str = "cma,tcp,self", pin: tuple[str, str] | None = None,
                transfer_cores: str | None = None, transfer_cpus: str | None = None,
                on_point: Callable[[dict[str, Any]], None] = lambda point: None) -> list[dict[str, Any]]:
    """Launch a pair with ``setting`` on the decode engine, UCX limited to ``ucx_tls``, ``transfer_cpus`` set on
    both engines, pinned with ``pin`` (prefill cores, decode cores) and the prefill's transfer threads moved to
    ``transfer_cores``; measure stream and push requests, alternating, at each of ``lengths`` in turn. Each
    point goes to ``on_point`` once measured; returns them all."""
    env = {**os.environ, "UCX_TLS": ucx_tls, "UCX_NET_DEVICES": "lo"}
    if transfer_cpus:
        env["P2PKV_TRANSFER_CPUS"] = transfer_cpus
    launcher, push = _launch(model, setting, max(lengths) + 64, work, env)
    try:
        engines = {"D": _engine_processes(BASE_PORT + 2), "P": _engine_processes(BASE_PORT + 1)}
        if pin is not None:
            keep = parse_cpus(transfer_cpus or "")
            _pin(engines["P"], pin[0], keep)
            _pin(engines["D"], pin[1], keep)
        cores = {side: _engine_core(procs) for side, procs in engines.items()}
        names = {tid: f"{side}:{name}" for side, pid in cores.items() for tid, name in _thread_names(pid).items()}
        moved = _move_threads(names, TRANSFER_THREADS, transfer_cores) if transfer_cores else []
        if transfer_cores and not moved:
            raise RuntimeError("--transfer-cores: no p2pkv transfer thread found (is py-spy installed?)")
        points = []
        for length in lengths:
            point = _measure(length, requests, cores, names, engines)
            names = {tid: f"{side}:{name}" for side, pid in cores.items()
                     for tid, name in _thread_names(pid).items()}
            point.update({"setting": setting, "ucx_tls": ucx_tls, "pin": pin, "transfer_cores": transfer_cores,
                          "moved_threads": moved, "transfer_cpus": transfer_cpus,
                          "threads_cpus": _placement(names, TRANSFER_THREADS | {"P:MainThread"})})
            points.append(point)
            on_point(point)
        return points
    finally:
        _stop(push, launcher)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (scripts/bench_stream.sh makes one)")
    parser.add_argument("--setting", action="append", default=[], help="decode engine settings, JSON (repeat)")
    parser.add_argument("--length", type=int, nargs="+", default=[1024], help="prompt tokens (one or more)")
    parser.add_argument("--requests", type=int, default=3, help="measured requests per mode and length "
                                                                "(after one warm-up)")
    parser.add_argument("--work", default=".p2pkv/stream-wait-cpu", help="logs")
    parser.add_argument("--ucx-tls", action="append", default=[],
                        help="UCX_TLS of both engines, a pair per value (default cma,tcp,self; tcp,self: every byte "
                             "over loopback TCP, with scripts/limit_ucx_tcp.sh and UCX_TCP_PORT_RANGE a link-bound "
                             "pair)")
    parser.add_argument("--pin", help='prefill and decode cores, e.g. "0 1" (taskset lists)')
    parser.add_argument("--transfer-cores", help="cores for the prefill engine's transfer threads (with py-spy)")
    parser.add_argument("--transfer-cpus", help="p2pkv's transfer_cpus setting for both engines")
    parser.add_argument("--json", required=True, help="results file")
    args = parser.parse_args()
    if "P2PKV_SECRET" not in os.environ:
        raise SystemExit("set P2PKV_SECRET (python -c 'import secrets; print(secrets.token_hex(16))')")
    settings = [json.loads(s) for s in args.setting] or [{}]
    pin = tuple(args.pin.split()) if args.pin else None
    if pin is not None and len(pin) != 2:
        raise SystemExit(f'--pin: two core lists, "prefill decode", not {args.pin!r}')
    command = " ".join(shlex.quote(a) for a in sys.argv)
    results: list[dict[str, Any]] = []

    def save(point: dict[str, Any]) -> None:
        results.append(point)
        Path(args.json).write_text(json.dumps({"command": f"python {command}", "lengths": args.length,
                                               "results": results}, indent=1) + "\n")

    for tls in args.ucx_tls or ["cma,tcp,self"]:
        for i, setting in enumerate(settings):
            run_setting(args.model, setting, args.length, args.requests,
                        Path(args.work) / f"{tls.split(',')[0]}-setting-{i}", tls, pin, args.transfer_cores,
                        args.transfer_cpus, save)


if __name__ == "__main__":
    main()
