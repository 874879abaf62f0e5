"""Which UCX transport moves a peer's READs: learned from UCX's protocol selection, logged, counted.

Real prefill workers in their own processes (:class:`tests.p2p_harness.PrefillProc`)
and a real decode worker here; on this CPU host UCX moves host memory
between processes with ``cma`` (``process_vm_readv``), or with TCP when
``UCX_TLS=tcp`` leaves it nothing else. The GPU tests need a CUDA device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from p2pkv.dataplane import transport
from p2pkv.dataplane.transport import TransportReport, warn_vram_over_tcp
from p2pkv.tools.doctor_pair import pair_pull, verdict
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
    assert len(lines) == 2 and all("into DRAM move over UCX cma (intra-node" in m for m in lines)
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


def test_report_transport_off_reports_nothing() -> None:
    pf = PrefillProc(free_port(), seed=7, num_blocks=64)
    pf.start()
    d = DecodeSide(64, report_transport=False, **DECODE_CFG)
    try:
        _pull(d, pf, "o1", [1], [2])
        stats = d.worker.take_stats()
        assert d.worker.agent.transports == {}
    finally:
        d.close()
        pf.stop()
    assert stats is not None and stats["transports"] == {}


def test_dram_pair_in_two_processes_reads_with_cma() -> None:
    result = pair_pull("DRAM", nbytes=4 << 20)
    ok, detail, fix = verdict(result)
    assert result.bytes_ok and ok and fix == ""
    assert result.report.transport == "cma" and "DRAM pair on this host: UCX moves READs with cma" in detail


def test_vram_over_tcp_is_warned_once_naming_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The decision and the message (GPU memory cannot be registered on this CPU host)."""
    monkeypatch.setattr(transport, "_warned_vram_tcp", False)
    slow = TransportReport("peer-a", "VRAM", "tcp", "intra-node",
                           "intra-node cfg#1 get_multi into cuda from cuda: 0..inf software emulation tcp/lo")
    assert slow.vram_over_tcp
    assert not TransportReport("p", "VRAM", "cuda_ipc", "intra-node", "").vram_over_tcp
    assert not TransportReport("p", "DRAM", "tcp", "intra-node", "").vram_over_tcp
    with caplog.at_level(logging.WARNING, logger="p2pkv.dataplane.transport"):
        assert warn_vram_over_tcp(slow)
        assert not warn_vram_over_tcp(slow)
    (record,) = caplog.records
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in record.getMessage() and "peer-a" in record.getMessage()


@pytest.mark.gpu
def test_vram_pair_with_cuda_ipc_get_enabled_does_not_use_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    result = pair_pull("VRAM", nbytes=64 << 20)
    ok, detail, _ = verdict(result)
    assert result.bytes_ok and ok, detail
    assert result.report.mem_type == "VRAM" and "tcp" not in result.report.transport.split("+"), detail


@pytest.mark.gpu
def test_vram_pair_over_tcp_fails_the_check_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")  # no cuda_ipc: GPU memory can only go over TCP
    result = pair_pull("VRAM", nbytes=4 << 20)
    ok, detail, fix = verdict(result)
    assert result.bytes_ok and result.report.vram_over_tcp, detail
    assert not ok and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in fix
