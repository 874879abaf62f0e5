"""The prefill ranks a decode worker knows: verified handshakes, their pull plans, and handshakes in flight.

Peers are keyed by a canonical address (:func:`canonical_host`), so the many
spellings of one address are one peer, and each remembers when a pull last
used it: the table is bounded (:data:`p2pkv.decode.keeper.MAX_PEERS`) by dropping the least recently
used peer no pull needs, and peers idle for :data:`p2pkv.decode.keeper.PEER_IDLE_S` are dropped too.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from handshake import AgentInfo, Destination, KVLayoutDesc, fetch_agent_info
from p2pkv.dataplane.layout import Segment
from p2pkv.dataplane.negotiate import (
    ModelInfo,
    PeerPlan,
    Placement,
    page_slices,
    plan_peer,
    remote_segments,
)
from p2pkv.dataplane.stages import StageLayers, stage_view
from p2pkv.decode.background import Background
from p2pkv.params import RemotePrefill

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import NixlTransferAgent

logger = logging.getLogger("p2pkv.decode.peers")

HANDSHAKE_ATTEMPTS = 3
"""Attempts a handshake makes (each of ``handshake_timeout_s``, on a fresh socket) before its pull fails: a
prefill engine restarting on the same port answers a later one. A bound, not a measured optimum: with the default
5 s a dead peer fails its pull after 15.6 s (:func:`handshake_budget_s`)."""
HANDSHAKE_BACKOFF_S = 0.2
"""First pause (seconds) between two handshake attempts, doubled each time (see :func:`handshake_budget_s`)."""
_IPV4_SPELLING = re.compile(r"[0-9a-fx.]+")


def canonical_host(host: str) -> str:
    """One spelling per address: what peers are keyed by and what the side channel connects to.

    IPv4 in any form ``inet_aton`` accepts (``127.1``, ``0x7f.0.0.1``,
    ``127.000.000.001``, ``2130706433``) → dotted quad; IPv6 (brackets
    stripped) → compressed form, an IPv4-mapped one → its IPv4 address;
    a host name → lower case without a trailing dot. Names are not resolved
    (that would block): ``localhost`` and ``127.0.0.1`` stay two peers.
    """
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in h:
        try:
            ip = ipaddress.IPv6Address(h)
        except ValueError:
            return h.lower()
        return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else ip.compressed
    h = h.lower()
    h = h[:-1] if h.endswith(".") else h
    if _IPV4_SPELLING.fullmatch(h):
        try:
            return socket.inet_ntoa(socket.inet_aton(h))
        except OSError:
            pass
    return h


def handshake_budget_s(timeout_s: float, attempts: int = HANDSHAKE_ATTEMPTS) -> float:
    """Longest a handshake can take (seconds): ``attempts`` attempts of ``timeout_s`` and the pauses between."""
    return timeout_s * attempts + HANDSHAKE_BACKOFF_S * (2 ** max(0, attempts - 1) - 1)


@dataclass(frozen=True, order=True)
class PeerId:
    """One prefill worker: engine id, side-channel address of that worker, its rank in its engine
    (``pp_rank * tp_size + tp_rank``, :attr:`handshake.AgentInfo.rank`; its tensor-parallel rank without pipeline
    parallelism).

    A request naming a known engine id at another address is another peer: its
    handshake must show that engine id there (:func:`handshake.fetch_agent_info`).
    """

    engine_id: str
    host: str
    port: int
    rank: int

    @classmethod
    def of(cls, remote: RemotePrefill, rank: int) -> PeerId:
        """Prefill worker ``rank`` of the engine ``remote`` names (its port: base port + rank; its host
        canonical, :func:`canonical_host`)."""
        return cls(remote.engine_id, canonical_host(remote.host), remote.port + rank, rank)

    @property
    def destination(self) -> Destination:
        """Where a side-channel request for this rank goes, and whom it names."""
        return Destination(self.host, self.port, self.engine_id, self.rank)

    def __str__(self) -> str:
        return f"{self.engine_id} rank {self.rank} at {self.host}:{self.port}"


@dataclass
class Peer:
    """A prefill rank this worker pulls from (or only notifies), after a verified handshake.

    Attributes:
        info: what its side channel sent (agent metadata, KV layout).
        agent_name: the NIXL remote agent name.
        segments: its KV segments, rebuilt from the typed layout.
        plan: how this rank pulls from it (:func:`p2pkv.dataplane.negotiate.plan_peer`).
        local_segments: this rank's KV segments it fills: all of them, or for a pipeline stage those of the
            stage's layers (:func:`p2pkv.dataplane.stages.stage_view`).
        local_slices / remote_slices: per-page head slices (``PAGED`` plans only).
    """

    info: AgentInfo
    agent_name: str
    segments: list[Segment]
    plan: PeerPlan
    local_segments: list[Segment]
    local_slices: list[Segment] = field(default_factory=list)
    remote_slices: list[Segment] = field(default_factory=list)

    @property
    def device_id(self) -> int:
        """The peer's GPU index for its VRAM descriptors (0 for DRAM)."""
        return self.info.layout.regions[0].device_id


