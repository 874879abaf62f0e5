"""``p2pkv bench serve``: the pure parts (metrics parsing, answer checks, targets) and one real run."""

from __future__ import annotations

import json
import math
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from p2pkv.tools.bench import handover, serve_report
from p2pkv.tools.bench.serve import ServeBenchOptions
from p2pkv.tools.bench.serve_client import ClientPoint
from p2pkv.tools.bench.serve_metrics import (
    P2PKV_PULL,
    delta,
    histogram_p50_bound,
    parse_prometheus,
    proxy_overhead,
    pull_stats,
)

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
        'garbage line without value\n'
        'plain_gauge 7 1700000000\n')
    assert snap.value("p2pkv:pull_bytes_total") == 128.0
    assert snap.value("plain_gauge") == 7.0
    assert snap.value("missing") is None
    assert snap.buckets["p2pkv:pull_seconds_bucket"] == {0.001: 4.0, math.inf: 5.0}


def test_histogram_p50_bound() -> None:
    assert histogram_p50_bound({0.0005: 3, 0.001: 8, 0.002: 10, math.inf: 10}) == 0.001
    assert histogram_p50_bound({0.0005: 5, 0.001: 8, math.inf: 10}) == 0.0005  # exactly half
    assert histogram_p50_bound({0.001: 0, 0.002: 1, math.inf: 4}) == math.inf
    assert histogram_p50_bound({0.001: 0, math.inf: 0}) is None
    assert histogram_p50_bound({}) is None


def test_proxy_overhead_from_the_delta_of_two_scrapes() -> None:
    ov = proxy_overhead(delta(parse_prometheus(PROXY_BEFORE), parse_prometheus(PROXY_AFTER)))
    assert ov is not None
    assert ov["requests"] == 8
    # cumulative delta: 1, 4, 6, 8 of 8 -> the median lies in (0.5, 1] ms
    assert ov["p50_bound_ms"] == pytest.approx(1.0)
    assert ov["mean_ms"] == pytest.approx(2.0)  # 16 ms over 8 requests
    assert ov["prefill_mean_ms"] is None  # no prefill histogram in these scrapes
    with_prefill = parse_prometheus(PROXY_AFTER + "p2pkv_proxy_prefill_seconds_count 4\n"
                                                  "p2pkv_proxy_prefill_seconds_sum 0.1\n")
    assert proxy_overhead(with_prefill)["prefill_mean_ms"] == pytest.approx(25.0)
    assert proxy_overhead(parse_prometheus("other_metric 1\n")) is None


def test_pull_stats_of_a_point() -> None:
    before = parse_prometheus("p2pkv:pull_bytes_total 1000\np2pkv:pull_seconds_sum 0.5\n"
                              "p2pkv:pull_seconds_count 5\np2pkv:pull_descriptors_sum 20\n")
    after = parse_prometheus("p2pkv:pull_bytes_total 5096\np2pkv:pull_seconds_sum 0.508\n"
                             "p2pkv:pull_seconds_count 9\np2pkv:pull_descriptors_sum 36\n")
    stats = pull_stats(delta(before, after), P2PKV_PULL)
    assert stats == {"pulls": 4, "bytes": 4096, "seconds_total": pytest.approx(0.008),
                     "mean_ms": pytest.approx(2.0), "descriptors_mean": pytest.approx(4.0)}
    assert pull_stats(parse_prometheus("vllm:other 1\n"), P2PKV_PULL) is None


def _vllm_result(**over: object) -> dict:
    base = {"completed": 4, "failed": 0, "duration": 2.0, "request_throughput": 2.0, "output_throughput": 16.0,
            "total_output_tokens": 32, "mean_ttft_ms": 11.0, "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
            "mean_tpot_ms": 3.0, "median_tpot_ms": 2.5, "p99_tpot_ms": 4.0, "mean_itl_ms": 3.0,
            "median_itl_ms": 2.0, "p99_itl_ms": 9.0, "errors": ["", "", "", ""],
            "generated_texts": ["a", "b", "c", "d"]}
    return {**base, **over}


def test_point_summary_reads_vllm_result() -> None:
    import numpy as np

    p = serve_report.point_summary(_vllm_result(median_ttft_ms=np.float64(10.0)))
    assert p["ttft_ms"] == {"mean": 11.0, "p50": 10.0, "p99": 20.0}
    assert type(p["ttft_ms"]["p50"]) is float  # numpy scalars would break JSON and the `is False` checks
    assert p["tpot_ms"]["p99"] == 4.0 and p["itl_ms"]["p50"] == 2.0
    assert p["e2el_ms"] == {"mean": None, "p50": None, "p99": None}
    assert (p["completed"], p["request_throughput"], p["output_throughput"]) == (4, 2.0, 16.0)
    with pytest.raises(KeyError):
        serve_report.point_summary({})


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


