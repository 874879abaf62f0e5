"""Push mode, prefill side: the decode ranks a prefill rank keeps loaded stay few, their own, and are never
changed under a WRITE.

A real :class:`p2pkv.prefill.pusher.Pusher` (its thread, its checks, real :class:`PrefillHolds`) over
:class:`FakeNixl`, a stand-in for :class:`p2pkv.dataplane.agent.NixlTransferAgent`. Why a fake: these tests need
10,000 decode agents that die, and WRITEs held in flight or failed on demand; a real NIXL agent owns a UCX worker
(about a second to create, and no way to kill one in-process), so 10,000 of them cannot be made. The fake checks
what NIXL would not tell: that no remote agent is reloaded, replaced or removed while a WRITE to it is in flight.
The same rules over real NIXL agents are in ``tests/test_push_wire.py``.

Time is a fake clock (idle times), moved by hand; waits are for the pusher thread to act, never timed.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from handshake import PROTOCOL_VERSION, AgentInfo, KVLayoutDesc, KVRegion, PushRequest, compute_digest
from p2pkv.dataplane.agent import TransferError, XferHandle, unique_agent_name
from p2pkv.dataplane.layout import KVLayout, describe_torch_kv_caches
from p2pkv.dataplane.plan import build_descriptors, coalesce_runs
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.write_engine import WriteEngine
from p2pkv.testing import make_kv_caches
from tests import polling
from tests.clock import FakeClock

NUM_BLOCKS = 8
SHAPE = dict(num_layers=2, num_blocks=NUM_BLOCKS, num_heads=2, block_size=4, head_dim=4)
BASE = 0x7F00_0000_0000  # where every fake decode rank's KV cache lies (its declared region)
REGION = 1 << 20


@dataclass(eq=False)
class FakeWrite:
    peer: str
    digest: bytes
    held: bool


class FakeNixl:
    """The NIXL calls a :class:`Pusher` makes, on bookkeeping only.

    Attributes:
        loaded: remote agent name → digest of the metadata "NIXL" holds.
        loads: every add_peer that loaded metadata (a reload counts).
        dead: agent names whose WRITEs fail as a disconnected peer's do.
        hold: WRITEs posted while True stay in flight until it is False again.
        writes: every WRITE posted, with the digest loaded for its peer then.
        violations: a reload, replacement or removal of an agent with a WRITE to it in flight.
    """

    def __init__(self) -> None:
        self.loaded: dict[str, bytes] = {}
        self.loads = 0
        self.dead: set[str] = set()
        self.hold = False
        self.writes: list[FakeWrite] = []
        self.flying: collections.Counter[str] = collections.Counter()
        self.violations: list[str] = []

    def peers(self, role: str | None = None) -> list[str]:
        return list(self.loaded)

    def add_peer(self, info: AgentInfo, role: str = "prefill") -> str:
        if self.flying[info.agent_name] and self.loaded.get(info.agent_name) != info.metadata_digest:
            self.violations.append(f"reloaded {info.agent_name} with a WRITE to it in flight")
        if self.loaded.get(info.agent_name) != info.metadata_digest:
            self.loads += 1
        self.loaded[info.agent_name] = info.metadata_digest
        return info.agent_name

    def remove_peer(self, name: str, role: str = "prefill") -> None:
        if self.flying[name]:
            self.violations.append(f"removed {name} with a WRITE to it in flight")
        self.loaded.pop(name, None)

    def start_write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> XferHandle:
        if peer not in self.loaded:
            raise TransferError(f"WRITE to {peer}: not loaded")
        write = FakeWrite(peer, self.loaded[peer], self.hold)
        self.writes.append(write)
        self.flying[peer] += 1
        return XferHandle(peer, write, int(local[:, 1].sum()), int(local.shape[0]), "WRITE")

    def poll(self, xfer: XferHandle) -> bool:
        write: FakeWrite = xfer.handle  # type: ignore[assignment]
        if write.held and self.hold:
            return False
        self.flying[write.peer] -= 1
        if write.peer in self.dead:
            raise TransferError(f"NIXL WRITE to {write.peer} failed", RuntimeError("NIXL_ERR_REMOTE_DISCONNECT"))
        return True

    def cancel(self, xfer: XferHandle) -> bool:
        return False  # still active: polled until it ends

    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer not in self.loaded or peer in self.dead:
            raise TransferError(f"notification to {peer}: not reachable")


def fake_metadata(name: str, extra: bytes = b"") -> bytes:
    """Metadata in NIXL's serialized form: the agent name first."""
    raw = name.encode()
    return b"nixlSerDes|Agent" + len(raw).to_bytes(8, "little") + raw + b"|Conns" + extra


