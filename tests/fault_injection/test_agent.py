"""NIXL faults outside a pull's polling: agent creation, registration, metadata, posting a READ, shutdown.

Each fails with a TransferError that names the NIXL operation (so an engine
refuses to start with a clear message), or, at shutdown, is logged and
swallowed so cleanup still finishes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import Region
from p2pkv.testing import make_kv_caches
from p2pkv.tools.doctor import loopback_info as agent_info_for
from tests.faults import FaultyNixlAgent


def _agent(name: str) -> NixlTransferAgent:
    return NixlTransferAgent(name, ["UCX"])


def test_bad_backend_and_backend_params_are_named() -> None:
    with pytest.raises(TransferError, match=r"NOPE.*unavailable"):
        NixlTransferAgent("a1", ["NOPE"])
    with pytest.raises(TransferError, match="rejected parameters"):
        NixlTransferAgent("a2", ["UCX"], backend_params={"UCX": {"ucx_error_handling_mode": "bogus"}})


@pytest.mark.parametrize(("method", "call", "match"), [
    ("register_memory", "register", "register_memory"),
    ("get_agent_metadata", "metadata", "get_agent_metadata"),
])
def test_startup_faults_raise_transfer_error(method: str, call: str, match: str) -> None:
    agent = _agent(f"a-{method}")
    base, _ = make_kv_caches("BLHNC", num_blocks=8)
    agent._agent = FaultyNixlAgent(agent._agent, method, 1)
    with pytest.raises(TransferError, match=match):
        if call == "register":
            agent.register([Region(base.data_ptr(), base.numel() * base.element_size())], "DRAM")
        else:
            agent.metadata()
    agent.close()


@pytest.mark.parametrize("method", ["deregister_memory", "remove_remote_agent"])
def test_shutdown_faults_are_swallowed(method: str) -> None:
    peer = _agent("peer-for-close")
    agent = _agent(f"closing-{method}")
    base, _ = make_kv_caches("BLHNC", num_blocks=8)
    agent.register([Region(base.data_ptr(), base.numel() * base.element_size())], "DRAM")
    agent.add_peer(agent_info_for(peer))
    agent._agent = FaultyNixlAgent(agent._agent, method, 1, times=None)
    agent.close()  # logs, does not raise
    agent.close()  # idempotent
    assert agent._agent.faults >= 1
    peer.close()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_post_that_raises_releases_its_transfer_handle(op: str) -> None:
    """``transfer`` raising (a peer gone mid-post): TransferError, and the handle ``initialize_xfer`` made is
    released (one ``release_xfer_handle``); the next xfer moves the bytes. A READ pulls the owner's cache into
    the poster's; a WRITE (push mode: the prefill rank posts) puts the poster's cache into the peer's, whose
    notification arrives with the bytes (the failed post's never does)."""
    src, _ = make_kv_caches("BLHNC", num_blocks=8, seed=3)
    dst, _ = make_kv_caches("BLHNC", num_blocks=8, fill=0.0)
    nbytes = src.numel() * src.element_size()
    poster, other = _agent(f"post-{op.lower()}-poster"), _agent(f"post-{op.lower()}-other")
    mine, theirs = (dst, src) if op == "READ" else (src, dst)
    poster.register([Region(mine.data_ptr(), nbytes)], "DRAM")
    other.register([Region(theirs.data_ptr(), nbytes)], "DRAM")
    peer = poster.add_peer(agent_info_for(other))
    local = np.array([(mine.data_ptr(), nbytes, 0)], dtype=np.uint64)
    remote = np.array([(theirs.data_ptr(), nbytes, 0)], dtype=np.uint64)
    counter = FaultyNixlAgent(poster._agent, "release_xfer_handle", 10**9)
    poster._agent = FaultyNixlAgent(counter, "transfer", 1)
    with pytest.raises(TransferError, match=f"NIXL {op} .* could not start"):
        poster.start_xfer(op, peer, local, remote, b"failed-post")  # type: ignore[arg-type]
    assert counter.calls["release_xfer_handle"] == 1
    assert torch.count_nonzero(dst) == 0
    handle = poster.start_xfer(op, peer, local, remote, b"second-post")  # type: ignore[arg-type]
    notes: list[bytes] = []
    while not poster.poll(handle):
        notes += other.get_notifs()
    assert torch.equal(dst, src)
    if op == "WRITE":
        end = time.monotonic() + 10
        while not notes and time.monotonic() < end:
            notes += other.get_notifs()
        assert notes == [b"second-post"]
    poster.close()
    other.close()
