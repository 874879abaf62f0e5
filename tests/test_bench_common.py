"""What the ``p2pkv bench`` commands share: text tables, plot setup, the machine record, the CLI's bench table."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from p2pkv.tools.bench import machine, plotting, table
from p2pkv.tools.bench.results import median_interval, pairs_needed
from p2pkv.tools.cli import BENCHES, build_parser
from tests.script_loader import load_script


def test_grid_right_aligns_every_column_to_its_widest_cell() -> None:
    assert table.grid_lines(["a", "bbb"], [["10", "x"], ["2", "yyyy"]]) == [
        " a   bbb", "--  ----", "10     x", " 2  yyyy"]
    assert table.grid(["a", "bbb"], [["10", "x"]]) == " a  bbb\n--  ---\n10    x"
    assert table.grid_lines(["name", "n"], []) == ["name  n", "----  -"]  # no rows: the header alone
    for short_or_long in (["1"], ["1", "2", "3"]):
        with pytest.raises(ValueError, match="2 cells"):
            table.grid_lines(["a", "b"], [["1", "2"], short_or_long])


def test_cell_values() -> None:
    assert (table.number(None), table.number(1.25), table.number(1.25, ".2f")) == ("n/a", "1.2", "1.25")
    assert [table.yes_no(v) for v in (True, False, None)] == ["yes", "NO", "-"]



def test_median_interval_holds_the_median_and_narrows_with_more_samples() -> None:
    few = [0.8, 0.9, 1.0, 1.1, 1.3]
    lo, hi = median_interval(few)
    assert lo <= 1.0 <= hi and (lo, hi) == median_interval(few), "seeded: the same samples, the same interval"
    assert min(few) <= lo < hi <= max(few)
    many = few * 8  # the same spread, eight times the samples
    lo8, hi8 = median_interval(many)
    assert lo8 <= 1.0 <= hi8 and hi8 - lo8 < hi - lo
    assert median_interval([1.2] * 6) == (1.2, 1.2)
    with pytest.raises(ValueError, match="median_interval"):
        median_interval([])
    with pytest.raises(ValueError, match="median_interval"):
        median_interval([1.0], resamples=10)


def test_pairs_needed_grows_with_the_spread_and_with_a_tighter_margin() -> None:
    assert pairs_needed(0.1, 0.05) == 17  # (1.96 * 0.1 / ln 1.05)^2 = 16.1
    assert pairs_needed(0.1, 0.02) == 98  # (1.96 * 0.1 / ln 1.02)^2 = 97.9
    assert pairs_needed(0.2, 0.05) == 65 and pairs_needed(0.0, 0.05) == 1
    for bad in ((-0.1, 0.05), (0.1, 0.0)):
        with pytest.raises(ValueError, match="pairs_needed"):
            pairs_needed(*bad)


def test_host_noise_times_one_workload_and_says_how_many_pairs_its_spread_needs(tmp_path) -> None:
    host_noise = load_script("host_noise")
    same = host_noise.summary([1.0, 1.0, 2.0, 2.0])
    assert same["cv"] > 0.3 and same["pair_log_sd"] == 0.0 and same["pairs_needed"] == {"2%": 1, "5%": 1}, (
        "drift between pairs is not a pair's spread")
    spread = host_noise.summary([1.0, 1.1, 1.0, 0.9, 1.0, 1.1])
    assert spread["pair_log_sd"] > 0.05 and spread["pairs_needed"]["2%"] > spread["pairs_needed"]["5%"] > 1
    with pytest.raises(ValueError, match="at least 4"):
        host_noise.summary([1.0, 1.0, 1.0])
    result = host_noise.main(["--intervals", "4", "--seconds", "0.02", "--json", str(tmp_path / "noise.json")])
    assert len(result["times_s"]) == 4 and all(t > 0 for t in result["times_s"])
    assert (tmp_path / "noise.json").read_text().count('"pairs_needed"') == 1


def test_pyplot_says_what_is_missing_without_matplotlib(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plotting.pyplot("p2pkv bench serve", "handover plot") is None
    assert capsys.readouterr().err == ("p2pkv bench serve: matplotlib is not installed (pip install "
                                       "'p2pkv[bench]'); no handover plot\n")


def test_save_writes_the_png_into_a_new_folder(tmp_path) -> None:
    plt = plotting.pyplot("test")
    if plt is None:
        pytest.skip("matplotlib is not installed")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    path = tmp_path / "new" / "plot.png"
    plotting.save(fig, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.get_fignums()  # closed


def test_machine_record() -> None:
    assert machine.command_line(["/usr/local/bin/p2pkv", "bench", "serve", "--x", "a b"]) == (
        "p2pkv bench serve --x 'a b'")
    assert machine.command_line(["p2pkv/tools/bench/serve.py"]) == "python -m p2pkv.tools.bench.serve"
    assert machine.command_line(["other.py", "x"]) == "other.py x"
    assert machine.version("no-such-dist-p2pkv", "pytest") == pytest.__version__
    assert machine.version("no-such-dist-p2pkv") is None
    info = machine.machine_info("cpu")
    assert info["usable_cpus"] >= 1 and info["mem_total_bytes"] >= 0 and info["device"]["type"] == "cpu"


@pytest.mark.parametrize("name", [b[0] for b in BENCHES])
def test_every_bench_in_the_table_parses_and_runs_its_module(name: str, capsys) -> None:
    _, help_text, module_path, add_arguments, run = next(b for b in BENCHES if b[0] == name)
    module = importlib.import_module(module_path)
    assert callable(getattr(module, add_arguments))
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: p2pkv bench {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    assert "".join(help_text.split()) in "".join(capsys.readouterr().out.split())  # wrapped by argparse
    args = parser.parse_args(["bench", name])
    assert args.bench_command == name and args.func is getattr(module, run)


def test_the_command_parses_on_a_gpu_node_without_the_proxy_dependencies() -> None:
    """`p2pkv doctor` runs where FastAPI/Starlette are not installed (a GPU node that only moves KV caches;
    the H200 check in docs/benchmarks/transfer-h200.md ran so)."""
    code = ("import sys\n"
            "for name in ('fastapi', 'starlette', 'uvicorn'):\n"
            "    sys.modules[name] = None  # importing it raises ImportError\n"
            "from p2pkv.tools.cli import build_parser\n"
            "args = build_parser().parse_args(['doctor', '--json'])\n"
            "assert args.json\n"
            "from p2pkv.tools import proxy\n"
            "try:\n"
            "    proxy.create_app\n"
            "except ImportError as exc:\n"
            "    print('proxy needs', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "proxy needs" in out.stdout  # the proxy itself still imports FastAPI when used


def test_the_slice_report_tables_each_system_and_regime() -> None:
    report = load_script("stream_tp_slice_report")

    def result(system: str, tls: str, wall: float, tail: float, mib: int) -> dict:
        rows = [{"wall_s": wall + i, "prefill_s": wall - 1 + i, "tail_s": tail, "streams": 2} for i in range(3)]
        return {"system": system, "ucx_tls": tls, "length": 2048, "decode_tp": 2, "requests": rows,
                "pulls": [{"bytes": mib << 20}] * 6}

    lines = report.table([result("staged", "tcp,self", 13.0, 2.0, 512), result("sliced", "tcp,self", 11.0, 0.1, 256),
                          result("sliced", "cma,tcp,self", 10.0, 0.0, 256)])
    assert [line.split(" | ")[:2] for line in lines[2:]] == [["| cma", "sliced"], ["| tcp", "sliced"],
                                                             ["| tcp", "staged"]]
    assert lines[4] == "| tcp | staged | 3 | 14.00 | 13.00 | 2.000 | 1.00 | 512 |"


def test_the_bindings_bench_keeps_its_size_while_one_entry_expires_per_operation(tmp_path) -> None:
    """``scripts/bench_bindings.py`` times what it says: every timed bind or stream request keeps the entries at
    their size (one expires, one comes), and its JSON names each size."""
    bench = load_script("bench_bindings")
    assert len(bench.bind_costs(10, 50)) == 50 and len(bench.ledger_costs(10, 50)) == 50
    out = tmp_path / "bindings.json"
    assert bench.main(["--sizes", "10", "100", "--ops", "20", "--json", str(out)]) == 0
    import json

    assert [r["size"] for r in json.loads(out.read_text())["results"]] == [10, 100]