def _result(p2pkv_ttft: float, nixl_ttft: float, agg_ttft: float, pull_ms: float, p2pkv_tok: float,
            nixl_tok: float, proxy_p50: float) -> dict:
    def point(ttft: float, tok: float, pull: float | None, proxy: float | None) -> dict:
        return {"concurrency": 1, "ttft_ms": {"mean": ttft, "p50": ttft, "p99": 2 * ttft},
                "tpot_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.0}, "itl_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.0},
                "request_throughput": tok / 8, "output_throughput": tok,
                "pull": None if pull is None else {"pulls": 4, "bytes": 4096, "mean_ms": pull},
                "proxy_overhead": None if proxy is None else {"p50_bound_ms": proxy, "mean_ms": proxy / 2}}
    return {"config": {"concurrency": [1], "model": "m", "num_prompts": 4, "input_len": 8, "output_len": 8,
                       "block_size": 32, "dtype": "float32", "prefix_caching": False},
            "machine": {"cpu_model": "cpu", "usable_cpus": 2, "mem_total_bytes": 2**30, "versions": {}},
            "systems": {"p2pkv": {"points": [point(p2pkv_ttft, p2pkv_tok, pull_ms, proxy_p50)]},
                        "nixl": {"points": [point(nixl_ttft, nixl_tok, 3.0, proxy_p50)]},
                        "aggregated": {"points": [point(agg_ttft, 100.0, None, None)]}},
            "checks": {"answers": {"passed": True, "detail": "ok"}}}


def test_ratios_and_targets() -> None:
    good = _result(p2pkv_ttft=110.0, nixl_ttft=120.0, agg_ttft=90.0, pull_ms=10.0, p2pkv_tok=100.0,
                   nixl_tok=90.0, proxy_p50=1.0)
    (r,) = serve_report.ratios(good)
    assert r["ttft_p50"] == pytest.approx(110 / 120) and r["output_throughput"] == pytest.approx(100 / 90)
    targets = {t["name"]: t for t in serve_report.evaluate_targets(good)}
    assert targets["p2pkv_vs_nixl"]["met"] is True
    assert targets["p2pkv_ttft_vs_aggregated"]["met"] is True  # 110 <= (90 + 10) * 1.1
    assert targets["p2pkv_ttft_vs_aggregated"]["measured"][1]["limit_ms"] == pytest.approx(110.0)
    assert targets["proxy_overhead_p50"]["met"] is True

    bad = _result(p2pkv_ttft=110.5, nixl_ttft=100.0, agg_ttft=90.0, pull_ms=10.0, p2pkv_tok=100.0,
                  nixl_tok=101.0, proxy_p50=5.0)
    targets = {t["name"]: t for t in serve_report.evaluate_targets(bad)}
    assert all(t["met"] is False for t in targets.values())
    assert targets["p2pkv_vs_nixl"]["measured"][1]["output_throughput"]["met"] is False
    table = serve_report.format_table({**bad, "ratios": serve_report.ratios(bad),
                                       "targets": serve_report.evaluate_targets(bad)})
    assert "NOT met" in table and "p2pkv / NixlConnector" in table

    only = _result(110.0, 120.0, 90.0, 10.0, 100.0, 90.0, 1.0)
    del only["systems"]["nixl"]
    targets = {t["name"]: t for t in serve_report.evaluate_targets(only)}
    assert targets["p2pkv_vs_nixl"]["met"] is None and serve_report.ratios(only) == []
    assert targets["proxy_overhead_p50"]["met"] is True


