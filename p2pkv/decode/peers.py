"""The prefill ranks a decode worker knows: verified handshakes, their pull plans, and handshakes in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from handshake import AgentInfo, KVLayoutDesc, fetch_agent_info
from p2pkv.dataplane.layout import Segment
from p2pkv.dataplane.negotiate import ModelInfo, PeerPlan, TransferMode, page_slices, plan_peer, remote_segments
from p2pkv.decode.background import Background
from p2pkv.params import RemotePrefill

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import NixlTransferAgent

logger = logging.getLogger("p2pkv.decode.peers")


@dataclass(frozen=True, order=True)
class PeerId:
    """One prefill rank: engine id, side-channel address of that rank, tensor-parallel rank.

    A request naming a known engine id at another address is another peer: its
    handshake must show that engine id there (:func:`handshake.fetch_agent_info`).
    """

    engine_id: str
    host: str
    port: int
    tp_rank: int

    @classmethod
    def of(cls, remote: RemotePrefill, tp_rank: int) -> PeerId:
        """Prefill rank ``tp_rank`` of the engine ``remote`` names (its port: base port + rank)."""
        return cls(remote.engine_id, remote.host, remote.port + tp_rank, tp_rank)

    def __str__(self) -> str:
        return f"{self.engine_id} rank {self.tp_rank} at {self.host}:{self.port}"


@dataclass
class Peer:
    """A prefill rank this worker pulls from (or only notifies), after a verified handshake.

    Attributes:
        info: what its side channel sent (agent metadata, KV layout).
        agent_name: the NIXL remote agent name.
        segments: its KV segments, rebuilt from the typed layout.
        plan: how this rank pulls from it (:func:`p2pkv.dataplane.negotiate.plan_peer`).
        local_slices / remote_slices: per-page head slices (``PAGED`` plans only).
    """

    info: AgentInfo
    agent_name: str
    segments: list[Segment]
    plan: PeerPlan
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
    """Known prefill ranks of one decode worker, and handshakes in flight.

    Args:
        agent: the worker's NIXL agent (peers are added to it).
        local: this rank's layout description.
        local_segments: this rank's KV segments.
        tp_rank / tp_size: this rank and its engine's TP size.
        model: this engine's model facts that limit pairings (see
            :func:`p2pkv.dataplane.negotiate.plan_peer`).
    """

    def __init__(self, agent: NixlTransferAgent, local: KVLayoutDesc, local_segments: list[Segment],
                 tp_rank: int, tp_size: int, model: ModelInfo | None = None) -> None:
        self.agent, self.local, self.local_segments = agent, local, local_segments
        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.peers: dict[PeerId, Peer] = {}
        self.handshakes: dict[PeerId, Handshake] = {}

    def handshake(self, peer_id: PeerId, background: Background, *, engine_id: str, compat_hash: str,
                  secret: bytes | None, timeout_s: float, retries: int) -> Handshake:
        """The handshake with ``peer_id``, started now unless one is in flight; it verifies the engine id."""
        hs = self.handshakes.get(peer_id)
        if hs is None:
            future = background.call(f"p2pkv-handshake-{peer_id.host}:{peer_id.port}", fetch_agent_info,
                                     peer_id.host, peer_id.port, peer_id.tp_rank, engine_id, compat_hash,
                                     secret=secret, timeout_s=timeout_s, retries=retries,
                                     engine_id=peer_id.engine_id)
            hs = self.handshakes[peer_id] = Handshake(future)
        return hs

    def completed(self) -> Iterator[tuple[PeerId, Handshake]]:
        """Handshakes that have finished (removed from the table as they are yielded)."""
        for peer_id, hs in list(self.handshakes.items()):
            if hs.future.done():
                del self.handshakes[peer_id]
                yield peer_id, hs

    def add(self, peer_id: PeerId, info: AgentInfo) -> Peer:
        """Plan the pairing with a handshaken prefill rank and load its metadata into NIXL.

        Raises:
            p2pkv.dataplane.negotiate.PullRefused: the two ranks cannot pair.
            handshake.MetadataDigestError / p2pkv.dataplane.agent.TransferError: bad or refused metadata.
        """
        plan = plan_peer(self.local, self.tp_rank, self.tp_size, info.layout, peer_id.tp_rank, info.tp_size,
                         self.model)
        name = self.agent.add_peer(info)
        peer = self.peers[peer_id] = Peer(info, name, remote_segments(info.layout), plan)
        if plan.mode is TransferMode.PAGED:
            r = plan.read
            peer.local_slices = page_slices(self.local, self.local_segments, r.local_head_start, r.num_heads)
            peer.remote_slices = page_slices(info.layout, peer.segments, r.remote_head_start, r.num_heads)
        return peer

    def drop(self, peer_id: PeerId, only: Peer | None = None) -> None:
        """Forget a prefill rank (it failed or restarted); with ``only``, just if it is still that one.

        A late failure from a dead incarnation must not tear down its replacement.
        """
        peer = self.peers.get(peer_id)
        if peer is None or (only is not None and peer is not only):
            return
        del self.peers[peer_id]
        self.agent.remove_peer(peer.agent_name)
