"""The launcher fails fast, naming the flag, before starting anything; the pod modes run one engine."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from p2pkv.tools.cli import main
from p2pkv.tools.deploy import checks
from p2pkv.tools.deploy.engines import CPU_STAGES_COMPILATION_MODE, EngineSpec
from p2pkv.tools.deploy.local import LocalPair
from p2pkv.tools.deploy.processes import LaunchError
from p2pkv.tools.deploy.supervise import supervise
from tests.conftest import free_ports


def test_missing_model_dir_names_the_flag(tmp_path, capsys) -> None:
    assert main(["launch", "local", "--model", str(tmp_path / "nope")]) == 1
    assert "--model" in capsys.readouterr().err


def test_port_in_use_names_the_flag(tmp_path) -> None:
    (busy,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        pair = LocalPair(model=str(tmp_path), decode_port=busy)
        with pytest.raises(LaunchError, match="--decode-port"):
            pair.check()


def test_the_traces_endpoint_reaches_the_engines_through_the_environment(tmp_path) -> None:
    """``--otlp-traces-endpoint``: vLLM's flag on each engine and ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` in its
    environment (p2pkv's spans), never a p2pkv setting (``otlp_traces_endpoint`` was removed)."""
    url = "http://127.0.0.1:4318/v1/traces"
    pair = LocalPair(model=str(tmp_path), otlp_traces_endpoint=url)
    for spec in pair.engine_specs():
        assert spec.env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == url
        command = spec.command()
        assert command[command.index("--otlp-traces-endpoint") + 1] == url
        ktc = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert "otlp_traces_endpoint" not in ktc["kv_connector_extra_config"]
    pair.check()  # the engines' extra config passes load_config


def test_ports_must_differ(tmp_path) -> None:
    with pytest.raises(LaunchError, match="ports must differ"):
        LocalPair(model=str(tmp_path), prefill_port=9000, decode_port=9000).check()


def test_engine_commands_carry_the_connector_config(tmp_path) -> None:
    pair = LocalPair(model=str(tmp_path), side_channel_port=6000, aggregated_port=9999)
    prefill, decode, agg = pair.engine_specs()
    ktc = json.loads(prefill.command()[prefill.command().index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "P2pKvConnector" and "kv_connector_module_path" not in ktc  # the plugin
    assert ktc["kv_connector_extra_config"]["side_channel_port"] == 6000
    dktc = json.loads(decode.command()[decode.command().index("--kv-transfer-config") + 1])
    assert dktc["kv_connector_extra_config"]["side_channel_port"] == 6100
    assert "--kv-transfer-config" not in agg.command()
    nixl = EngineSpec(name="p", model="m", port=1, role="prefill", connector="nixl")
    assert json.loads(nixl.command()[nixl.command().index("--kv-transfer-config") + 1])["kv_connector"] == \
        "NixlConnector"


# ---- p2pkv launch prefill|decode: one side of a pair, for a pod ----------------------------------


@pytest.fixture(autouse=True)
def _no_pod_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA and no pod variables unless a test sets them."""
    for name in ("POD_IP", "P2PKV_MODEL", "P2PKV_PORT", "P2PKV_SIDE_CHANNEL_HOST", "P2PKV_SIDE_CHANNEL_PORT",
                 "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 0)


@pytest.fixture(autouse=True)
def _side_channel_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch here has a secret (as P2PKV_SECRET), unless a test removes it."""
    monkeypatch.setenv("P2PKV_SECRET", "launch-test-secret")


def test_pod_without_a_secret_refuses_to_start(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("P2PKV_SECRET")
    err = _failure(_pod(tmp_path), capsys)
    assert "P2PKV_SECRET" in err and "--secret-file" in err and "insecure" in err
    key = tmp_path / "key"
    key.write_text("file-secret-0123456789\n")
    out, _, ktc = _dry_run(_pod(tmp_path, "--secret-file", str(key)), capsys)
    assert ktc["kv_connector_extra_config"]["secret_file"] == str(key) and "file-secret" not in out
    (tmp_path / "empty").write_text("")
    assert "is empty" in _failure(_pod(tmp_path, "--secret-file", str(tmp_path / "empty")), capsys)
    assert main(_pod(tmp_path, "--insecure")) == 0
    assert "runs without a secret" in capsys.readouterr().err
    monkeypatch.setenv("P2PKV_SECRET", "from-env-0123456789")
    out, _, _ = _dry_run(_pod(tmp_path), capsys)
    assert "P2PKV_SECRET=" in out and "<hidden>" in out and "from-env" not in out


def test_pod_secret_must_be_long_and_off_the_command_line(tmp_path, capsys, monkeypatch) -> None:
    """A secret shorter than 16 bytes is refused (naming how to make one); one in --kv-connector-extra-config is
    refused too: vLLM prints the extra config in its log, and it would be on the engine's command line."""
    monkeypatch.setenv("P2PKV_SECRET", "0123456789abcde")  # 15 bytes
    err = _failure(_pod(tmp_path), capsys)
    assert "P2PKV_SECRET" in err and "minimum 16" in err and "secrets.token_hex(32)" in err
    monkeypatch.delenv("P2PKV_SECRET")
    key = tmp_path / "key"
    key.write_text("  short \n")
    err = _failure(_pod(tmp_path, "--secret-file", str(key)), capsys)
    assert str(key) in err and "minimum 16" in err
    monkeypatch.setenv("P2PKV_SECRET", "0123456789abcdef")
    err = _failure(_pod(tmp_path, "--kv-connector-extra-config", '{"secret": "0123456789abcdef-in-argv"}'), capsys)
    assert "--kv-connector-extra-config" in err and "P2PKV_SECRET" in err and "secret_file" in err
    assert "0123456789abcdef-in-argv" not in err
    out, argv, _ = _dry_run(_pod(tmp_path), capsys)
    assert "0123456789abcdef" not in out and "0123456789abcdef" not in " ".join(argv)


def test_local_pair_checks_the_secret(tmp_path, monkeypatch) -> None:
    with pytest.raises(LaunchError, match="minimum 16"):
        LocalPair(model=str(tmp_path), secret="short").check()
    with pytest.raises(LaunchError, match="P2PKV_SECRET"):
        LocalPair(model=str(tmp_path), extra_config={"secret": "0123456789abcdef"}).check()
    pair = LocalPair(model=str(tmp_path), side_channel_port=free_ports(1)[0])
    for spec in pair.engine_specs():
        assert pair.secret not in " ".join(spec.command()) and spec.environment()["P2PKV_SECRET"] == pair.secret
    assert pair.secret not in " ".join(pair.proxy_command())


@pytest.mark.parametrize(("fields", "bind", "in_core", "uni_flag"), [
    ({}, None, True, False),
    ({"tensor_parallel_size": 2}, None, False, False),
    ({"extra_args": ("--data-parallel-size", "2")}, None, True, True),
    ({"extra_args": ("--data-parallel-size=2",)}, None, True, True),
    ({"extra_args": ("-dp", "2", "--distributed-executor-backend", "mp")}, None, True, False),
    ({}, "auto", False, False),
    ({"extra_args": ("--data-parallel-size", "2"), "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}}, None, False, False),
    ({"local_defaults": False}, None, False, False),
    ({"enforce_eager": False}, None, False, False),
], ids=["tp1", "tp2", "dp2", "dp2=", "dp2 mp asked", "threads bound", "threads bound by spec", "gpu pod", "not eager"])
def test_tp1_engines_run_their_worker_in_the_engine_core(fields: dict, bind: str | None, in_core: bool,
                                                         uni_flag: bool, monkeypatch) -> None:
    """With the small-machine defaults, threads unbound and TP 1, vLLM's worker runs in each EngineCore process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and ``--distributed-executor-backend uni`` for several DP ranks, for
    which vLLM would pick mp); anything else keeps vLLM's own executor choice."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    if bind is not None:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    spec = EngineSpec(name="e", model="m", port=1, **fields)
    assert (spec.environment().get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is in_core
    argv, flag = spec.command(), "--distributed-executor-backend"
    backend = argv[argv.index(flag) + 1] if flag in argv else None
    assert (backend == "uni") is uni_flag


def _pod(tmp_path: Path, *flags: str, role: str = "prefill") -> list[str]:
    """``launch ROLE --dry-run`` on free ports with the side channel on loopback, plus ``flags``."""
    http, side = free_ports(2)
    return ["launch", role, "--model", str(tmp_path), "--port", str(http), "--side-channel-port", str(side),
            "--side-channel-host", "127.0.0.1", "--dry-run", *flags]


def _failure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``p2pkv argv``, assert it exits 2 before starting anything, return stderr."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "command:" not in out
    return err


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, list[str], dict]:
    """Run a dry run that must pass; returns stdout, the engine argv and its kv-transfer-config."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("command: ")]
    argv_out = shlex.split(line.removeprefix("command: "))
    return out, argv_out, json.loads(argv_out[argv_out.index("--kv-transfer-config") + 1])


def test_pod_missing_model_names_the_flag(tmp_path, capsys) -> None:
    err = _failure(["launch", "decode", "--model", str(tmp_path / "nope"), "--dry-run"], capsys)
    assert "--model" in err and "no such directory" in err
    err = _failure(["launch", "prefill", "--dry-run"], capsys)
    assert "--model" in err and "P2PKV_MODEL" in err


def test_pod_http_port_in_use_names_the_flag(tmp_path, capsys) -> None:
    (busy,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        err = _failure(_pod(tmp_path, "--port", str(busy)), capsys)  # binds 0.0.0.0, which overlaps
    assert f"--port={busy}" in err and "pick a free port" in err


def test_pod_side_channel_port_in_use_names_the_flag(tmp_path, capsys) -> None:
    (busy,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        err = _failure(_pod(tmp_path, "--side-channel-port", str(busy)), capsys)
    assert f"--side-channel-port={busy}: cannot bind 127.0.0.1:{busy}" in err


def test_pod_every_tp_rank_side_channel_port_is_checked(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 2)
    (base,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        err = _failure(_pod(tmp_path, "--side-channel-port", str(base), "--tensor-parallel-size", "2"), capsys)
    assert "--side-channel-port" in err and "rank 1 of 2" in err and str(base + 1) in err


def test_pod_http_port_inside_side_channel_ports_is_refused(tmp_path, capsys) -> None:
    (port,) = free_ports(1)
    err = _failure(_pod(tmp_path, "--port", str(port), "--side-channel-port", str(port)), capsys)
    assert "--port" in err and "side-channel" in err


@pytest.mark.parametrize(("host", "expected"), [("203.0.113.7", "not an address of this machine"),
                                              ("no-such-host.invalid", "cannot resolve")])
def test_pod_bad_side_channel_host_names_the_flag(tmp_path, capsys, host, expected) -> None:
    err = _failure(_pod(tmp_path, "--side-channel-host", host), capsys)
    assert f"--side-channel-host={host}" in err and expected in err


def test_pod_tp_without_cuda_names_the_flag(tmp_path, capsys) -> None:
    err = _failure(_pod(tmp_path, "--tensor-parallel-size", "2"), capsys)
    assert "--tensor-parallel-size=2" in err and "no CUDA device" in err


def test_pod_tp_larger_than_gpus_names_the_flag(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 2)
    assert "--tensor-parallel-size=4" in _failure(_pod(tmp_path, "--tensor-parallel-size", "4"), capsys)
    err = _failure(_pod(tmp_path, "--tensor-parallel-size", "2", "--gpu-ids", "1"), capsys)
    assert "--tensor-parallel-size=2" in err and "--gpu-ids=1 names 1 GPU" in err


def test_pod_pipeline_stages_are_a_prefill_engines_only(tmp_path, capsys, monkeypatch) -> None:
    """PP on a decode engine is refused naming the flag and the role. Without CUDA a prefill engine's stages run
    (``tests/test_e2e_pipeline.py``): no ``--enforce-eager`` there, vLLM's CPU warm-up on and nothing compiled."""
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 4)
    err = _failure(_pod(tmp_path, "--pipeline-parallel-size", "2", role="decode"), capsys)
    assert "--pipeline-parallel-size=2 with launch decode" in err and "prefill engine only" in err
    assert "--pipeline-parallel-size=0: must be >= 1" in _failure(_pod(tmp_path, "-pp", "0"), capsys)
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 0)
    out, argv, _ = _dry_run(_pod(tmp_path, "--pipeline-parallel-size", "2"), capsys)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2" and "--enforce-eager" not in argv
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"mode": CPU_STAGES_COMPILATION_MODE}
    assert "  TORCHDYNAMO_DISABLE=1" in out.splitlines()


def test_pod_pipeline_stages_need_a_gpu_and_a_side_channel_port_per_worker_rank(tmp_path, capsys,
                                                                                monkeypatch) -> None:
    """TP 2 x PP 2 needs 4 GPUs (both sizes named when short) and 4 consecutive side-channel ports (the last,
    stage 1's tp_rank 1, checked too); with both, the engine runs with ``--pipeline-parallel-size 2``."""
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 2)
    err = _failure(_pod(tmp_path, "-tp", "2", "-pp", "2"), capsys)
    assert "--tensor-parallel-size=2 x --pipeline-parallel-size=2 = 4 GPUs: this machine has 2" in err
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 4)
    (base,) = free_ports(1, run=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 3))
        s.listen()
        err = _failure(_pod(tmp_path, "--side-channel-port", str(base), "-tp", "2", "-pp", "2"), capsys)
    assert "rank 3 of 4" in err and str(base + 3) in err
    out, argv, _ = _dry_run(_pod(tmp_path, "--side-channel-port", str(base), "-tp", "2", "-pp", "2",
                                 "--block-size", "16"), capsys)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert f"{base}..{base + 3} (port + pp_rank * 2 + tp_rank)" in out


@pytest.mark.parametrize(("gpu_ids", "gpus", "expected"), [
    ("0,7", 2, "GPU 7 does not exist"),
    ("a,b", 2, "comma-separated GPU indices"),
    ("1,1", 2, "distinct"),
    ("0", 0, "no CUDA device"),
])
def test_pod_bad_gpu_ids_name_the_flag(tmp_path, capsys, monkeypatch, gpu_ids, gpus, expected) -> None:
    monkeypatch.setattr(checks, "cuda_device_count", lambda: gpus)
    err = _failure(_pod(tmp_path, "--gpu-ids", gpu_ids), capsys)
    assert f"--gpu-ids={gpu_ids}" in err and expected in err


def test_pod_gpu_ids_index_the_inherited_visible_devices(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    out, argv, _ = _dry_run(_pod(tmp_path, "--gpu-ids", "1,3", "--tensor-parallel-size", "2",
                                 "--block-size", "16"), capsys)
    assert "  CUDA_VISIBLE_DEVICES=5,7" in out.splitlines()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--block-size") + 1] == "16"


@pytest.mark.parametrize("block", ["16", "0", "-32"])
def test_pod_bad_block_size_names_the_flag(tmp_path, capsys, block) -> None:
    assert f"--block-size={block}" in _failure(_pod(tmp_path, "--block-size", block), capsys)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--kv-connector-extra-config", "{not json", "not JSON"),
    ("--kv-connector-extra-config", '{"no_such_key": 1}', "no_such_key"),
    ("--kv-connector-extra-config", '{"side_channel_port": 1}', "--side-channel-port"),
    ("--extra-vllm-args", "--port=9", "use --port"),
    ("--extra-vllm-args", "-pp 2", "use --pipeline-parallel-size"),
    ("--extra-vllm-args", "--seed '3", "quotes"),
    ("--proxy-url", "ftp://x", "http://HOST:PORT"),
])
def test_pod_bad_passthrough_flags_are_refused(tmp_path, capsys, flag, value, expected) -> None:
    err = _failure(_pod(tmp_path, f"{flag}={value}"), capsys)
    assert flag in err and expected in err


def test_pod_dry_run_prints_the_command_with_the_connector_config(tmp_path, capsys) -> None:
    argv = _pod(tmp_path, "--kv-connector-extra-config", '{"lease_s": 30}',
                "--extra-vllm-args=--seed 3", "--max-model-len", "512", "--proxy-url", "http://10.0.0.9:8000/",
                role="decode")
    side = int(argv[argv.index("--side-channel-port") + 1])
    out, cmd, ktc = _dry_run(argv, capsys)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and cmd[-2:] == ["--seed", "3"]
    assert cmd[cmd.index("--max-model-len") + 1] == "512" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert ktc["kv_connector"] == "P2pKvConnector" and "kv_connector_module_path" not in ktc  # the plugin
    extra = ktc["kv_connector_extra_config"]
    assert extra == {"side_channel_host": "127.0.0.1", "side_channel_port": side, "lease_s": 30, "role": "decode"}
    assert "launch-test-secret" not in out and "dry run" in out
    assert "(from --side-channel-host)" in out and "warning: side channel on 127.0.0.1" in out
    assert "http://10.0.0.9:8000 must list this engine" in out and "--decode" in out


def test_pod_env_fallbacks(tmp_path, capsys, monkeypatch) -> None:
    http, side = free_ports(2)
    monkeypatch.setenv("P2PKV_MODEL", str(tmp_path))
    monkeypatch.setenv("P2PKV_PORT", str(http))
    monkeypatch.setenv("P2PKV_SIDE_CHANNEL_PORT", str(side))
    monkeypatch.setenv("P2PKV_SIDE_CHANNEL_HOST", "127.0.0.1")
    out, cmd, ktc = _dry_run(["launch", "prefill", "--dry-run"], capsys)
    assert cmd[cmd.index("--model") + 1] == str(tmp_path) and cmd[cmd.index("--port") + 1] == str(http)
    extra = ktc["kv_connector_extra_config"]
    assert extra["side_channel_port"] == side and extra["side_channel_host"] == "127.0.0.1"
    assert "from P2PKV_SIDE_CHANNEL_HOST" in out
    monkeypatch.setenv("P2PKV_PORT", "http")
    assert "P2PKV_PORT=http" in _failure(["launch", "prefill", "--dry-run"], capsys)
    monkeypatch.setenv("P2PKV_PORT", str(http))
    monkeypatch.setenv("P2PKV_SIDE_CHANNEL_HOST", "203.0.113.7")
    assert "P2PKV_SIDE_CHANNEL_HOST=203.0.113.7" in _failure(["launch", "prefill", "--dry-run"], capsys)


def test_pod_side_channel_host_defaults_to_pod_ip(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("POD_IP", "127.0.0.1")
    argv = [a for a in _pod(tmp_path) if a not in ("--side-channel-host", "127.0.0.1")]
    out, _, ktc = _dry_run(argv, capsys)
    assert ktc["kv_connector_extra_config"]["side_channel_host"] == "127.0.0.1" and "(from POD_IP)" in out
    monkeypatch.setenv("POD_IP", "203.0.113.7")
    assert "POD_IP=203.0.113.7" in _failure(argv, capsys)


def test_side_channel_host_default_is_never_loopback(monkeypatch) -> None:
    try:
        ip, reason = checks.default_side_channel_host({})
    except LaunchError as exc:  # a machine with no address but loopback must say what to pass
        assert "--side-channel-host" in str(exc)
    else:
        assert not checks.is_unroutable(ip) and "POD_IP is not set" in reason
        checks.resolve_local_address(ip, "--side-channel-host")  # and it is an address of this machine
    loopback_only = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
    monkeypatch.setattr(checks, "outward_address", lambda: None)
    monkeypatch.setattr(checks.socket, "getaddrinfo", lambda *a, **k: loopback_only)
    with pytest.raises(LaunchError, match=r"--side-channel-host.*set POD_IP"):
        checks.default_side_channel_host({})


_FAKE_ENGINE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("fake engine serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_supervise_reports_an_engine_that_dies(tmp_path, capsys) -> None:
    (port,) = free_ports(1)
    argv = [sys.executable, "-c", _FAKE_ENGINE, str(port)]
    killed: list[int] = []

    def kill(child) -> None:
        killed.append(child.proc.pid)
        os.kill(child.proc.pid, signal.SIGKILL)

    echoed = io.StringIO()
    rc = supervise("prefill", argv, dict(os.environ), tmp_path, f"http://127.0.0.1:{port}/health", 30.0,
                   on_ready=kill, echo=echoed, poll_s=0.1)
    out, err = capsys.readouterr()
    assert rc == 1 and killed and "ready: prefill" in out and echoed.getvalue() == "fake engine serving\n"
    assert f"prefill exited with code {-signal.SIGKILL}" in err and "fake engine serving" in err


def test_supervise_reports_an_engine_that_never_gets_healthy(tmp_path, capsys) -> None:
    argv = [sys.executable, "-c", "print('no GPU memory left'); raise SystemExit(3)"]
    rc = supervise("decode", argv, dict(os.environ), tmp_path, "http://127.0.0.1:9/health", 30.0)
    err = capsys.readouterr().err
    assert rc == 1 and "decode exited with code 3 before it was healthy" in err and "no GPU memory left" in err


def test_gpu_pods_keep_cuda_graphs_and_leave_the_environment_alone(tmp_path, capsys, monkeypatch) -> None:
    """On GPUs the engine runs with CUDA graphs (no --enforce-eager) and without the small-machine
    environment defaults; without CUDA (the demo) it keeps both."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 2)
    out, argv, _ = _dry_run(_pod(tmp_path, "--tensor-parallel-size", "2", "--block-size", "16"), capsys)
    assert "--enforce-eager" not in argv and "OMP_NUM_THREADS" not in out and "TORCHDYNAMO_DISABLE" not in out
    monkeypatch.setattr(checks, "cuda_device_count", lambda: 0)
    out, argv, _ = _dry_run(_pod(tmp_path), capsys)
    assert "--enforce-eager" in argv and "OMP_NUM_THREADS" in out and "TORCHDYNAMO_DISABLE" in out


@pytest.mark.parametrize(("fields", "preset", "expected"), [
    ({}, None, "1"),
    ({}, "0", "0"),  # the user's own setting wins
    ({"enforce_eager": False}, None, None),
    ({"local_defaults": False}, None, None),
], ids=["eager_cpu", "user_set", "not_eager", "gpu_pod"])
def test_eager_cpu_engines_compile_nothing_at_run_time(fields: dict, preset: str | None, expected: str | None,
                                                       monkeypatch) -> None:
    """An eager small-machine engine runs with torch.compile off everywhere, so a first logprobs request does
    not compile vLLM's sampler helper on the engine thread; GPU pods and non-eager engines keep vLLM's choice."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    if preset is not None:
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", preset)
    assert EngineSpec(name="e", model="m", port=1, **fields).environment().get("TORCHDYNAMO_DISABLE") == expected


@pytest.mark.engines
def test_launch_local_pair_and_proxy_answer_a_request(launched, client) -> None:
    """`p2pkv launch local` (the engine tests' shared pair is started by it): it printed each engine's command
    and `ready`, a request through its proxy is answered with the KV pulled by the decode engine, and at the end
    of the session SIGTERM stops everything with exit 0 (checked by the ``launched`` fixture's teardown)."""
    out = "".join(launched.lines)
    for name in ("prefill", "decode", "aggregated"):
        assert f"[{name}] " in out and "vllm.entrypoints.openai.api_server" in out, out
    assert f"ready: proxy on {launched.pair.url('proxy')}" in out
    assert launched.proc.poll() is None
    decode = launched.pair.decode_port
    before = _pulls_total(decode)
    body = {"model": "model", "prompt": "launch local " * 8, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    resp = client.post(f"{launched.pair.url('proxy')}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 60  # pull stats reach /metrics with the engine's next stats update
    while _pulls_total(decode) < before + 1:
        assert time.monotonic() < deadline, "the decode engine never reported a pull"
        time.sleep(1.0)


def _pulls_total(port: int) -> float:
    """``p2pkv:pulls_total`` summed over labels on the engine at ``port`` (0 before the first pull)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith("p2pkv:pulls_total{") or x.startswith("p2pkv:pulls_total "))
