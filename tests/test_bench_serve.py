"""``p2pkv bench serve``: the pure parts (metrics, answer and direction checks, report, plots) and one real run."""

from __future__ import annotations

import http.server
import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from p2pkv.tools.bench import handover, serve_report
from p2pkv.tools.bench.serve import ServeBenchOptions, check_directions
from p2pkv.tools.bench.serve_client import client_argv
from p2pkv.tools.bench.serve_metrics import (
    P2PKV_PULL,
    PROXY_OVERHEAD,
    delta,
    histogram_quantile,
    latency,
    parse_prometheus,
    prefill_latency,
    transfers,
)
from p2pkv.tools.bench.serve_options import DEFAULT_SYSTEMS, plan_groups
from p2pkv.tools.bench.serve_prefill import PrefillProbe, p50_p99, stream_timing
from tests.conftest import port_range

PROXY_BEFORE = """# HELP p2pkv_proxy_overhead_seconds Time the proxy itself adds
# TYPE p2pkv_proxy_overhead_seconds histogram
p2pkv_proxy_overhead_seconds_bucket{le="0.0005"} 1.0
p2pkv_proxy_overhead_seconds_bucket{le="0.001"} 1.0
p2pkv_proxy_overhead_seconds_bucket{le="0.002"} 2.0
p2pkv_proxy_overhead_seconds_bucket{le="+Inf"} 2.0
p2pkv_proxy_overhead_seconds_count 2.0
p2pkv_proxy_overhead_seconds_sum 0.0020
"""
PROXY_AFTER = """p2pkv_proxy_overhead_seconds_bucket{le="0.0005"} 2.0
p2pkv_proxy_overhead_seconds_bucket{le="0.001"} 5.0
p2pkv_proxy_overhead_seconds_bucket{le="0.002"} 8.0
p2pkv_proxy_overhead_seconds_bucket{le="+Inf"} 10.0
p2pkv_proxy_overhead_seconds_count 10.0
p2pkv_proxy_overhead_seconds_sum 0.0180
"""


def test_parse_prometheus_sums_label_sets_and_keeps_buckets() -> None:
    snap = parse_prometheus(
        '# TYPE p2pkv:pull_bytes_total counter\n'
        'p2pkv:pull_bytes_total{engine="0",model_name="model"} 100.0\n'
        'p2pkv:pull_bytes_total{engine="1",model_name="model"} 28.0\n'
        'p2pkv:pull_seconds_bucket{engine="0",le="0.001"} 3.0\n'
        'p2pkv:pull_seconds_bucket{engine="1",le="0.001"} 1.0\n'
        'p2pkv:pull_seconds_bucket{engine="0",le="+Inf"} 5.0\n'
        'plain_gauge 7 1700000000\n')
    assert snap.value("p2pkv:pull_bytes_total") == 128.0
    assert snap.value("plain_gauge") == 7.0
    assert snap.value("missing") is None
    assert snap.buckets["p2pkv:pull_seconds_bucket"] == {0.001: 4.0, math.inf: 5.0}
    with pytest.raises(ValueError):
        parse_prometheus("garbage line without value\n")


def test_the_proxys_own_time_from_the_delta_of_two_scrapes() -> None:
    ov = latency(delta(parse_prometheus(PROXY_BEFORE), parse_prometheus(PROXY_AFTER)), PROXY_OVERHEAD)
    # cumulative delta: 1, 4, 6, 8 of 8 -> the median at the end of (0.5, 1] ms
    assert ov == {"count": 8, "mean_ms": pytest.approx(2.0), "p50_ms": pytest.approx(1.0),
                  "p99_ms": pytest.approx(2.0)}  # in the +Inf bucket: the last finite bound
    assert latency(parse_prometheus("other_metric 1\n"), PROXY_OVERHEAD) is None
    assert latency(None, PROXY_OVERHEAD) is None
    assert histogram_quantile({0.001: 2, 0.002: 4, math.inf: 4}, 0.5) == pytest.approx(0.001)
    assert histogram_quantile({0.001: 1, math.inf: 4}, 0.9) == pytest.approx(0.001)  # +Inf: the last bound
    assert histogram_quantile({0.001: 0, math.inf: 0}, 0.5) is None and histogram_quantile({}, 0.5) is None