def decode_info(engine_id: str, rank: int = 0, name: str | None = None, extra: bytes = b"",
                staging: list[KVRegion] | None = None) -> AgentInfo:
    """The AgentInfo a decode worker of ``engine_id`` sends: its own agent name, one declared KV region at BASE."""
    name = name or unique_agent_name(engine_id, rank)
    meta = fake_metadata(name, extra)
    layout = KVLayoutDesc(kv_layout="BLHNC", attn_layout="HND", dtype="float32", num_layers=2, num_kv_heads=2,
                          head_dim=4, block_size=4, num_blocks=NUM_BLOCKS, block_len=1, block_stride=1,
                          mem_type="DRAM", regions=[KVRegion(base_addr=BASE, length=REGION)])
    return AgentInfo(engine_id=engine_id, tp_rank=rank, tp_size=rank + 1, agent_name=name, agent_metadata=meta,
                     metadata_digest=compute_digest(meta), compat_hash="c", layout=layout, staging=staging or [])


@pytest.fixture(scope="module")
def layout() -> KVLayout:
    _, views = make_kv_caches("BLHNC", **SHAPE)
    return describe_torch_kv_caches(views, NUM_BLOCKS)


def request(layout: KVLayout, info: AgentInfo, request_id: str, block: int = 1,
            target: int = BASE) -> PushRequest:
    """``info``'s push request for held request ``request_id`` (block ``block``) into ``target``."""
    starts, _, lengths = coalesce_runs([block], [block], NUM_BLOCKS, NUM_BLOCKS)
    source = build_descriptors(layout.segments, starts, lengths)
    dest = source.copy()
    dest[:, 0] = target + np.arange(dest.shape[0], dtype=np.uint64) * dest[:, 1]
    return PushRequest(protocol_version=PROTOCOL_VERSION, to_engine_id="prefill", to_rank=0, sent_at=time.time(),
                       nonce=os.urandom(16), requester_engine_id=info.engine_id, request_id=request_id,
                       block_ids=[block], push_id=os.urandom(16), agent=info,
                       source_rows=source.astype("<u8").tobytes(), target_rows=dest.astype("<u8").tobytes(),
                       window_s=600.0)


@dataclass
class Rig:
    pusher: Pusher
    nixl: FakeNixl
    holds: PrefillHolds
    clock: FakeClock
    layout: KVLayout

    def push(self, info: AgentInfo, request_id: str, hold: bool = True, **kw: int) -> tuple[str, str]:
        """Hold ``request_id`` (block 1) when ``hold``, then send ``info``'s push request for it."""
        if hold:
            self.holds.hold(request_id, 1e12, (kw.get("block", 1),))
        return self.pusher.on_push(request(self.layout, info, request_id, **kw))

    def settle(self) -> None:
        """Wait until the pusher thread has posted and ended every WRITE it can."""
        wait_until(lambda: self.pusher.writes_left() == 0)

    def tick(self, seconds: float) -> None:
        """Move the clock, and let the pusher thread look at it."""
        self.clock.now += seconds
        self.pusher.engine.wake()


wait_until = functools.partial(polling.wait_until, message="the pusher thread never got there", interval_s=0.0005)


