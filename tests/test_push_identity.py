"""Push mode over real NIXL agents: a push request loads, replaces and writes into only its requester's own
agent, only inside the memory that agent declares, loads nothing for a request it refuses, and the decode
agents a prefill rank loads leave NIXL when idle.

Two real NIXL agents in this process (UCX over loopback) behind a real side channel and
:class:`p2pkv.prefill.pusher.Pusher`. What NIXL has loaded is asked of NIXL itself
(``check_remote_metadata``). The same rules at scale, and with WRITEs held in flight, are in
``tests/test_push_agents.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch

from handshake import AgentInfo, Destination, KVRegion, PushReply, compute_digest, request_push
from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
from p2pkv.dataplane.layout import Region
from p2pkv.notification import PUSH_PREFIX, PushedNotification, parse_pushed
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.write_engine import WriteEngine
from tests.clock import FakeClock
from tests.polling import wait_until
from tests.push_support import DECODE, ENGINE, HOST, KEY, NUM_BLOCKS, Agents, descs, make_agents, side_channel

VICTIM = DECODE
ATTACKER = "attacker-engine"


@dataclass
class Prefill:
    holds: PrefillHolds
    pusher: Pusher
    port: int
    clock: FakeClock


@pytest.fixture
def clocked_pusher(agents: Agents) -> Iterator[Prefill]:
    agents.target.zero_()
    agents.spare.zero_()
    agents.decode.take_notifs(PUSH_PREFIX)
    holds, clock = PrefillHolds(lease_s=30.0), FakeClock()
    engine = WriteEngine(agents.prefill, KEY, max_agents=4, agent_idle_s=30.0, clock=clock)
    pusher = Pusher(engine, holds, agents.layout)
    with side_channel(pusher.on_push, secret=KEY) as srv:
        try:
            yield Prefill(holds, pusher, srv.port, clock)
        finally:
            pusher.close()
    assert not agents.prefill.peers(), "the pusher left decode agents in NIXL"


def send(pf: Prefill, requester: str, info: AgentInfo, request_id: str, source: np.ndarray,
         target: np.ndarray, block_ids: list[int]) -> PushReply:
    return request_push(Destination(HOST, pf.port, ENGINE, 0), request_id, block_ids, bytes(16), info,
                        source.astype("<u8").tobytes(), target.astype("<u8").tobytes(), 5.0, requester, secret=KEY,
                        timeout_s=5.0)


def nixl_knows(agent: NixlTransferAgent, name: str) -> bool:
    """Whether NIXL holds metadata of remote agent ``name`` (asked of NIXL, not of p2pkv's bookkeeping)."""
    return bool(agent._agent.check_remote_metadata(name))


def pushed(agents: Agents) -> PushedNotification:
    """The next push notification the decode agent receives."""
    found: list[PushedNotification] = []

    def arrived() -> bool:
        found.extend(n for n in (parse_pushed(m, KEY) for m in agents.decode.take_notifs(PUSH_PREFIX)) if n)
        return bool(found)

    wait_until(arrived)
    return found[0]


def own_push(agents: Agents, pf: Prefill, request_id: str, blocks: list[int], into: list[int]) -> None:
    """The decode rank pushes its own request; the bytes land."""
    pf.holds.hold(request_id, 1e12, tuple(blocks))
    reply = send(pf, VICTIM, agents.info(), request_id, descs(agents.layout, blocks),
                 descs(agents.decode_layout, into), blocks)
    assert reply.status == "accepted", reply
    assert pushed(agents).ok
    assert all(torch.equal(agents.target[d], agents.source[s]) for d, s in zip(into, blocks, strict=True))


# ---- nothing for a request that is refused ----------------------------------------------------------------------
def test_a_request_for_an_id_never_held_loads_no_agent(agents: Agents, clocked_pusher: Prefill) -> None:
    reply = send(clocked_pusher, VICTIM, agents.info(), "never-held", descs(agents.layout, [2]),
                 descs(agents.decode_layout, [2]), [2])
    assert reply.status == "unknown"
    assert not nixl_knows(agents.prefill, agents.decode.name), "NIXL loaded the agent of a request it refused"
    assert clocked_pusher.pusher.agents() == {} and clocked_pusher.pusher.writes_left() == 0


# ---- another engine's agent -------------------------------------------------------------------------------------
def test_an_agent_under_another_engines_name_loads_nothing_and_the_owner_still_pushes(agents: Agents,
                                                                                      clocked_pusher: Prefill) -> None:
    """Another engine sends one push request, for an id never held, carrying an agent of its own named like
    the victim's (its NIXL metadata names the victim's agent). It must not make NIXL map the victim's name to
    that metadata: the victim's own pushes work after it."""
    impostor = NixlTransferAgent(agents.decode.name)
    try:
        meta = impostor.metadata()
        forged = msgspec.structs.replace(agents.info(), engine_id=ATTACKER, agent_metadata=meta,
                                         metadata_digest=compute_digest(meta))
        reply = send(clocked_pusher, ATTACKER, forged, "never-held", descs(agents.layout, [3]),
                     descs(agents.decode_layout, [3]), [3])
        assert reply.status == "refused" and "agent" in reply.message, reply
        assert not nixl_knows(agents.prefill, agents.decode.name) and clocked_pusher.pusher.agents() == {}
        own_push(agents, clocked_pusher, "first", [1], [1])
        own_push(agents, clocked_pusher, "second", [4, 5], [6, 7])
        assert clocked_pusher.pusher.agents() == {(VICTIM, 0): agents.decode.name}
    finally:
        impostor.close()


def test_a_push_naming_another_engines_agent_writes_nothing(agents: Agents, clocked_pusher: Prefill) -> None:
    """The victim's genuine AgentInfo (any secret holder can fetch it), sent by another engine."""
    clocked_pusher.holds.hold("attack", 1e12, (3,))
    reply = send(clocked_pusher, ATTACKER, agents.info(), "attack", descs(agents.layout, [3]),
                 descs(agents.decode_layout, [3]), [3])
    assert reply.status == "refused" and "requester" in reply.message, reply
    time.sleep(0.05)
    assert torch.count_nonzero(agents.target) == 0, "the WRITE reached another engine's memory"
    assert not nixl_knows(agents.prefill, agents.decode.name) and clocked_pusher.holds._pins == {}


# ---- only the memory the agent declares --------------------------------------------------------------------------
def test_rows_into_registered_memory_the_agent_does_not_declare_are_refused(agents: Agents,
                                                                            clocked_pusher: Prefill) -> None:
    spare = agents.spare
    agents.decode.register([Region(spare.data_ptr(), spare.numel())], "DRAM")
    clocked_pusher.holds.hold("r", 1e12, (3,))
    source = descs(agents.layout, [3])
    into_spare = source.copy()
    into_spare[:, 0] = spare.data_ptr() + np.arange(len(source), dtype=np.uint64) * source[:, 1]
    reply = send(clocked_pusher, VICTIM, agents.info(), "r", source, into_spare, [3])
    assert reply.status == "refused" and "target_rows" in reply.message, reply
    time.sleep(0.05)
    assert torch.count_nonzero(spare) == 0 and clocked_pusher.pusher.agents() == {}
    assert not nixl_knows(agents.prefill, agents.decode.name)
    # Declared as staging, the same rows are written (the decode rank's staging area, registered after its
    # first push: its agent is loaded again with the new metadata).
    own_push(agents, clocked_pusher, "kv", [1], [1])
    staged = agents.info(staging=[KVRegion(base_addr=spare.data_ptr(), length=spare.numel())])
    reply = send(clocked_pusher, VICTIM, staged, "r", source, into_spare, [3])
    assert reply.status == "accepted", reply
    assert pushed(agents).ok
    n = int(source[:, 1].sum())
    assert torch.equal(spare[:n], agents.source[3].flatten().view(torch.uint8)[:n])


# ---- bounded ----------------------------------------------------------------------------------------------------
def alias(info: AgentInfo, engine_id: str) -> AgentInfo:
    """``info`` as another engine's agent: its NIXL metadata renamed (the same UCX worker behind it), so NIXL
    loads it as a remote agent of its own."""
    name = unique_agent_name(engine_id, 0)
    head = b"nixlSerDes|Agent"
    length = int.from_bytes(info.agent_metadata[len(head):len(head) + 8], "little")
    rest = info.agent_metadata[len(head) + 8 + length:]
    meta = head + len(name).to_bytes(8, "little") + name.encode() + rest
    return msgspec.structs.replace(info, engine_id=engine_id, agent_name=name, agent_metadata=meta,
                                   metadata_digest=compute_digest(meta))


def test_sixty_requests_from_agents_never_seen_again_leave_nixl(agents: Agents, clocked_pusher: Prefill) -> None:
    """60 push requests, each from an agent never seen again, 30 of them for ids never held: NIXL never holds
    more than ``max_agents`` (4) of them, none of the 30, and none once they have been idle ``agent_idle_s``."""
    infos = [alias(agents.info(), f"gone-{i}") for i in range(60)]
    most = 0
    for i, info in enumerate(infos):
        held = i % 2 == 0
        if held:
            clocked_pusher.holds.hold(f"r{i}", 1e12, (i % NUM_BLOCKS,))
        reply = send(clocked_pusher, info.engine_id, info, f"r{i}", descs(agents.layout, [i % NUM_BLOCKS]),
                     descs(agents.decode_layout, [i % NUM_BLOCKS]), [i % NUM_BLOCKS])
        assert reply.status == ("accepted" if held else "unknown"), (i, reply)
        # (the decode agent takes its notifications meanwhile: its UCX worker answers the new endpoint)
        wait_until(lambda: not agents.decode.take_notifs(PUSH_PREFIX) and clocked_pusher.pusher.writes_left() == 0)
        known = [j for j, other in enumerate(infos) if nixl_knows(agents.prefill, other.agent_name)]
        assert all(j % 2 == 0 for j in known), f"agents of requests for ids never held loaded: {known}"
        most = max(most, len(known))
        assert len(clocked_pusher.pusher.agents()) <= 4
    assert most <= 4 and clocked_pusher.pusher.counters.written == 30
    clocked_pusher.clock.now += 31.0
    clocked_pusher.pusher.engine.wake()
    # the pusher forgets an idle agent first, then removes it from NIXL (outside its table's lock): wait for both
    wait_until(lambda: not clocked_pusher.pusher.agents()
               and not any(nixl_knows(agents.prefill, info.agent_name) for info in infos))
    assert not [info for info in infos if nixl_knows(agents.prefill, info.agent_name)]
    agents.decode.take_notifs(PUSH_PREFIX)


class _SlowRemoval:
    """A NIXL agent whose ``remove_remote_agent`` sets ``removing``, then sleeps 0.2 s (the GIL released) before it
    removes: another thread loading the same agent meanwhile must not be undone by it."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.removing = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def remove_remote_agent(self, name: str) -> object:
        self.removing.set()
        time.sleep(0.2)
        return self._inner.remove_remote_agent(name)  # type: ignore[attr-defined]


def test_a_remote_agent_loaded_for_one_role_while_the_other_role_drops_it_stays_loaded() -> None:
    """A ``role: both`` engine: its decode side drops a peer it pulled from (the last ``prefill`` use) while its
    prefill side loads the same agent as the ``decode`` rank it pushes to, on another thread. The agent must stay
    loaded for the push, in the table and in NIXL (real NIXL)."""
    with make_agents() as pair:
        agent, info = pair.prefill, pair.decode_info
        nixl = agent._agent
        slow = _SlowRemoval(nixl)
        agent._agent = slow
        try:
            name = agent.add_peer(info, "prefill")
            dropping = threading.Thread(target=agent.remove_peer, args=(name, "prefill"))
            dropping.start()
            assert slow.removing.wait(10)
            assert agent.add_peer(info, "decode") == name  # while NIXL is removing it for the other role
            dropping.join(10)
        finally:
            agent._agent = nixl
        assert agent.peers("decode") == [name] and agent.peers("prefill") == []
        assert nixl.check_remote_metadata(name)  # still loaded in NIXL: a WRITE to it would work
        agent.remove_peer(name, "decode")
        assert agent.peers() == [] and not nixl.check_remote_metadata(name)