def test_transfers_of_a_point_and_their_directions() -> None:
    before = parse_prometheus("p2pkv:pull_bytes_total 1000\np2pkv:pull_seconds_sum 0.5\n"
                              "p2pkv:pull_seconds_count 5\np2pkv:pull_descriptors_sum 20\n")
    after = parse_prometheus("p2pkv:pull_bytes_total 5096\np2pkv:pull_seconds_sum 0.508\n"
                             "p2pkv:pull_seconds_count 9\np2pkv:pull_descriptors_sum 36\n")
    assert transfers(delta(before, after), P2PKV_PULL) == {
        "count": 4, "bytes": 4096, "mean_ms": pytest.approx(2.0), "descriptors_mean": pytest.approx(4.0),
        "directions": {}}
    assert transfers(parse_prometheus("vllm:other 1\n"), P2PKV_PULL) is None
    by_direction = parse_prometheus(
        'p2pkv:pull_seconds_count{engine="0"} 3\n'
        'p2pkv:pulls_by_direction_total{engine="0",model_name="m",direction="push"} 2.0\n'
        'p2pkv:pulls_by_direction_total{engine="0",model_name="m",direction="pull"} 1.0\n')
    assert transfers(by_direction, P2PKV_PULL)["directions"] == {"pull": 1, "push": 2}


def _vllm_result(**over: object) -> dict:
    base = {"completed": 4, "failed": 0, "errors": ["", "", "", ""], "generated_texts": ["a", "b", "c", "d"]}
    return {**base, **over}


def test_request_errors() -> None:
    assert serve_report.request_errors("p2pkv", 2, _vllm_result()) is None
    msg = serve_report.request_errors("nixl", 2, _vllm_result(completed=3, failed=1,
                                                              errors=["", "Traceback\nboom", "", ""]))
    assert msg is not None and "nixl at concurrency 2: 1 of 4 requests failed" in msg and "boom" in msg


def test_answer_check_passes_on_equal_and_fails_naming_the_first_difference() -> None:
    same = {1: {"p2pkv": ["x", "y"], "nixl": ["x", "y"], "aggregated": ["x", "y"]}}
    ok = serve_report.check_answers(same)
    assert ok["passed"] and ok["compared"] == 6 and ok["systems"] == ["aggregated", "nixl", "p2pkv"]
    differ = {1: {"p2pkv": ["x", "y"], "nixl": ["x", "y"], "aggregated": ["x", "Y"]},
              2: {"p2pkv": ["q"], "nixl": ["r"]}}
    with pytest.raises(serve_report.AnswerMismatch) as info:
        serve_report.check_answers(differ, "generated text", {1: ["prompt zero", "prompt one"]})
    msg = str(info.value)
    assert "concurrency 1, prompt #1 'prompt one'" in msg and "p2pkv differs from aggregated" in msg
    assert "aggregated gave ...'Y'" in msg and "p2pkv gave ...'y'" in msg
    # The odd one out is named against the single engine; systems that agree with it are listed.
    with pytest.raises(serve_report.AnswerMismatch) as info:
        serve_report.check_answers({4: {"p2pkv": ["abcd"], "nixl": ["abXd"], "aggregated": ["abcd"]}})
    msg = str(info.value)
    assert "nixl differs from aggregated from position 2 on" in msg and "p2pkv gave aggregated's answer" in msg
    with pytest.raises(serve_report.AnswerMismatch, match=r"prompt #1.*<missing>"):
        serve_report.check_answers({4: {"p2pkv": [[1, 2], [3]], "nixl": [[1, 2]]}}, "token ids")
    assert serve_report.first_difference({"p2pkv": [[5, 6]], "aggregated": [[5, 7]]}) == (0, "p2pkv", "aggregated")
    assert serve_report.first_difference({"p2pkv": [[5, 6]]}) is None