@pytest.fixture
def rig_for(layout: KVLayout) -> Iterator[Callable[..., Rig]]:
    made: list[Pusher] = []

    def make(max_agents: int = 4, idle_s: float = 30.0, max_in_flight: int = 4) -> Rig:
        clock, nixl, holds = FakeClock(), FakeNixl(), PrefillHolds(lease_s=30.0)
        engine = WriteEngine(nixl, None, max_agents=max_agents, agent_idle_s=idle_s, clock=clock)  # type: ignore[arg-type]
        pusher = Pusher(engine, holds, layout, max_in_flight=max_in_flight)
        made.append(pusher)
        return Rig(pusher, nixl, holds, clock, layout)

    yield make
    for pusher in made:
        pusher.close()


# ---- bounded: 10,000 requests from decode agents that die -------------------------------------------------------
def test_ten_thousand_pushes_from_dying_agents_keep_the_loaded_agents_flat(rig_for: Callable[..., Rig]) -> None:
    """10,000 push requests, each from a decode agent never seen again (distinct engine ids, names and
    metadata); half name request ids never held, and of the other half's agents every second one dies before
    its WRITE ends. The loaded agents and the pusher's entries never exceed ``max_agents``, the requests for
    ids never held load nothing at all, and once idle for ``agent_idle_s`` every agent is gone."""
    cap = 16
    rig = rig_for(max_agents=cap, idle_s=30.0)
    statuses: collections.Counter[str] = collections.Counter()
    most_loaded = most_entries = 0
    for batch in range(10_000 // cap):
        for i in range(batch * cap, (batch + 1) * cap):
            info = decode_info(f"dying-{i}", extra=i.to_bytes(4, "little"))
            held = i % 2 == 0
            if held and i % 4 == 0:
                rig.nixl.dead.add(info.agent_name)
            status, _ = rig.push(info, f"req-{i}", hold=held)
            statuses[status] += 1
            assert status == ("accepted" if held else "unknown"), (i, status)
            most_loaded = max(most_loaded, len(rig.nixl.loaded))
            most_entries = max(most_entries, len(rig.pusher.agents()))
        rig.settle()
        rig.tick(0.01)
        most_loaded = max(most_loaded, len(rig.nixl.loaded))
        most_entries = max(most_entries, len(rig.pusher.agents()))
    assert statuses == {"accepted": 5000, "unknown": 5000}
    assert most_loaded <= cap and most_entries <= cap, (most_loaded, most_entries)
    assert rig.nixl.loads == 5000, "a request for an id never held loaded an agent (or one was loaded twice)"
    assert rig.pusher.counters.written == 2500 and rig.pusher.counters.failed == 2500
    assert rig.holds._pins == {} and rig.nixl.violations == []
    rig.tick(31.0)
    wait_until(lambda: not rig.pusher.agents() and not rig.nixl.loaded)


def test_a_request_for_an_id_never_held_loads_and_creates_nothing(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for()
    for status, rid in (("unknown", "never-held"),):
        assert rig.push(decode_info("decode"), rid, hold=False) == (status, "")
    rig.holds.hold("other-blocks", 1e12, (2,))
    assert rig.pusher.on_push(request(rig.layout, decode_info("decode"), "other-blocks"))[0] == "not_held"
    assert rig.pusher.agents() == {} and rig.nixl.loaded == {} and rig.nixl.loads == 0
    assert rig.holds._pins == {}


# ---- the cap --------------------------------------------------------------------------------------------------------
def test_past_the_cap_the_least_recently_used_idle_agent_makes_way(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for(max_agents=2)
    a, b, c = (decode_info(e) for e in ("a", "b", "c"))
    assert rig.push(a, "a1")[0] == "accepted"
    rig.settle()
    rig.tick(1.0)
    assert rig.push(b, "b1")[0] == "accepted"
    rig.settle()
    assert set(rig.nixl.loaded) == {a.agent_name, b.agent_name}
    rig.tick(1.0)
    assert rig.push(c, "c1")[0] == "accepted"
    rig.settle()
    wait_until(lambda: set(rig.nixl.loaded) == {b.agent_name, c.agent_name})
    assert set(rig.pusher.agents()) == {("b", 0), ("c", 0)}
    assert rig.push(a, "a2")[0] == "accepted", "an evicted decode rank comes back by its next request"
    rig.settle()
    wait_until(lambda: set(rig.nixl.loaded) == {a.agent_name, c.agent_name})
    assert rig.nixl.violations == [] and rig.pusher.counters.written == 4


def test_past_the_cap_with_every_agent_busy_a_new_one_is_answered_busy(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for(max_agents=2)
    rig.nixl.hold = True
    a, b, c = (decode_info(e) for e in ("a", "b", "c"))
    assert rig.push(a, "a1")[0] == rig.push(b, "b1")[0] == "accepted"
    wait_until(lambda: len(rig.nixl.writes) == 2)
    status, message = rig.push(c, "c1")
    assert status == "busy" and "MAX_AGENTS" in message
    assert set(rig.pusher.agents()) == {("a", 0), ("b", 0)} and c.agent_name not in rig.nixl.loaded
    assert set(rig.holds._pins) == {"a1", "b1"}, "the refused request pinned its hold"
    rig.nixl.hold = False
    rig.settle()
    assert rig.push(c, "c2")[0] == "accepted"
    rig.settle()
    assert rig.nixl.violations == [] and rig.holds._pins == {}


# ---- idle ------------------------------------------------------------------------------------------------------------
def test_an_idle_agent_is_unloaded_after_agent_idle_s_and_a_dead_one_at_once(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for(idle_s=30.0)
    alive, dying = decode_info("alive"), decode_info("dying")
    rig.nixl.dead.add(dying.agent_name)
    assert rig.push(alive, "a")[0] == rig.push(dying, "d")[0] == "accepted"
    rig.settle()
    rig.tick(1.0)
    wait_until(lambda: set(rig.nixl.loaded) == {alive.agent_name})
    assert set(rig.pusher.agents()) == {("alive", 0)}
    rig.tick(28.0)
    time.sleep(0.01)
    assert set(rig.nixl.loaded) == {alive.agent_name}, "unloaded before agent_idle_s"
    rig.tick(2.0)
    wait_until(lambda: not rig.nixl.loaded and not rig.pusher.agents())


def test_an_agent_with_a_write_in_flight_is_never_unloaded(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for(idle_s=1.0)
    info = decode_info("slow")
    rig.nixl.hold = True
    assert rig.push(info, "r")[0] == "accepted"
    wait_until(lambda: len(rig.nixl.writes) == 1)
    for _ in range(5):
        rig.tick(10.0)
        time.sleep(0.005)
    assert info.agent_name in rig.nixl.loaded and rig.pusher.agents() == {("slow", 0): info.agent_name}
    rig.nixl.hold = False
    rig.settle()
    rig.tick(2.0)
    wait_until(lambda: not rig.nixl.loaded)
    assert rig.nixl.violations == []


# ---- the requester's own agent, changed only when nothing is in flight ----------------------------------------------
def test_new_metadata_is_loaded_only_after_the_write_in_flight_ends(rig_for: Callable[..., Rig]) -> None:
    """The decode rank registered its staging since its first push: its next request carries new metadata (the
    same agent). The WRITE in flight to the old metadata ends first; then NIXL reloads, then the new WRITE."""
    rig = rig_for()
    before = decode_info("decode", name=unique_agent_name("decode", 0))
    after = decode_info("decode", name=before.agent_name, extra=b"+staging",
                        staging=[KVRegion(base_addr=BASE + REGION, length=REGION)])
    rig.nixl.hold = True
    assert rig.push(before, "first")[0] == "accepted"
    wait_until(lambda: len(rig.nixl.writes) == 1)
    assert rig.push(after, "second", target=BASE + REGION)[0] == "accepted", "a write into its staging"
    for _ in range(20):
        rig.pusher.engine.wake()
        time.sleep(0.001)
    assert rig.nixl.loads == 1 and len(rig.nixl.writes) == 1, "reloaded (or posted) with a WRITE in flight"
    rig.nixl.hold = False
    rig.settle()
    assert [w.digest for w in rig.nixl.writes] == [before.metadata_digest, after.metadata_digest]
    assert rig.nixl.loads == 2 and rig.nixl.violations == [] and rig.holds._pins == {}


def test_a_restarted_decode_worker_replaces_its_old_agent_once_nothing_is_in_flight(
        rig_for: Callable[..., Rig]) -> None:
    rig = rig_for()
    old, new = decode_info("decode"), decode_info("decode")
    assert old.agent_name != new.agent_name
    rig.nixl.hold = True
    assert rig.push(old, "first")[0] == "accepted"
    wait_until(lambda: len(rig.nixl.writes) == 1)
    assert rig.push(new, "second")[0] == "accepted"
    for _ in range(20):
        rig.pusher.engine.wake()
        time.sleep(0.001)
    assert set(rig.nixl.loaded) == {old.agent_name}, "replaced with a WRITE to the old agent in flight"
    rig.nixl.hold = False
    rig.settle()
    assert set(rig.nixl.loaded) == {new.agent_name}
    assert [w.peer for w in rig.nixl.writes] == [old.agent_name, new.agent_name]
    assert rig.pusher.agents() == {("decode", 0): new.agent_name} and rig.nixl.violations == []


@pytest.mark.parametrize("case", ["other_engine_id", "other_engines_name", "other_ranks_name", "name_not_ours",
                                  "metadata_names_another", "rank_past_tp_size"])
def test_an_agent_that_is_not_the_requesters_own_is_refused_and_loads_nothing(rig_for: Callable[..., Rig],
                                                                             case: str) -> None:
    rig = rig_for()
    victim = decode_info("victim")
    assert rig.push(victim, "v1")[0] == "accepted"
    rig.settle()
    if case == "other_engine_id":  # the victim's genuine AgentInfo, sent by another engine
        msg = request(rig.layout, victim, "a1")
        msg = PushRequest(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "requester_engine_id": "attacker"})
    else:
        info = {
            "other_engines_name": decode_info("attacker", name=victim.agent_name),
            "other_ranks_name": decode_info("victim", rank=1, name=victim.agent_name),
            "name_not_ours": decode_info("attacker", name="p2pkv-attacker-tp0-xyz"),
            "metadata_names_another": _renamed(decode_info("attacker"), victim.agent_name),
            "rank_past_tp_size": _rank(decode_info("attacker", rank=3), tp_size=2),
        }[case]
        msg = request(rig.layout, info, "a1")
    rig.holds.hold("a1", 1e12, (1,))
    status, message = rig.pusher.on_push(msg)
    assert status == "refused" and ("agent" in message), message
    assert rig.nixl.loaded == {victim.agent_name: victim.metadata_digest} and rig.nixl.loads == 1
    assert set(rig.pusher.agents()) == {("victim", 0)} and rig.holds._pins == {}
    assert rig.push(victim, "v2")[0] == "accepted"
    rig.settle()
    assert [w.peer for w in rig.nixl.writes] == [victim.agent_name] * 2


def test_target_rows_outside_the_declared_regions_are_refused(rig_for: Callable[..., Rig]) -> None:
    rig = rig_for()
    info = decode_info("decode")
    for target in (BASE - 4096, BASE + REGION - 8, BASE + REGION):
        status, message = rig.push(info, f"r{target}", target=target)
        assert status == "refused" and "target_rows" in message and "declares" in message, message
    assert rig.pusher.agents() == {} and rig.nixl.loaded == {} and rig.holds._pins == {}
    staged = decode_info("decode", name=info.agent_name, staging=[KVRegion(base_addr=BASE + REGION, length=4096)])
    assert rig.push(staged, "in-staging", target=BASE + REGION)[0] == "accepted"
    rig.settle()
    assert rig.pusher.counters.written == 1


def _renamed(info: AgentInfo, inside: str) -> AgentInfo:
    """``info`` with NIXL metadata that names agent ``inside`` (digest recomputed)."""
    meta = fake_metadata(inside, b"attacker's")
    return AgentInfo(**{**{f: getattr(info, f) for f in info.__struct_fields__}, "agent_metadata": meta,
                        "metadata_digest": compute_digest(meta)})


def _rank(info: AgentInfo, tp_size: int) -> AgentInfo:
    return AgentInfo(**{**{f: getattr(info, f) for f in info.__struct_fields__}, "tp_size": tp_size})
