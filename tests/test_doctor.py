"""``p2pkv doctor`` passes on a healthy machine and names the fix on a broken path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from p2pkv.doctor import check_port
from tests.conftest import free_ports


def _doctor(env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pkv.cli", "doctor", "--json", "--seconds", "0.3",
                           "--side-channel-port", str(port)], env=env, capture_output=True, text=True,
                          timeout=120)


def _report(out: subprocess.CompletedProcess) -> dict[str, dict]:
    """The JSON report (NIXL's own log lines may precede it on stdout)."""
    text = out.stdout[out.stdout.index("[\n"):]
    return {c["name"]: c for c in json.loads(text)}


def test_doctor_passes_here() -> None:
    (port,) = free_ports(1)
    out = _doctor({**os.environ, "UCX_NET_DEVICES": "lo"}, port)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = _report(out)
    assert set(checks) == {"nixl", "ucx", "rdma", "gpu", "side_channel_port", "loopback_pull"}
    assert all(c["ok"] for c in checks.values())
    assert "GB/s" in checks["loopback_pull"]["detail"]


def test_doctor_fails_with_a_transport_that_cannot_work() -> None:
    (port,) = free_ports(1)
    out = _doctor({**os.environ, "UCX_TLS": "no_such_transport"}, port)
    assert out.returncode == 1
    checks = _report(out)
    assert not checks["nixl"]["ok"]
    assert "UCX_TLS" in checks["nixl"]["fix"] and "no_such_transport" in checks["nixl"]["fix"]


def test_port_in_use_is_reported_with_the_fix() -> None:
    (port,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        check = check_port("127.0.0.1", port)
    assert not check.ok and "side_channel_port" in check.fix