def _point(conc: int, ttft: float, tok: float, directions: dict[str, int] | None = None, legs: float | None = None,
           probe_tpot: float | None = None) -> dict:
    """A stored point: vLLM's result keys plus p2pkv's numbers."""
    probe = None if probe_tpot is None else {"requests": 3, "failed": 0, "ttft_p50_ms": 20.0, "ttft_p99_ms": 30.0,
                                             "tpot_p50_ms": probe_tpot, "tpot_p99_ms": probe_tpot, "first_error": ""}
    pair = directions is not None
    return {"max_concurrency": conc, "num_prompts": 4, "completed": 4, "failed": 0, "duration": 1.0,
            "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": 1.0, "p99_tpot_ms": 1.5,
            "request_throughput": tok / 8, "output_throughput": tok,
            "p2pkv": {"seed": 0, "second_token_p50_ms": ttft + 1.0, "answers_sha256": "x",
                      "transfers": {"count": 4, "bytes": 4096, "mean_ms": 2.5, "descriptors_mean": None,
                                    "directions": directions} if pair else None,
                      "proxy": {"count": 4, "mean_ms": 0.1, "p50_ms": 0.1, "p99_ms": 0.2} if pair else None,
                      "handover": handover.breakdown(parse_prometheus(DECODE_PHASES), parse_prometheus(PROXY_PHASES))
                      if pair else None,
                      "prefill": {"legs": {"count": 4, "mean_ms": legs, "p50_ms": legs, "p99_ms": legs},
                                  "engine_ttft": {"count": 4, "mean_ms": 5.0, "p50_ms": None, "p99_ms": None},
                                  "engine_queue_mean_ms": 0.1, "engine_prefill_mean_ms": 1.0, "probe": probe}
                      if pair else None}}


def _doc(**systems: list[dict]) -> dict:
    return {"command": "p2pkv bench serve", "config": {"model": "/m", "num_prompts": 4, "input_len": 8,
                                                       "output_len": 4, "prefix_caching": False, "concurrency": [1]},
            "machine": {"cpu_model": "cpu", "usable_cpus": 2, "versions": {"vllm": "0"}},
            "systems": {n.replace("_", "-"): {"points": pts} for n, pts in systems.items()},
            "checks": {"answers": {"passed": True, "detail": "all equal"}}}


def test_systems_sharing_engines_and_the_direction_check() -> None:
    assert DEFAULT_SYSTEMS == ("p2pkv-pull", "p2pkv-push", "nixl", "aggregated")
    assert plan_groups(DEFAULT_SYSTEMS) == [("p2pkv-pull", "p2pkv-push"), ("nixl",), ("aggregated",)]
    # shared p2pkv systems run together at the place of the first of them
    assert plan_groups(("nixl", "p2pkv-push", "aggregated", "p2pkv-pull")) == [
        ("nixl",), ("p2pkv-push", "p2pkv-pull"), ("aggregated",)]
    assert plan_groups(DEFAULT_SYSTEMS, share_engines=False) == [("p2pkv-pull",), ("p2pkv-push",), ("nixl",),
                                                                 ("aggregated",)]
    doc = _doc(p2pkv_pull=[_point(1, 10.0, 100.0, {"pull": 4})], p2pkv_push=[_point(1, 9.0, 110.0, {"pull": 1,
                                                                                                   "push": 3})])
    check = check_directions(doc["systems"])
    assert not check["passed"] and "p2pkv-push: 3 of 4 transfers went push" in check["detail"]
    doc["systems"]["p2pkv-push"]["points"] = [_point(1, 9.0, 110.0, {"push": 4})]
    assert check_directions(doc["systems"]) == {"passed": True,
                                                "detail": "p2pkv-pull: all 4 pull; p2pkv-push: all 4 push"}
    doc["systems"]["p2pkv-push"]["points"][0]["p2pkv"]["transfers"] = None
    assert not check_directions(doc["systems"])["passed"]  # nothing seen is not a pass


