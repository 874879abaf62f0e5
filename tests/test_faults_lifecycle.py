"""NIXL faults outside a pull: agent creation, registration, metadata, shutdown.

Each fails with a TransferError that names the NIXL operation (so an engine
refuses to start with a clear message), or, at shutdown, is logged and
swallowed so cleanup still finishes.
"""

from __future__ import annotations

import pytest

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import Region
from p2pkv.tools.bench.synth import make_kv_caches
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