def test_client_flags_and_options() -> None:
    argv = ClientPoint("http://h:1", "/m", "p2pkv", 4, 8, 64, 16, 3, "/r", "f.json", "x-").argv()
    flags = " ".join(argv)
    for expected in ("--dataset-name random", "--random-input-len 64", "--random-output-len 16", "--seed 3",
                     "--max-concurrency 4", "--num-prompts 8", "--temperature 0", "--ignore-eos",
                     "--save-result", "--save-detailed", "--metric-percentiles 50,99", "--base-url http://h:1"):
        assert expected in flags
    text = " ".join(ClientPoint("http://h:1", "/m", "p2pkv", 4, 8, 64, 16, 3, "/r", "f.json", "x-",
                                dataset_path="/p.jsonl").argv())
    assert "--dataset-name custom --dataset-path /p.jsonl --custom-output-len 16 --skip-chat-template" in text
    assert "--random-input-len" not in text
    opts = ServeBenchOptions(extra_engine_args=("--max-num-seqs", "8"))
    assert opts.engine_args() == ("--no-enable-prefix-caching", "--max-num-seqs", "8")
    assert ServeBenchOptions(prefix_caching=True).engine_args() == ()
    for bad in (ServeBenchOptions(systems=("p2pkv", "vllm")), ServeBenchOptions(concurrency=(0,)),
                ServeBenchOptions(num_prompts=0), ServeBenchOptions(dataset="sharegpt"),
                ServeBenchOptions(first_token_from="proxy")):
        with pytest.raises(ValueError):
            bad.validate()


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
    """A base port whose +0..+500 ports (step 100) are all free on 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(20000, 40000, 10)
        try:
            for off in range(0, 600, 100):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free base port")


@pytest.mark.engines
def test_bench_serve_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    """All three systems, one concurrency point: exit 0, answers equal, pulls seen, JSON and plot written."""
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "p2pkv.tools.cli", "bench", "serve", "--model", str(tiny_model),
           "--concurrency", "2", "--num-prompts", "4", "--input-len", "80", "--output-len", "6",
           "--base-port", str(_free_base_port()), "--work-dir", str(tmp_path / "work"),
           "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    result = json.loads(out_json.read_text())
    assert list(result["systems"]) == ["p2pkv", "nixl", "aggregated"]
    for name, sys_result in result["systems"].items():
        (point,) = sys_result["points"]
        assert point["completed"] == 4 and point["failed"] == 0, name
        assert point["output_throughput"] > 0 and point["request_throughput"] > 0, name
        assert point["ttft_ms"]["p50"] > 0, name
    p2pkv_point = result["systems"]["p2pkv"]["points"][0]
    assert p2pkv_point["pull"]["bytes"] > 0 and p2pkv_point["pull"]["pulls"] >= 4
    assert p2pkv_point["proxy_overhead"]["requests"] == 4
    first = p2pkv_point["handover"]
    assert first["first_token_from_prefill"] + first["first_token_from_decode"] == 4  # vLLM's client streams
    assert result["systems"]["aggregated"]["points"][0]["pull"] is None
    assert all(c["passed"] for c in result["checks"].values()), result["checks"]
    assert result["checks"]["tokens"]["compared"] == 12
    assert len({p["answers_sha256"] for s in result["systems"].values() for p in s["points"]}) == 1
    assert "bench serve" in result["command"] and result["machine"]["versions"].get("vllm")
    assert "TTFT p50" in proc.stdout and "targets:" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out_png.stat().st_size > 0


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


def test_handover_breakdown_per_phase_and_targets() -> None:
    """Phase-labelled histograms stay apart; means in ms; second-token times from vLLM's lists; the targets."""
    b = handover.breakdown(delta(parse_prometheus(""), parse_prometheus(DECODE_PHASES)),
                           parse_prometheus(PROXY_PHASES))
    assert b["read"] == pytest.approx(0.5) and b["confirm"] == pytest.approx(2.0)
    assert b["prefill"] == pytest.approx(25.0) and b["decode_first_byte"] == pytest.approx(15.0)
    assert b["decode_ttft"] == pytest.approx(10.0) and b["read_p50_bound_ms"] == pytest.approx(0.5)
    assert b["queue"] is None and b["proxy"] is None  # not exported in these scrapes
    assert (b["first_token_from_prefill"], b["first_token_from_decode"]) == (3, 1)
    nixl = handover.breakdown(parse_prometheus("vllm:nixl_xfer_time_seconds_count 2\n"
                                               "vllm:nixl_xfer_time_seconds_sum 0.01\n"), None)
    assert nixl["read"] == pytest.approx(5.0) and nixl["confirm"] is None and nixl["prefill"] is None
    second = handover.second_token_ms({"ttfts": [0.010, 0.020, 0.030], "itls": [[0.001, 0.5], [0.002], []]})
    assert second["p50"] == pytest.approx(16.5)  # 11 and 22 ms; the request without a second token is left out

    result = _result(p2pkv_ttft=12.0, nixl_ttft=30.0, agg_ttft=10.0, pull_ms=1.0, p2pkv_tok=1.0, nixl_tok=1.0,
                     proxy_p50=1.0)
    for name, second_p50 in (("p2pkv", 25.0), ("aggregated", 12.0)):
        point = result["systems"][name]["points"][0]
        point["second_token_ms"] = {"p50": second_p50, "p99": second_p50}
        point["handover"] = b
    targets = {t["name"]: t for t in handover.evaluate(result)}
    assert targets["ttft_vs_aggregated"]["met"] is True  # 12 <= 1.3 x 10
    assert targets["ttft_vs_nixl"]["met"] is True  # 12 <= 15 and 24 <= 30
    assert targets["second_token_vs_aggregated"]["met"] is False  # 25 > 2 x 12
    assert targets["tpot_vs_aggregated"]["met"] is True and targets["read_p50"]["met"] is True
    table = "\n".join(handover.format_breakdown(result))
    assert "decode_first_byte" in table and " 3/4" in table