def test_report_and_plots_of_a_document(tmp_path: Path) -> None:
    """The report's tables and push / pull ratios come from vLLM's keys and p2pkv's numbers; both plots draw."""
    doc = _doc(p2pkv_pull=[_point(1, 10.0, 100.0, {"pull": 4}, legs=40.0, probe_tpot=2.0)],
               p2pkv_push=[_point(1, 9.0, 110.0, {"push": 4}, legs=42.0, probe_tpot=2.5)],
               aggregated=[_point(1, 5.0, 200.0)])
    table = serve_report.format_table(doc)
    assert "TTFT p50" in table and "push 4" in table and "prefill engine's own latency" in table
    assert "p2pkv-push / p2pkv-pull" in table and "answers: passed" in table
    ratios = serve_report.ratio_lines(doc)[1].splitlines()[-1].split()
    assert ratios[:4] == ["1", "0.900", "1.000", "1.100"] and ratios[-1] == "1.250"  # TTFT, TPOT, tok/s, probe
    assert " 3/4" in "\n".join(handover.format_breakdown(doc["systems"]))
    assert serve_report.ratio_lines(_doc(aggregated=[_point(1, 5.0, 200.0)])) == []
    assert "p2pkv-pull" in serve_report.point_line("p2pkv-pull", doc["systems"]["p2pkv-pull"]["points"][0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert serve_report.plot(doc, tmp_path / "s.png") and handover.plot(doc["systems"], tmp_path / "h.png")
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "h.png").stat().st_size > 0


def test_prefill_latency_from_scrapes_and_the_probes_stream() -> None:
    proxy = parse_prometheus('p2pkv_proxy_prefill_seconds_bucket{le="0.01"} 0\n'
                             'p2pkv_proxy_prefill_seconds_bucket{le="0.05"} 8\n'
                             'p2pkv_proxy_prefill_seconds_bucket{le="+Inf"} 8\n'
                             "p2pkv_proxy_prefill_seconds_count 8\np2pkv_proxy_prefill_seconds_sum 0.24\n")
    engine = parse_prometheus('vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02"} 6\n'
                              'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 10\n'
                              'vllm:time_to_first_token_seconds_count{engine="0"} 10\n'
                              'vllm:time_to_first_token_seconds_sum{engine="0"} 0.2\n'
                              'vllm:request_queue_time_seconds_count{engine="0"} 10\n'
                              'vllm:request_queue_time_seconds_sum{engine="0"} 0.005\n')
    pre = prefill_latency(engine, proxy)
    assert pre is not None and pre["engine_prefill_mean_ms"] is None
    assert pre["legs"] == {"count": 8, "mean_ms": pytest.approx(30.0), "p50_ms": pytest.approx(30.0),
                           "p99_ms": pytest.approx(49.6)}  # inside (10, 50] ms, linearly
    assert pre["engine_ttft"]["count"] == 10 and pre["engine_ttft"]["mean_ms"] == pytest.approx(20.0)
    assert pre["engine_ttft"]["p99_ms"] == pytest.approx(20.0)  # in the +Inf bucket: the last finite bound
    assert pre["engine_queue_mean_ms"] == pytest.approx(0.5)
    assert pre["stream_tail"] is None and pre["streams"] == {}, "an engine that streamed nothing (or not p2pkv's)"
    streamed = parse_prometheus('p2pkv:stream_tail_seconds_bucket{engine="0",le="0.1"} 1\n'
                                'p2pkv:stream_tail_seconds_bucket{engine="0",le="0.25"} 2\n'
                                'p2pkv:stream_tail_seconds_bucket{engine="0",le="+Inf"} 2\n'
                                'p2pkv:stream_tail_seconds_count{engine="0"} 2\n'
                                'p2pkv:stream_tail_seconds_sum{engine="0"} 0.3\n'
                                'p2pkv:streams_landed_total{engine="0",how="per_layer"} 1\n'
                                'p2pkv:streams_landed_total{engine="0",how="whole"} 1\n')
    assert prefill_latency(streamed, None)["stream_tail"]["mean_ms"] == pytest.approx(150.0)
    assert prefill_latency(streamed, None)["streams"] == {"per_layer": 1, "whole": 1}
    assert prefill_latency(None, None) is None

    ticks = iter([1.010, 1.012, 1.030])  # three chunks with text after the request was sent at 1.000
    lines = ["", 'data: {"choices": [{"text": "a"}]}', 'data: {"choices": [{"text": ""}]}',
             'data: {"choices": [{"text": "b"}]}', 'data: {"choices": [{"text": "cd"}]}',
             'data: {"choices": [], "usage": {"completion_tokens": 5}}', "data: [DONE]"]
    ttft, span, tokens = stream_timing(lines, 1.0, clock=lambda: next(ticks))
    assert (ttft, span, tokens) == (pytest.approx(0.010), pytest.approx(0.020), 5)
    with pytest.raises(ValueError):
        stream_timing(["data: [DONE]"], 0.0)
    assert p50_p99([4.0, 1.0, 2.0, 3.0]) == (2.5, pytest.approx(3.97)) and p50_p99([]) == (None, None)


class _Completions(http.server.BaseHTTPRequestHandler):
    """A streamed ``/v1/completions`` stand-in: ``server.chunks`` is what every answer carries."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in self.server.chunks:  # type: ignore[attr-defined]
            self.wfile.write(f"data: {chunk}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("chunks", "requests", "error"), [
    (['{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}'], 1, ""),
    (['{"choices": 5}'], 0, "TypeError"),  # a stream it cannot read is a failure, not a dead thread
], ids=["answers", "unreadable"])
def test_the_probe_measures_at_least_one_request_per_point(chunks: list[str], requests: int, error: str) -> None:
    """Stopped as soon as it started (a point shorter than one probe request), the probe still sends
    and reports one request; any failure is counted with its name."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    server.chunks = chunks  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = PrefillProbe(f"http://127.0.0.1:{server.server_address[1]}", 8, 2, seed=0).start().stop()
    finally:
        server.shutdown()
        server.server_close()
    assert (result["requests"], result["failed"]) == (requests, 1 - requests)
    assert result["first_error"].startswith(error) and bool(result["first_error"]) == bool(error)
    if requests:
        assert result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] >= 0