@dataclass
class Handshake:
    """A handshake with one prefill rank in flight: its result (an :class:`AgentInfo`) arrives in ``future``."""

    future: Future
    started: float = field(default_factory=time.monotonic)


class PeerTable:
    """Known prefill ranks of one decode worker, handshakes in flight, and when each peer was last used.

    Args:
        agent: the worker's NIXL agent (peers are added to it).
        local: this rank's layout description.
        local_segments: this rank's KV segments.
        tp_rank / tp_size: this rank and its engine's TP size.
        model: this engine's model facts that limit pairings (see
            :func:`p2pkv.dataplane.negotiate.plan_peer`).

    Attributes:
        keep_agent: whether a dropped peer's NIXL agent must stay loaded for now (a part of it is still in flight
            or drains: its prefill rank may WRITE until proven otherwise, and only a loaded agent can be asked
            whether it is gone); :meth:`sweep` removes it once not.
    """

    def __init__(self, agent: NixlTransferAgent, local: KVLayoutDesc, local_segments: list[Segment],
                 tp_rank: int, tp_size: int, model: ModelInfo | None = None) -> None:
        self.agent, self.local, self.local_segments = agent, local, local_segments
        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.peers: dict[PeerId, Peer] = {}
        self.handshakes: dict[PeerId, Handshake] = {}
        self.keep_agent: Callable[[str], bool] = lambda name: False
        self._kept: set[str] = set()  # agents of dropped peers kept loaded (keep_agent)
        self._used: OrderedDict[PeerId, float] = OrderedDict()  # known peers, least recently used first

    def __len__(self) -> int:
        """Peers known and handshakes in flight (each becomes a peer)."""
        return len(self.peers) + len(self.handshakes)

    def handshake(self, peer_id: PeerId, background: Background, *, engine_id: str, compat_hash: str,
                  secret: bytes | None, timeout_s: float, attempts: int) -> Handshake:
        """The handshake with ``peer_id``, started now unless one is in flight; it verifies the engine id.

        It runs on ``background``'s pool under the peer's host (calls to one
        host share a bound, see :class:`p2pkv.decode.background.Background`).
        """
        hs = self.handshakes.get(peer_id)
        if hs is None:
            future = background.call(f"p2pkv-handshake-{peer_id.host}:{peer_id.port}", fetch_agent_info,
                                     peer_id.destination, engine_id, compat_hash, secret=secret,
                                     timeout_s=timeout_s, retries=attempts, backoff_s=HANDSHAKE_BACKOFF_S,
                                     key=peer_id.host)
            hs = self.handshakes[peer_id] = Handshake(future)
        return hs

    def completed(self) -> Iterator[tuple[PeerId, Handshake]]:
        """Handshakes that have finished (removed from the table as they are yielded)."""
        for peer_id, hs in list(self.handshakes.items()):
            if hs.future.done():
                del self.handshakes[peer_id]
                yield peer_id, hs

    def cancel_unneeded(self, needed: set[PeerId]) -> list[PeerId]:
        """Cancel the handshakes not in ``needed`` that have not started yet (forgotten now); their peers."""
        gone = [pid for pid, hs in self.handshakes.items() if pid not in needed and hs.future.cancel()]
        for pid in gone:
            del self.handshakes[pid]
        return gone

    def add(self, peer_id: PeerId, info: AgentInfo) -> Peer:
        """Plan the pairing with a handshaken prefill rank and load its metadata into NIXL.

        A worker of a pipeline stage (``info.pp_size`` > 1) pairs with this rank's layers of its stage
        (:func:`p2pkv.dataplane.stages.stage_view`): its blocks land there, whole pages or head slices of pages,
        or, where its pages differ from this rank's (block size, HND/NHD), through staging, fixed up into the
        pages of those layers (:attr:`Peer.local_segments`).

        Raises:
            p2pkv.dataplane.negotiate.PairRefused: the two ranks cannot pair.
            handshake.MetadataDigestError / p2pkv.dataplane.agent.TransferError: bad or refused metadata.
        """
        local, local_segments = self.local, self.local_segments
        if info.pp_size > 1:
            local, local_segments = stage_view(local, local_segments, StageLayers.of(info))
        plan = plan_peer(local, self.tp_rank, self.tp_size, info.layout, info.tp_rank, info.tp_size, self.model)
        name = self.agent.add_peer(info)
        peer = self.peers[peer_id] = Peer(info, name, remote_segments(info.layout), plan, list(local_segments))
        self.touch([peer_id])
        if plan.placement is Placement.PAGED:
            r = plan.read
            peer.local_slices = page_slices(local, local_segments, r.local_head_start, r.num_heads)
            peer.remote_slices = page_slices(info.layout, peer.segments, r.remote_head_start, r.num_heads)
        return peer

    def touch(self, peer_ids: Iterable[PeerId], now: float | None = None) -> None:
        """A pull uses these peers now (``time.monotonic()`` seconds); unknown ones are skipped."""
        now = time.monotonic() if now is None else now
        for pid in peer_ids:
            if pid in self.peers:
                self._used[pid] = now
                self._used.move_to_end(pid)

    def least_used(self, busy: set[PeerId]) -> Iterator[PeerId]:
        """Known peers not in ``busy``, least recently used first."""
        return (pid for pid in list(self._used) if pid not in busy)

    def idle(self, now: float, idle_s: float, busy: set[PeerId]) -> list[PeerId]:
        """Known peers not in ``busy`` unused for more than ``idle_s`` seconds at ``now``."""
        out = []
        for pid, used in self._used.items():
            if now - used <= idle_s:
                break  # the rest were used later
            if pid not in busy:
                out.append(pid)
        return out

    def drop(self, peer_id: PeerId, only: Peer | None = None) -> Peer | None:
        """Forget a prefill rank (it failed, restarted or was evicted); with ``only``, just if it is still that
        one. The dropped peer, or None.

        A late failure from a dead incarnation must not tear down its replacement.
        The NIXL remote agent is removed unless another peer (another spelling
        of the same rank's address) still uses it.
        """
        peer = self.peers.get(peer_id)
        if peer is None or (only is not None and peer is not only):
            return None
        del self.peers[peer_id]
        self._used.pop(peer_id, None)
        if self.keep_agent(peer.agent_name):
            self._kept.add(peer.agent_name)
        else:
            self._release_agent(peer.agent_name)
        return peer

    def sweep(self) -> None:
        """Remove the NIXL agents of dropped peers that :attr:`keep_agent` no longer keeps."""
        for name in [n for n in self._kept if not self.keep_agent(n)]:
            self._kept.discard(name)
            self._release_agent(name)

    def _release_agent(self, agent_name: str) -> None:
        """Remove ``agent_name`` from NIXL unless a known peer (another spelling of the same rank's address)
        still uses it."""
        if not any(p.agent_name == agent_name for p in self.peers.values()):
            self.agent.remove_peer(agent_name)
