"""Which UCX transport moves a peer's READs and WRITEs: learned from UCX's protocol selection, logged, counted.

Real prefill workers in their own processes (:class:`tests.p2p_harness.PrefillProc`)
and a real decode worker here; on this CPU host UCX moves host memory
between processes with ``cma`` (``process_vm_readv`` / ``process_vm_writev``),
or with TCP when ``UCX_TLS=tcp`` leaves it nothing else. The GPU tests need a
CUDA device.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from p2pkv.dataplane import transport
from p2pkv.dataplane.transport import (
    TransportReport,
    TransportWatch,
    is_zero_copy,
    parse_selections,
    read_is_zero_copy,
    summarize,
    warn_vram_over_tcp,
)
from p2pkv.tools.doctor_pair import PairResult, pair_transfers, verdict
from tests.p2p_harness import DecodeSide, PrefillProc, free_port, pull_task

BOUND_S = 20.0
DECODE_CFG = dict(transfer_timeout_s=15.0)


def _pull(d: DecodeSide, pf: PrefillProc, rid: str, local: list[int], remote: list[int]) -> None:
    pf.lease([f"p-{rid}"])
    d.start(pull_task(rid, f"p-{rid}", pf.port, local, remote))
    assert d.pump({rid}, BOUND_S) == set(), f"{rid} did not finish"
    assert d.take_errors() == set()
    expected = pf.expected()
    assert all(d.block_ok(lb, rb, expected) for lb, rb in zip(local, remote, strict=True))


@pytest.fixture
def prefills() -> Iterator[list[PrefillProc]]:
    started: list[PrefillProc] = []
    try:
        for seed in (3, 4):
            pf = PrefillProc(free_port(), seed=seed, num_blocks=64)
            pf.start()
            started.append(pf)
        yield started
    finally:
        for pf in started:
            pf.stop()


def test_each_peer_transport_is_logged_once_and_counted(prefills: list[PrefillProc],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    d = DecodeSide(64, **DECODE_CFG)
    try:
        with caplog.at_level(logging.INFO, logger="p2pkv.dataplane.transport"):
            _pull(d, prefills[0], "a1", [1, 2, 3], [10, 11, 12])
            _pull(d, prefills[0], "a2", [4, 5], [20, 21])  # same peer: nothing new
            _pull(d, prefills[1], "b1", [6, 7], [30, 40])  # second peer: same UCX endpoint configuration
        stats = d.worker.take_stats()
        reports = d.worker.agent.transports
    finally:
        d.close()
    assert stats is not None and stats["transports"] == {"DRAM:cma": 2}
    assert len(reports) == 2
    for report in reports.values():
        assert (report.mem_type, report.transport, report.node) == ("DRAM", "cma", "intra-node")
        assert "zero-copy cma/memory" in report.detail and "into host from host" in report.detail
        assert not report.vram_over_tcp
    lines = [r.getMessage() for r in caplog.records if "move over UCX" in r.getMessage()]
    assert len(lines) == 2 and all("into DRAM move over UCX cma (intra-node, zero-copy;" in m for m in lines)
    assert all(r.op == "READ" and read_is_zero_copy(r) for r in reports.values())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == transport.logger.name]


def test_tcp_only_ucx_is_reported_as_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # before either process creates its agent
    pf = PrefillProc(free_port(), seed=5, num_blocks=64)
    pf.start()
    d = DecodeSide(64, **DECODE_CFG)
    try:
        _pull(d, pf, "t1", [1, 2], [3, 4])
        (report,) = d.worker.agent.transports.values()
        stats = d.worker.take_stats()
    finally:
        d.close()
        pf.stop()
    assert report.transport == "tcp" and "tcp/lo" in report.detail
    assert stats is not None and stats["transports"] == {"DRAM:tcp": 1}
    assert not report.vram_over_tcp  # host memory: slow, but not the GPU trap the warning is about


def test_user_turning_ucx_protocol_info_off_gives_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_PROTO_INFO", "n")  # the environment wins over p2pkv's engine_config
    pf = PrefillProc(free_port(), seed=6, num_blocks=64)
    pf.start()
    d = DecodeSide(64, **DECODE_CFG)
    try:
        _pull(d, pf, "u1", [1], [2])
        (report,) = d.worker.agent.transports.values()
    finally:
        d.close()
        pf.stop()
    assert report.transport == "unknown" and "UCX_PROTO_INFO=n" in report.detail


def test_dram_pair_in_two_processes_reads_and_writes_with_cma() -> None:
    """The decode side READs, the prefill side (the child) WRITEs back: each side reports its own op."""
    result = pair_transfers("DRAM", nbytes=4 << 20)
    ok, detail, fix = verdict(result)
    assert result.bytes_ok and result.write_bytes_ok and ok and fix == "", detail
    read, write = result.report, result.write_report
    assert (read.op, read.transport, read.protocol, read.mem_type) == ("READ", "cma", "zero-copy", "DRAM")
    assert (write.op, write.transport, write.protocol, write.mem_type) == ("WRITE", "cma", "zero-copy", "DRAM")
    assert write.peer.startswith("p2pkv-doctor-pair-dst-") and "put_multi from host to host" in write.detail
    assert read_is_zero_copy(read) and is_zero_copy(write) and not read_is_zero_copy(write)
    lines = detail.splitlines()
    assert lines[1].startswith("READ  decode←prefill: cma (zero-copy), ")
    assert lines[2].startswith("WRITE prefill→decode: cma (zero-copy), ")


_NO_TABLE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from p2pkv.dataplane.agent import NixlTransferAgent
    from p2pkv.dataplane.layout import Region
    from p2pkv.tools.doctor import loopback_info

    def pair(tag):  # a READ and a WRITE between two agents; UCX selects afresh in each new agent
        a, b = (NixlTransferAgent(f"{tag}-{i}", ["UCX"]) for i in range(2))
        bufs = [np.arange(1 << 20, dtype=np.uint8) * i for i in (1, 2)]
        for agent, buf in zip((a, b), bufs):
            agent.register([Region(buf.ctypes.data, buf.nbytes)], "DRAM")
        peer = a.add_peer(loopback_info(b))
        local, remote = (np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64) for buf in bufs)
        for op in ("READ", "WRITE"):
            xfer = a.start_xfer(op, peer, local, remote, b"")
            while not a.poll(xfer):
                b.get_notifs()
        reports = {op: r[peer] for op, r in (("READ", a._watch.reports), ("WRITE", a._watch.write_reports))}
        a.close(); b.close()
        return reports

    reports = pair("quiet")
    sys.stdout.flush()
    os.write(1, b"P2PKV-TEST-CONTROL\\n")
    os.environ["UCX_PROTO_INFO"] = "*get*"  # the environment wins: UCX prints its READ table again
    pair("loud")
    sys.stdout.flush()
    os.write(1, ("P2PKV-TEST-REPORTS " + repr({op: (r.op, r.transport) for op, r in reports.items()})
                 + "\\n").encode())
""")