def test_client_flags_and_options(tmp_path: Path) -> None:
    opts = ServeBenchOptions(num_prompts=8, input_len=64, output_len=16, dataset="random")
    argv = client_argv(opts, "/m", 4, 3, tmp_path, "http://h:1", "p2pkv")
    flags = " ".join(argv)
    for expected in ("--dataset-name random", "--random-input-len 64", "--random-output-len 16", "--seed 3",
                     "--max-concurrency 4", "--num-prompts 8", "--temperature 0", "--ignore-eos",
                     "--save-result", "--save-detailed", "--metric-percentiles 50,90,99", "--base-url http://h:1",
                     "--result-filename p2pkv-c4.json"):
        assert expected in flags
    assert "--extra-body" not in argv
    text = " ".join(client_argv(ServeBenchOptions(num_prompts=8, input_len=64, output_len=16), "/m", 4, 3, tmp_path))
    prompts = tmp_path / "prompts" / "text-64-8-3.jsonl"
    assert f"--dataset-name custom --dataset-path {prompts} --custom-output-len 16 --skip-chat-template" in text
    assert prompts.exists() and "--random-input-len" not in text
    salted = client_argv(opts, "/m", 4, 3, tmp_path, cache_salt="s-1")
    assert json.loads(salted[salted.index("--extra-body") + 1]) == {"cache_salt": "s-1"}
    opts = ServeBenchOptions(extra_engine_args=("--max-num-seqs", "8"))
    assert opts.engine_args() == ("--no-enable-prefix-caching", "--max-num-seqs", "8")
    assert ServeBenchOptions(prefix_caching=True).engine_args() == ()
    for bad in (ServeBenchOptions(systems=("p2pkv", "vllm")), ServeBenchOptions(concurrency=(0,)),
                ServeBenchOptions(systems=("p2pkv-push", "p2pkv-push")), ServeBenchOptions(concurrency=(2, 2)),
                ServeBenchOptions(num_prompts=0), ServeBenchOptions(warmup=-1), ServeBenchOptions(dataset="sharegpt"),
                ServeBenchOptions(first_token_from="proxy"), ServeBenchOptions(p2pkv_engines=("http://p:1",)),
                ServeBenchOptions(token_check_prompts=-1)):
        with pytest.raises(ValueError):
            bad.validate()


def test_attaching_to_a_running_pair_needs_its_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    attached = ServeBenchOptions(p2pkv_engines=("http://127.0.0.1:1", "http://127.0.0.1:2"))
    monkeypatch.delenv("P2PKV_SECRET", raising=False)
    with pytest.raises(ValueError, match="set P2PKV_SECRET to the running pair's secret"):
        attached.validate()
    monkeypatch.setenv("P2PKV_SECRET", "0123456789abcdef")
    attached.validate()


