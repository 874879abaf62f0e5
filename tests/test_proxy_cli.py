"""The proxy's command line: flag parsing, URL checks, and ``python -m p2pkv.tools.proxy`` serving for real."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx
import pytest

from p2pkv.tools.proxy import PREFILL_PARAMS, RoundRobin, prefill_body
from p2pkv.tools.proxy.server import add_arguments, main, normalize_url
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
    assert args.prefill == ["a:1", "b:2"] and args.decode == ["c:3"]
    with pytest.raises(SystemExit):
        parse(["--prefill", "a:1"])  # --decode is required


def test_main_rejects_bad_flags_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(parse(["--prefill", "a:1", "--decode", "nope"])) == 2
    assert "--decode 'nope'" in capsys.readouterr().err
    assert main(parse(["--prefill", "a:1", "--decode", "c:3", "--timeout", "0"])) == 2
    assert "--timeout" in capsys.readouterr().err
    assert main(parse(["--prefill", "a:1", "b:2", "--decode", "http://b:2"])) == 2
    assert "http://b:2 is in both --prefill and --decode" in capsys.readouterr().err


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


def test_python_dash_m_serves_a_completion() -> None:
    prefill, decode = FakeEngine("p", "prefill"), FakeEngine("d", "decode")
    engines = [Served(prefill.app), Served(decode.app)]
    (port,) = free_ports(1)
    hostports = [e.url.removeprefix("http://") for e in engines]
    proc = subprocess.Popen([sys.executable, "-m", "p2pkv.tools.proxy", "--port", str(port), "--prefill", hostports[0],
                             "--decode", hostports[1], "--timeout", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=10) as c:
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                try:
                    if c.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "proxy did not become healthy"
                time.sleep(0.1)
            r = c.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert decode.seen[0]["body"]["kv_transfer_params"] == KV_PARAMS
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
        for e in engines:
            e.stop()
