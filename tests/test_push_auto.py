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

import pytest

from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.direction import Direction, choose
from p2pkv.metadata import P2pKvMetadata
from p2pkv.testing import block_bytes, make_kv_caches
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


def test_auto_pulls_over_cma_then_pushes_once_reads_are_reported_over_tcp(prefill: PrefillProc,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    port = prefill.port
    prefill.lease(["req-1", "req-2", "req-3"])
    _, expected = make_kv_caches(LAYOUT, seed=1, **SHAPE)
    base, views = make_kv_caches(LAYOUT, fill=0.0, **SHAPE)
    worker = make_worker("decode-engine", free_port(), transfer_mode="auto")
    worker.model = model_info(LAYOUT)
    worker.register_kv_caches(views, SHAPE["num_blocks"])
    caplog.set_level(logging.INFO, logger="p2pkv.decode")
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