def test_text_prompts_are_readable_seeded_and_as_long_as_asked(tmp_path: Path) -> None:
    from p2pkv.tools.bench.serve_client import TEXT_ALPHABET, write_text_prompts

    first = write_text_prompts(tmp_path / "a.jsonl", 3, 50, seed=7).read_text().splitlines()
    again = write_text_prompts(tmp_path / "b.jsonl", 3, 50, seed=7).read_text().splitlines()
    other = write_text_prompts(tmp_path / "c.jsonl", 3, 50, seed=8).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in first]
    assert first == again and first != other and len(set(prompts)) == 3
    assert all(len(p) == 50 and set(p) <= set(TEXT_ALPHABET) for p in prompts)


def test_cli_parses_bench_serve() -> None:
    from p2pkv.tools.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1,8", "--systems", "p2pkv",
                                      "--extra-engine-args=--max-num-seqs 4"])
    assert args.concurrency == (1, 8) and args.systems == "p2pkv" and args.extra_engine_args == "--max-num-seqs 4"


def test_engine_spec_appends_extra_args() -> None:
    from p2pkv.tools.deploy.engines import EngineSpec
    from p2pkv.tools.deploy.local import LocalPair

    argv = EngineSpec(name="a", model="m", port=1, extra_args=("--no-enable-prefix-caching",)).command()
    assert argv[-1] == "--no-enable-prefix-caching"
    specs = LocalPair(model="m", engine_args=("--foo",), tensor_parallel_size=2).engine_specs()
    assert all(s.command()[-1] == "--foo" and s.tensor_parallel_size == 2 for s in specs)


def _free_base_port() -> int:
    """A base port whose +0..+600 ports (step 100) and +601 are all free on 127.0.0.1."""
    for _ in range(200):
        low, high = port_range()
        base = random.randrange(low, high - 700, 10)
        try:
            for off in (*range(0, 700, 100), 601):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free base port")


@pytest.mark.engines
def test_bench_serve_end_to_end(tiny_model: Path, tmp_path: Path, pair) -> None:
    """All four systems, one concurrency point, the prefill probe on: the p2pkv systems on the engine tests'
    shared pair (``--p2pkv-engines``: a proxy per system, each with its own cache_salt, so push is not served
    from pull's cached prompts), the aggregated system on its aggregated engine, NixlConnector on a pair the
    bench starts: exit 0, answers equal, every transfer in its system's direction, JSON and plots written."""
    shared, _ = pair
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "p2pkv.tools.cli", "bench", "serve", "--model", str(tiny_model),
           "--concurrency", "2", "--num-prompts", "4", "--warmup", "1", "--input-len", "80", "--output-len", "6",
           "--base-port", str(_free_base_port()), "--work-dir", str(tmp_path / "work"), "--prefill-probe",
           "--p2pkv-engines", f"{shared.url('prefill')},{shared.url('decode')}",
           "--aggregated-engine", shared.url("aggregated"), "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "P2PKV_SECRET": shared.secret})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    result = json.loads(out_json.read_text())
    assert list(result["systems"]) == ["p2pkv-pull", "p2pkv-push", "nixl", "aggregated"]
    assert result["systems"]["p2pkv-push"]["engines"] == ["p2pkv-pull", "p2pkv-push"]  # one pair, two proxies
    for name, sys_result in result["systems"].items():
        (point,) = sys_result["points"]  # vLLM's own result of the point, without the per-request lists
        assert point["completed"] == 4 and point["failed"] == 0 and point["max_concurrency"] == 2, name
        assert point["output_throughput"] > 0 and point["median_ttft_ms"] > 0 and point["label"] == name, name
        assert "generated_texts" not in point and "ttfts" not in point, name
        assert point["p2pkv"]["second_token_p50_ms"] > point["median_ttft_ms"] * 0.5, name
    for name, direction in (("p2pkv-pull", "pull"), ("p2pkv-push", "push")):
        extra = result["systems"][name]["points"][0]["p2pkv"]
        assert extra["transfers"]["bytes"] > 0 and extra["transfers"]["count"] >= 4, name
        assert extra["transfers"]["directions"] == {direction: extra["transfers"]["count"]}, name
        assert extra["proxy"]["count"] == 4, name
        first = extra["handover"]
        assert first["first_token_from_prefill"] + first["first_token_from_decode"] == 4  # vLLM's client streams
        assert first["read"] > 0 and first["confirm"] is not None, name
    for name in ("p2pkv-pull", "p2pkv-push", "nixl"):
        prefill = result["systems"][name]["points"][0]["p2pkv"]["prefill"]
        assert prefill["legs"]["count"] == 4 and prefill["legs"]["mean_ms"] > 0, name
        assert prefill["engine_ttft"]["count"] >= 4 + prefill["probe"]["requests"], name
        assert prefill["probe"]["requests"] >= 1 and prefill["probe"]["failed"] == 0, (name, prefill["probe"])
        assert prefill["probe"]["tpot_p50_ms"] > 0, name
    aggregated = result["systems"]["aggregated"]["points"][0]["p2pkv"]
    assert aggregated["transfers"] is None and aggregated["prefill"] is None
    assert all(c["passed"] for c in result["checks"].values()), result["checks"]
    assert result["checks"]["tokens"]["compared"] == 16
    assert "p2pkv-push: all 4 push" in result["checks"]["directions"]["detail"]
    assert len({p["p2pkv"]["answers_sha256"] for s in result["systems"].values() for p in s["points"]}) == 1
    assert "bench serve" in result["command"] and result["machine"]["versions"].get("vllm")
    assert "TTFT p50" in proc.stdout and "p2pkv-push / p2pkv-pull" in proc.stdout and "handover" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out_png.stat().st_size > 0 and (tmp_path / "serve-handover.png").stat().st_size > 0


