"""``transfer_mode: auto`` between two real workers: pull until UCX reports how READs move, then push where
they are not zero-copy.

The prefill worker runs in its own process (real NIXL, UCX over loopback);
the decode worker here. On this host UCX moves host memory with ``cma``
(zero-copy), so ``auto`` keeps pulling; the report of GPU memory over TCP is
then handed to the decode worker as its agent would hand it (no GPU here),
and the next pull from that peer is pushed — bytes still equal.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from handshake import KVRegion
from p2pkv.dataplane.agent import TransferError
from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.direction import Direction, choose
from p2pkv.decode.probe import PROBE_BYTES, PROBE_REMEMBERED, TransportProbe
from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import block_bytes, make_kv_caches
from p2pkv.worker import WorkerSide
from tests.clock import FakeClock
from tests.fault_injection.support import released_once_not_expired
from tests.p2p_harness import PrefillProc
from tests.workers import SHAPE, free_port, make_worker, model_info, run_until_received, task

LAYOUT = "BLHNC"


def _report(peer: str, mem_type: str, transport: str, protocol: str = "zero-copy") -> TransportReport:
    return TransportReport(peer, mem_type, transport, "intra-node", "", "READ", protocol)


@pytest.mark.parametrize(("mem_type", "transport", "protocol", "direction"), [
    ("DRAM", "cma", "zero-copy", Direction.PULL),
    ("VRAM", "cuda_ipc", "zero-copy", Direction.PULL),
    ("DRAM", "rc_mlx5", "zero-copy", Direction.PULL),
    ("VRAM", "tcp", "software emulation", Direction.PUSH),
    ("DRAM", "tcp", "software emulation", Direction.PUSH),
    ("VRAM", "cuda_copy+rc_mlx5", "multi-frag copy-in", Direction.PUSH),
    ("VRAM", "unknown", "", Direction.PULL),
])
def test_auto_pushes_only_where_reads_are_not_zero_copy(mem_type, transport, protocol, direction) -> None:
    choice = choose("auto", _report("peer", mem_type, transport, protocol))
    assert choice.direction is direction
    assert transport in choice.reason and choice.reason.startswith("auto: ")


def test_settings_other_than_auto_are_kept_whatever_ucx_says() -> None:
    tcp = _report("peer", "VRAM", "tcp", "software emulation")
    assert choose("pull", tcp).direction is Direction.PULL
    assert choose("push", _report("peer", "DRAM", "cma")).direction is Direction.PUSH
    assert choose("auto", None).direction is Direction.PULL  # no READ from the peer yet


def _auto_decode_worker(caplog: pytest.LogCaptureFixture) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                  dict[str, torch.Tensor], WorkerSide]:
    """The prefill's expected caches, then a zeroed decode cache (its base tensor and per-layer views) and a decode
    worker in ``auto`` on it; ``p2pkv.decode``'s INFO lines captured."""
    _, expected = make_kv_caches(LAYOUT, seed=1, **SHAPE)
    base, views = make_kv_caches(LAYOUT, fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port(), transfer_mode="auto")
    worker.model = model_info(LAYOUT)
    worker.register_kv_caches(views, SHAPE["num_blocks"])
    caplog.set_level(logging.INFO, logger="p2pkv.decode")
    return expected, base, views, worker


