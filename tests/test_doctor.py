"""``p2pkv doctor`` passes on a healthy machine and names the fix on a broken path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from p2pkv.tools import doctor
from p2pkv.tools.doctor import Check, check_port, parse_ucx_lanes, rdma_reason
from tests.conftest import free_ports


def _doctor(env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pkv.tools.cli", "doctor", "--json", "--seconds", "0.3",
                           "--side-channel-port", str(port)], env=env, capture_output=True, text=True,
                          timeout=300)


def _report(out: subprocess.CompletedProcess) -> dict[str, dict]:
    """The JSON report (NIXL's own log lines may precede it on stdout)."""
    text = out.stdout[out.stdout.index("[\n"):]
    return {c["name"]: c for c in json.loads(text)}


def test_doctor_passes_here() -> None:
    (port,) = free_ports(1)
    out = _doctor({**os.environ, "UCX_NET_DEVICES": "lo"}, port)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = _report(out)
    assert set(checks) == {"nixl", "ucx", "rdma", "gpu", "cpu", "side_channel_port", "transports", "loopback_pull",
                           "pair_dram", "pair_vram"}
    assert all(c["ok"] for c in checks.values())
    assert "GB/s" in checks["loopback_pull"]["detail"]
    # The CPU features vLLM's CPU kernels dispatch on, and the MLA backend that follows from them here.
    cpu = checks["cpu"]["detail"]
    assert "torch ISA " in cpu and "AMX tiles " in cpu and "flags: " in cpu
    assert cpu.endswith("an MLA model in float32 runs vLLM's CPU_MLA backend here")  # on every CPU
    # UCX's own choice for a peer on this host: TCP over lo and shared memory (cma); no RDMA NIC here.
    assert "tcp/lo" in checks["transports"]["detail"] and "RDMA: no" in checks["transports"]["detail"]
    # A READ and a WRITE between two processes: UCX's protocol selection names cma (process_vm_readv /
    # process_vm_writev) for host memory, one line per direction.
    pair = checks["pair_dram"]["detail"].splitlines()
    assert pair[0].startswith("DRAM pair on this host, 16 MiB each way"), pair
    assert pair[1].startswith("READ  decode←prefill: cma (zero-copy), ") and "get_multi into host" in pair[1]
    assert pair[2].startswith("WRITE prefill→decode: cma (zero-copy), ") and "put_multi from host" in pair[2]
    # UCX selected protocols for new endpoints in this process and the child: no table on stdout.
    assert "ucp_get" not in out.stdout and "ucp_put" not in out.stdout and "| Range" not in out.stdout
    if not _has_cuda():
        assert checks["pair_vram"]["detail"].startswith("skipped: no CUDA device")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
def test_doctor_fails_a_gpu_pair_that_falls_back_to_tcp() -> None:
    (port,) = free_ports(1)
    out = _doctor({**os.environ, "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma,cuda_copy"}, port)
    checks = _report(out)
    assert out.returncode == 1 and not checks["pair_vram"]["ok"], checks["pair_vram"]
    assert "VRAM pair on this host" in checks["pair_vram"]["detail"]
    assert "tcp/" in checks["pair_vram"]["detail"]
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in checks["pair_vram"]["fix"]


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


def test_ucx_lane_parsing_and_rdma_reasons() -> None:
    log = ("[1.0] [vm:1:0] ucp_worker.c:1997 UCX  INFO    a self cfg#0 rma_am(tcp/lo)  am(tcp/lo cma/memory)\n"
           "[1.1] [vm:1:0] ucp_worker.c:1997 UCX  INFO    a inter-node cfg#2 "
           "rma(rc_mlx5/mlx5_0:1) am(rc_mlx5/mlx5_0:1)")
    lanes = parse_ucx_lanes(log)
    assert lanes == {"self": "rma_am(tcp/lo) am(tcp/lo cma/memory)",
                     "inter-node": "rma(rc_mlx5/mlx5_0:1) am(rc_mlx5/mlx5_0:1)"}
    assert rdma_reason(lanes["inter-node"], ["mlx5_0"], {}) == (True, "RDMA in use")
    assert rdma_reason("am(tcp/lo)", [], {})[1] == "no RDMA devices in /sys/class/infiniband"
    assert "UCX_TLS=tcp,cma excludes" in rdma_reason("am(tcp/eth0)", ["mlx5_0"], {"UCX_TLS": "tcp,cma"})[1]
    assert "UCX_NET_DEVICES=eth0 excludes mlx5_0" in rdma_reason("am(tcp/eth0)", ["mlx5_0"],
                                                                {"UCX_NET_DEVICES": "eth0"})[1]


def test_text_report_indents_each_direction_of_a_pair(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    detail = "DRAM pair on this host, 16 MiB each way (the fastest of 4):\nREAD  decode←prefill: cma (zero-copy)" \
             "\nWRITE prefill→decode: tcp (not zero-copy)"
    monkeypatch.setattr(doctor, "run_checks", lambda *a: [Check("pair_dram", True, detail),
                                                          Check("pair_vram", False, "VRAM pair", "a fix")])
    assert doctor.main("127.0.0.1", 1, 0.1, as_json=False) == 1
    assert capsys.readouterr().out.splitlines() == [
        "[ok] pair_dram: DRAM pair on this host, 16 MiB each way (the fastest of 4):",
        "       READ  decode←prefill: cma (zero-copy)",
        "       WRITE prefill→decode: tcp (not zero-copy)",
        "[FAIL] pair_vram: VRAM pair",
        "       fix: a fix",
    ]