DECODE_PHASES = """p2pkv:pull_phase_seconds_bucket{engine="0",phase="read",le="0.0005"} 3.0
p2pkv:pull_phase_seconds_bucket{engine="0",phase="read",le="0.001"} 4.0
p2pkv:pull_phase_seconds_bucket{engine="0",phase="read",le="+Inf"} 4.0
p2pkv:pull_phase_seconds_count{engine="0",phase="read"} 4.0
p2pkv:pull_phase_seconds_sum{engine="0",phase="read"} 0.002
p2pkv:pull_phase_seconds_count{engine="0",phase="confirm"} 4.0
p2pkv:pull_phase_seconds_sum{engine="0",phase="confirm"} 0.008
vllm:time_to_first_token_seconds_count{engine="0"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0"} 0.04
"""
PROXY_PHASES = """p2pkv_proxy_prefill_seconds_count 4.0
p2pkv_proxy_prefill_seconds_sum 0.1
p2pkv_proxy_decode_first_byte_seconds_count 4.0
p2pkv_proxy_decode_first_byte_seconds_sum 0.06
p2pkv_proxy_first_tokens_total{source="prefill"} 3.0
p2pkv_proxy_first_tokens_total{source="decode"} 1.0
"""


def test_handover_breakdown_per_phase() -> None:
    """Phase-labelled histograms stay apart; means in ms; second-token times from vLLM's lists."""
    b = handover.breakdown(delta(parse_prometheus(""), parse_prometheus(DECODE_PHASES)),
                           parse_prometheus(PROXY_PHASES))
    assert b["read"] == pytest.approx(0.5) and b["confirm"] == pytest.approx(2.0)
    assert b["prefill"] == pytest.approx(25.0) and b["decode_first_byte"] == pytest.approx(15.0)
    assert b["decode_ttft"] == pytest.approx(10.0)
    assert b["queue"] is None and b["proxy"] is None  # not exported in these scrapes
    assert (b["first_token_from_prefill"], b["first_token_from_decode"]) == (3, 1)
    nixl = handover.breakdown(parse_prometheus("vllm:nixl_xfer_time_seconds_count 2\n"
                                               "vllm:nixl_xfer_time_seconds_sum 0.01\n"), None)
    assert nixl["read"] == pytest.approx(5.0) and nixl["confirm"] is None and nixl["prefill"] is None
    second = handover.second_token_p50_ms({"ttfts": [0.010, 0.020, 0.030], "itls": [[0.001, 0.5], [0.002], []]})
    assert second == pytest.approx(16.5)  # 11 and 22 ms; the request without a second token is left out
    assert handover.second_token_p50_ms({}) is None
    # without the queue phase (NixlConnector's case) the rest of the decode leg is its first byte - read
    assert handover.stack_of(b) == pytest.approx([25.0, 0.0, 0.0, 0.0, 0.5, 2.0, 14.5, 0.0])