def test_first_read_and_write_print_no_ucx_table_on_stdout() -> None:
    """UCX's protocol table (printed on the process's stdout when PROTO_INFO matches its long form) stays
    off stdout, and the selection is still learned; the control run with ``UCX_PROTO_INFO=*get*`` shows the
    table is what the check would see."""
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    env.pop("UCX_PROTO_INFO", None)
    out = subprocess.run([sys.executable, "-c", _NO_TABLE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    quiet, _, loud = out.stdout.partition("P2PKV-TEST-CONTROL")
    assert "ucp_get" not in quiet and "ucp_put" not in quiet and "| Range" not in quiet, quiet
    assert "remote memory read by ucp_get*" in loud and "| Range" in loud, loud
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("P2PKV-TEST-REPORTS ")]
    assert line.endswith("{'READ': ('READ', 'cma'), 'WRITE': ('WRITE', 'cma')}"), line


def test_vram_over_tcp_is_warned_once_naming_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The decision and the message (GPU memory cannot be registered on this CPU host)."""
    monkeypatch.setattr(transport, "_warned_vram_tcp", set())
    slow = TransportReport("peer-a", "VRAM", "tcp", "intra-node",
                           "intra-node cfg#1 get_multi into cuda from cuda: 0..inf software emulation tcp/lo")
    assert slow.vram_over_tcp
    assert not TransportReport("p", "VRAM", "cuda_ipc", "intra-node", "").vram_over_tcp
    assert not TransportReport("p", "DRAM", "tcp", "intra-node", "").vram_over_tcp
    slow_write = TransportReport("peer-b", "VRAM", "tcp", "intra-node", "", "WRITE", "zero-copy")
    assert slow_write.vram_over_tcp
    with caplog.at_level(logging.WARNING, logger="p2pkv.dataplane.transport"):
        assert warn_vram_over_tcp(slow)
        assert not warn_vram_over_tcp(slow)
        assert warn_vram_over_tcp(slow_write)  # once per op
        assert not warn_vram_over_tcp(slow_write)
    read_msg, write_msg = (r.getMessage() for r in caplog.records)
    assert "READs from peer-a go over TCP" in read_msg and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in read_msg
    assert "WRITEs to peer-b go over TCP" in write_msg and "GET_ZCOPY" not in write_msg
    assert "hostPID: true" in write_msg


def test_vram_reads_over_tcp_under_auto_are_told_at_info_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Under ``transfer_mode: auto`` the prefill rank WRITEs where READs crawl: no warning to alarm anyone, one
    INFO line saying so and what would make READs fast too. WRITEs over TCP still warn."""
    monkeypatch.setattr(transport, "_warned_vram_tcp", set())
    slow = TransportReport("peer-a", "VRAM", "tcp", "intra-node", "get_multi into cuda from cuda: tcp/lo")
    slow_write = TransportReport("peer-b", "VRAM", "tcp", "intra-node", "", "WRITE", "zero-copy")
    with caplog.at_level(logging.INFO, logger="p2pkv.dataplane.transport"):
        assert warn_vram_over_tcp(slow, pushed_instead=True)
        assert warn_vram_over_tcp(slow_write, pushed_instead=True)
    (read_rec, write_rec) = caplog.records
    assert read_rec.levelno == logging.INFO and "transfer_mode auto has the prefill rank WRITE instead" in (
        read_rec.getMessage()) and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in read_rec.getMessage()
    assert write_rec.levelno == logging.WARNING and "WRITEs to peer-b go over TCP" in write_rec.getMessage()


@pytest.mark.gpu
def test_vram_pair_with_cuda_ipc_get_enabled_does_not_use_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    result = pair_transfers("VRAM", nbytes=64 << 20)
    ok, detail, _ = verdict(result)
    assert result.bytes_ok and result.write_bytes_ok and ok, detail
    assert result.report.mem_type == "VRAM" and "tcp" not in result.report.transport.split("+"), detail
    assert result.write_report.op == "WRITE" and "tcp" not in result.write_report.transport.split("+"), detail


@pytest.mark.gpu
def test_vram_pair_over_tcp_fails_the_check_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")  # no cuda_ipc: GPU memory can only go over TCP
    result = pair_transfers("VRAM", nbytes=4 << 20)
    ok, detail, fix = verdict(result)
    assert result.bytes_ok and result.write_bytes_ok and result.report.vram_over_tcp, detail
    assert result.write_report.vram_over_tcp, detail
    assert not ok and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in fix and "WRITEs: " in fix


def _vram_pair(read: str, read_protocol: str, write: str, write_protocol: str) -> PairResult:
    """A VRAM pair's result as the H200 run reported it (docs/benchmarks/transfer-h200.md), transports chosen."""
    return PairResult("VRAM", 16 << 20, 0.03, True,
                      TransportReport("src", "VRAM", read, "intra-node", "get_multi", "READ", read_protocol), 6e-5,
                      True, TransportReport("dst", "VRAM", write, "intra-node", "put_multi", "WRITE", write_protocol))


def test_vram_pair_whose_reads_alone_go_over_tcp_passes_because_auto_pushes() -> None:
    """One GPU without NVLink: UCX READs over TCP but WRITEs by cuda_ipc; transfer_mode auto (the default) pushes."""
    ok, detail, fix = verdict(_vram_pair("tcp", "software emulation", "cuda_ipc", "zero-copy"))
    assert ok, detail
    assert detail.splitlines()[3] == ("transfer_mode auto (the default) and push move this pair's KV by cuda_ipc "
                                      "WRITEs; transfer_mode pull would READ over TCP")
    assert fix.startswith("READs: ") and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in fix


@pytest.mark.parametrize(("read", "read_protocol", "write", "write_protocol"), [
    ("tcp", "software emulation", "tcp", "software emulation"),  # no cuda_ipc at all
    ("cuda_ipc", "zero-copy", "tcp", "software emulation"),  # WRITEs slow: push and auto would be
])
def test_vram_pair_whose_writes_go_over_tcp_fails(read: str, read_protocol: str, write: str,
                                                   write_protocol: str) -> None:
    ok, detail, fix = verdict(_vram_pair(read, read_protocol, write, write_protocol))
    assert not ok and len(detail.splitlines()) == 3 and "WRITEs: " in fix, (detail, fix)
    assert ("READs: " in fix) == (read == "tcp")


def _dot(label: str) -> str:
    return f'digraph {{\n\tnode0 [label="{label}" shape=box style=rounded]\n}}\n'


def test_selection_files_of_get_and_put_are_parsed() -> None:
    """File names as UCX writes them (``ucp_proto_select_write_info``): host memory, and GPU memory whose
    system device UCX knows (``cuda/GPU0`` locally, ``cuda/dev[2]`` for the remote key)."""
    files = {
        "a_intra_node_cfg_1_get_multi_into_host_memory_from_host_0_0.dot": _dot("no data\\n"),
        "a_intra_node_cfg_1_get_multi_into_host_memory_from_host_1_626.dot": _dot("copy-out\\ncma/memory"),
        "a_intra_node_cfg_1_get_multi_into_host_memory_from_host_627_inf.dot": _dot("zero-copy\\ncma/memory"),
        "a_intra_node_cfg_1_put_multi_from_host_memory_to_host_8173_inf.dot": _dot("zero-copy\\ncma/memory"),
        "a_self_cfg_0_put_from_host_memory_to_host_8173_inf.dot": _dot("zero-copy\\ncma/memory"),
        "a_intra_node_cfg_2_put_multi_from_cuda_GPU0_to_cuda_dev_2_0_inf.dot": _dot("zero-copy\\ncuda_ipc/cuda"),
        "a_inter_node_cfg_3_get_multi_into_cuda_GPU0_from_cuda_dev_2_65K_inf.dot":
            _dot("multi-frag copy-in\\nrc_mlx5/mlx5_0:1 cuda_copy/cuda"),
        "not_a_selection.txt": "x",
    }
    sels = {(s.node, s.cfg, s.op, s.local_mem, s.remote_mem): s for s in parse_selections(files)}
    assert set(sels) == {("intra-node", 1, "get_multi", "host", "host"), ("intra-node", 1, "put_multi", "host", "host"),
                         ("self", 0, "put", "host", "host"), ("intra-node", 2, "put_multi", "cuda", "cuda"),
                         ("inter-node", 3, "get_multi", "cuda", "cuda")}
    get = sels[("intra-node", 1, "get_multi", "host", "host")]
    assert [r.start for r in get.rows] == ["0", "1", "627"] and get.xfer_op == "READ"
    put = sels[("intra-node", 2, "put_multi", "cuda", "cuda")]
    assert put.xfer_op == "WRITE" and put.describe() == "intra-node cfg#2 put_multi from cuda to cuda"
    write = summarize("p", "VRAM", [put], "none", "WRITE")
    assert (write.op, write.transport, write.protocol) == ("WRITE", "cuda_ipc", "zero-copy") and is_zero_copy(write)
    staged = summarize("p", "VRAM", [sels[("inter-node", 3, "get_multi", "cuda", "cuda")]], "none")
    assert staged.transport == "cuda_copy+rc_mlx5" and not read_is_zero_copy(staged)


@pytest.mark.parametrize(("transport_", "protocol", "zero_copy"), [
    ("cma", "zero-copy", True),
    ("cuda_ipc", "zero-copy", True),
    ("rc_mlx5", "zero-copy", True),
    ("dc_mlx5+rc_mlx5", "zero-copy", True),
    ("xpmem", "copy from mapped remote memory", True),
    ("knem", "", True),  # a report built without a protocol is judged by its transports
    ("tcp", "software emulation", False),
    ("tcp", "zero-copy", False),  # UCX calls tcp's PUT zero-copy; the kernel still copies through sockets
    ("cuda_copy+rc_mlx5", "zero-copy", False),  # GPU memory staged through host memory
    ("cma", "multi-frag copy-in", False),
    ("posix", "copy-in", False),
    ("unknown", "", False),
])
def test_zero_copy_is_decided_by_ucx_transport_and_protocol(transport_: str, protocol: str, zero_copy: bool) -> None:
    read = TransportReport("p", "VRAM", transport_, "intra-node", "", "READ", protocol)
    write = TransportReport("p", "VRAM", transport_, "intra-node", "", "WRITE", protocol)
    assert is_zero_copy(read) is zero_copy and read_is_zero_copy(read) is zero_copy
    assert is_zero_copy(write) is zero_copy and read_is_zero_copy(write) is False  # a WRITE says nothing of READs


def test_why_a_transport_is_unknown_names_the_environment() -> None:
    def why(env: dict[str, str]) -> dict[str, str]:
        watch = TransportWatch("agent", env)
        try:
            return watch._why_none
        finally:
            watch.close()

    assert why({"UCX_PROTO_INFO": "n"})["WRITE"] == "UCX_PROTO_INFO=n turns UCX's protocol report off"
    only_get = why({"UCX_PROTO_INFO": "*get*"})
    assert only_get["READ"] == "UCX reported no protocol selection for READs"
    assert only_get["WRITE"] == "UCX_PROTO_INFO=*get* (environment) does not match UCX's put selections"
    assert why({})["WRITE"] == "UCX reported no protocol selection for WRITEs"
    assert TransportWatch("agent", {}).engine_config().startswith("PROTO_INFO=[gp][eu]t*,PROTO_INFO_DIR=")