def test_auto_pulls_over_cma_then_pushes_once_reads_are_reported_over_tcp(prefill: PrefillProc,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    port = prefill.port
    prefill.lease(["req-1", "req-2", "req-3"])
    expected, base, views, worker = _auto_decode_worker(caplog)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-1", "req-1", port, [3, 4], [10, 11])]))
        assert run_until_received(worker, "d-1") == set()
        released_once_not_expired(prefill, "req-1", timeout_s=30)
        (peer,) = worker.receiver.directions.choices
        choice = worker.receiver.directions.choices[peer]
        assert choice.direction is Direction.PULL and "cma (zero-copy)" in choice.reason  # UCX's real report
        worker._on_transport(_report(peer, "VRAM", "tcp", "software emulation"))  # as the agent hands it over
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-2", "req-2", port, [20, 21, 22], [30, 31, 32])]))
        assert run_until_received(worker, "d-2") == set()
        released_once_not_expired(prefill, "req-2", timeout_s=30)
        assert worker.stats.data["directions"] == {"pull": 1, "push": 1}
        for local, remote in ((3, 10), (4, 11), (20, 30), (21, 31), (22, 32)):
            assert block_bytes(views, LAYOUT, local) == block_bytes(expected, LAYOUT, remote)
        # A request that names its direction wins over the peer's choice.
        spec = task("d-3", "req-3", port, [40], [50])
        spec = dataclasses.replace(spec, remote=dataclasses.replace(spec.remote, transfer_mode="pull"))
        worker.start_load_kv(P2pKvMetadata(loads=[spec]))
        assert run_until_received(worker, "d-3") == set()
        assert worker.stats.data["directions"] == {"pull": 2, "push": 1}
        assert block_bytes(views, LAYOUT, 40) == block_bytes(expected, LAYOUT, 50)
    finally:
        worker.shutdown()
    logged = [r.getMessage() for r in caplog.records if "from prefill agent" in r.getMessage()]
    assert any("push from prefill agent" in m and "VRAM move by tcp" in m for m in logged)
    assert base.abs().sum() > 0


def test_auto_pushes_the_first_request_when_the_probe_finds_reads_over_tcp(
        prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The decode rank's UCX may use TCP only, so READs of this pair go over TCP; the probe READ right after the
    handshake says so, and the very first request is pushed (before the probe it was READ over TCP)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    prefill.lease(["req-t1", "req-t2"])
    expected, base, views, worker = _auto_decode_worker(caplog)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-t1", "req-t1", port := prefill.port, [5, 6], [12, 13])]))
        assert run_until_received(worker, "d-t1") == set()
        released_once_not_expired(prefill, "req-t1", timeout_s=30)
        assert worker.stats.data["directions"] == {"push": 1}, port
        (peer,) = worker.receiver.directions.choices
        assert "DRAM move by tcp, not zero-copy" in worker.receiver.directions.choices[peer].reason
        assert worker.receiver.agent.transports[peer].transport == "tcp"
        for local, remote in ((5, 12), (6, 13)):
            assert block_bytes(views, LAYOUT, local) == block_bytes(expected, LAYOUT, remote)
        # The peer dropped (idle, say): what was learned of it goes with it; back again, it is probed again.
        (pid,) = worker.receiver.peers.peers
        with worker.receiver.lock:
            worker.receiver.keeper.forget(pid, "dropped by the test")
        assert worker.receiver.directions.choices == {} and peer not in worker.receiver.agent.transports
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-t2", "req-t2", port, [15], [22])]))
        assert run_until_received(worker, "d-t2") == set()
        released_once_not_expired(prefill, "req-t2", timeout_s=30)
        assert worker.stats.data["directions"] == {"push": 2}
        assert worker.receiver.agent.transports[peer].transport == "tcp"
        assert block_bytes(views, LAYOUT, 15) == block_bytes(expected, LAYOUT, 22)
    finally:
        worker.shutdown()
    logged = [r.getMessage() for r in caplog.records if "from prefill agent" in r.getMessage()]
    assert not any(m.startswith("p2pkv: pull from prefill agent") for m in logged), logged  # pushed from the start
    assert base.abs().sum() > 0


class _StuckAgent:
    """A NIXL agent whose READs never finish or fail at once (fault injection for the probe)."""

    mem_type = "DRAM"

    def __init__(self, fail: bool, clock: FakeClock) -> None:
        self.fail, self.clock = fail, clock
        self.transports: dict[str, TransportReport] = {}
        self.registered: list[tuple] = []
        self.posted: list[tuple] = []
        self.cancelled = 0

    def register(self, regions, mem_type, device_id) -> None:
        self.registered.append((regions, mem_type, device_id))

    def start_read(self, peer, local, remote):
        if self.fail:
            raise TransferError("peer gone")
        self.posted.append((peer, local.copy(), remote.copy()))
        return "xfer"

    def poll(self, xfer) -> bool:
        self.clock.now += 0.3  # each look takes 0.3 s
        return False

    def cancel(self, xfer) -> bool:
        self.cancelled += 1
        return True


@pytest.mark.parametrize("fail", [False, True])
def test_a_probe_that_hangs_or_fails_is_given_up_and_the_peer_is_pulled_from(fail: bool,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    agent = _StuckAgent(fail, clock)
    probe = TransportProbe(agent, torch.device("cpu"), 0, timeout_s=1.0, clock=clock)
    (regions, mem_type, _), = agent.registered
    assert mem_type == "DRAM" and regions[0].length == PROBE_BYTES
    peer = SimpleNamespace(agent_name="prefill-a", info=SimpleNamespace(layout=SimpleNamespace(
        regions=[KVRegion(base_addr=1 << 20, length=1024, device_id=0)])))
    probe.run(peer)
    probe.run(peer)  # once per remote agent
    assert probe.failed == {"prefill-a": None}
    assert agent.cancelled == (0 if fail else 1)
    if not fail:
        ((name, local, remote),) = agent.posted
        assert name == "prefill-a" and remote.tolist() == [[1 << 20, 1024, 0]] and local[0, 1] == 1024
    assert any("probe READ from prefill agent prefill-a failed" in r.getMessage() for r in caplog.records)
    empty = SimpleNamespace(agent_name="prefill-b", info=SimpleNamespace(layout=SimpleNamespace(regions=[])))
    probe.run(empty)  # no memory to READ: no probe, no error
    assert "prefill-b" in probe.failed and len(agent.posted) == (0 if fail else 1)
    for i in range(PROBE_REMEMBERED + 5):  # restarted prefill ranks, each under a new name: the table stays bounded
        probe.run(SimpleNamespace(agent_name=f"gone-{i}", info=empty.info))
    assert len(probe.failed) == PROBE_REMEMBERED and f"gone-{PROBE_REMEMBERED + 4}" in probe.failed
    probe.forget("gone-0")  # forgetting one that is not there is fine
    probe.forget(f"gone-{PROBE_REMEMBERED + 4}")
    assert f"gone-{PROBE_REMEMBERED + 4}" not in probe.failed


def test_a_probe_that_raises_leaves_the_pull_to_go_on(prefill: PrefillProc, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Whatever the probe does after a handshake, the pull that waited for it begins (here: pulled)."""
    def broken(self: TransportProbe, peer: object) -> None:
        raise RuntimeError("probe bug")

    monkeypatch.setattr(TransportProbe, "run", broken)
    prefill.lease(["req-b1"])
    expected, _, views, worker = _auto_decode_worker(caplog)
    try:
        worker.start_load_kv(P2pKvMetadata(loads=[task("d-b1", "req-b1", prefill.port, [7], [9])]))
        assert run_until_received(worker, "d-b1") == set()
        assert block_bytes(views, LAYOUT, 7) == block_bytes(expected, LAYOUT, 9)
        released_once_not_expired(prefill, "req-b1", timeout_s=30)
    finally:
        worker.shutdown()
    assert "on_peer failed" in caplog.text and "probe bug" in caplog.text
