"""The proxy's command line: flag parsing, URL checks, and ``python -m p2pkv.tools.proxy`` serving for real."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from p2pkv.tools.proxy import PREFILL_PARAMS, RoundRobin, prefill_body
from p2pkv.tools.proxy.proxy_cli import add_arguments, main, normalize_url
from tests.conftest import free_ports
from tests.fake_engines import KV_PARAMS, FakeEngine, Served


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:8100", "http://127.0.0.1:8100"), ("http://host:80", "http://host:80"),
    ("https://h.example:443/", "https://h.example:443"), ("[::1]:9000", "http://[::1]:9000"),
])
def test_normalize_url(value: str, expected: str) -> None:
    assert normalize_url(value) == expected


@pytest.mark.parametrize("value", ["host", "host:0", "host:99999", ":80", "ftp://h:1", "h:1/v1"])
def test_normalize_url_rejects_naming_the_flag(value: str) -> None:
    with pytest.raises(ValueError, match="--decode"):
        normalize_url(value, "--decode")


def test_flags_and_defaults() -> None:
    args = parse(["--prefill", "a:1", "b:2", "--decode", "c:3"])
    assert (args.host, args.port, args.timeout) == ("127.0.0.1", 8000, 300.0)
    assert (args.max_body_bytes, args.max_fanout, args.max_prompts, args.insecure) == (16 * 1024 * 1024, 8, 256,
                                                                                      False)
    assert args.prefill == ["a:1", "b:2"] and args.decode == ["c:3"]
    with pytest.raises(SystemExit):
        parse(["--prefill", "a:1"])  # --decode is required


SECRET = "proxy-cli-test-secret-0123456789"


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PKV_SECRET", SECRET)


def test_main_rejects_bad_flags_before_serving(capsys: pytest.CaptureFixture[str], secret_env: None) -> None:
    assert main(parse(["--prefill", "a:1", "--decode", "nope"])) == 2
    assert "--decode 'nope'" in capsys.readouterr().err
    assert main(parse(["--prefill", "a:1", "--decode", "c:3", "--timeout", "0"])) == 2
    assert "--timeout" in capsys.readouterr().err
    assert main(parse(["--prefill", "a:1", "b:2", "--decode", "http://b:2"])) == 2
    assert "http://b:2 is in both --prefill and --decode" in capsys.readouterr().err
    for flag in ("--max-body-bytes", "--max-fanout", "--max-prompts"):
        assert main(parse(["--prefill", "a:1", "--decode", "c:3", flag, "0"])) == 2
        assert f"{flag} 0: must be >= 1" in capsys.readouterr().err


def test_main_refuses_to_start_without_a_secret(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """Without a secret the proxy could not free a prefill hold whose decode leg failed: it exits 2 naming both
    fixes (P2PKV_SECRET, --secret-file) and --insecure, before serving anything."""
    monkeypatch.delenv("P2PKV_SECRET", raising=False)
    served = []
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: served.append(a))
    argv = ["--prefill", "a:1", "--decode", "c:3"]
    assert main(parse(argv)) == 2
    err = capsys.readouterr().err
    assert "P2PKV_SECRET" in err and "--secret-file" in err and "--insecure" in err
    monkeypatch.setenv("P2PKV_SECRET", "short")
    assert main(parse(argv)) == 2
    err = capsys.readouterr().err
    assert "P2PKV_SECRET" in err and "minimum 16" in err and "secrets.token_hex(32)" in err
    key = tmp_path / "key"
    key.write_text("0123456789abcde\n")  # 15 bytes once stripped
    assert main(parse([*argv, "--secret-file", str(key)])) == 2
    assert f"--secret-file {key}" in capsys.readouterr().err
    assert main(parse([*argv, "--secret-file", str(tmp_path / "missing")])) == 2
    assert not served
    key.write_text(SECRET + "\n")
    assert main(parse([*argv, "--secret-file", str(key)])) == 0
    assert served[-1][0].state.proxy.secret == SECRET.encode()
    monkeypatch.delenv("P2PKV_SECRET")
    assert main(parse([*argv, "--insecure"])) == 0
    assert served[-1][0].state.proxy.secret is None and "--insecure" in capsys.readouterr().err


def test_main_passes_the_limits_to_the_app(monkeypatch: pytest.MonkeyPatch, secret_env: None) -> None:
    served = []
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: served.append(a))
    assert main(parse(["--prefill", "a:1", "--decode", "c:3", "--max-fanout", "2"])) == 0
    assert served[0][0].state.proxy.max_fanout == 2


def test_prefill_body_and_round_robin() -> None:
    body = {"prompt": "p", "max_tokens": 9, "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    out = prefill_body(body)
    assert out == {"prompt": "p", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                   "kv_transfer_params": PREFILL_PARAMS}
    assert body["max_tokens"] == 9 and "stream_options" in body  # the client's body is untouched
    assert prefill_body({**body, "min_tokens": 5})["min_tokens"] == 1  # vLLM refuses min_tokens > max_tokens
    rr = RoundRobin(["a", "b"])
    assert [rr.next() for _ in range(3)] == ["a", "b", "a"]
    with pytest.raises(ValueError):
        RoundRobin([])


def test_main_turns_tracing_on_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str],
                                                                secret_env: None) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    served = []
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: served.append(a[0]))
    argv = ["--prefill", "a:1", "--decode", "c:3"]
    assert main(parse(argv)) == 0 and served[-1].state.tracing is None  # off by default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318/")
    assert main(parse(argv)) == 0
    assert served[-1].state.tracing.endpoint == "http://127.0.0.1:4318/v1/traces"
    assert "sending traces to http://127.0.0.1:4318/v1/traces" in capsys.readouterr().err
    assert main(parse([*argv, "--otlp-traces-endpoint", "http://127.0.0.1:9/x"])) == 0  # the flag wins
    assert served[-1].state.tracing.endpoint == "http://127.0.0.1:9/x"
    assert main(parse([*argv, "--otlp-traces-endpoint", "127.0.0.1:4318"])) == 2
    assert "expected an http:// or https:// URL" in capsys.readouterr().err and len(served) == 3


def serve_proxy(engines: list[Served], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m p2pkv.tools.proxy`` in front of ``engines`` (prefill, decode), once healthy; and its URL."""
    (port,) = free_ports(1)
    hostports = [e.url.removeprefix("http://") for e in engines]
    proc = subprocess.Popen([sys.executable, "-m", "p2pkv.tools.proxy", "--port", str(port), "--prefill", hostports[0],
                             "--decode", hostports[1], "--timeout", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=10) as c:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if c.get(f"{url}/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "proxy did not become healthy"
            time.sleep(0.1)


def stop_proxy(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()


@pytest.mark.parametrize("traced", [False, True])
def test_python_dash_m_serves_a_completion(traced: bool) -> None:
    """Served for real; with ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set, its spans reach that receiver."""
    from p2pkv.tools.trace.otlp_receiver import OtlpReceiver

    prefill, decode = FakeEngine("p", "prefill"), FakeEngine("d", "decode")
    engines = [Served(prefill.app), Served(decode.app)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    with OtlpReceiver() as receiver:
        if traced:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = receiver.url
        proc, url = serve_proxy(engines, {**env, "P2PKV_SECRET": SECRET})
        try:
            with httpx.Client(timeout=10) as c:
                r = c.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
            params = decode.seen[0]["body"]["kv_transfer_params"]
            if not traced:
                assert params == KV_PARAMS
                return
            rid = r.headers["x-request-id"]
            spans = receiver.wait_for(lambda s: len([x for x in s if x.attributes.get("p2pkv.request_id") == rid]) == 3)
            decode_leg = next(s for s in spans if s.name == "p2pkv.proxy.decode")
            assert params == {**KV_PARAMS, "traceparent": decode.seen[0]["traceparent"]}
            assert params["traceparent"].startswith(f"00-{decode_leg.trace_id}-{decode_leg.span_id}-")
        finally:
            stop_proxy(proc)
            for e in engines:
                e.stop()
