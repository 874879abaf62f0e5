"""Decode-side bookkeeping of pulls: peers, a request's group of READs, READs in flight, handshakes waiting."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from handshake import AgentInfo
from p2pkv.layout import Segment
from p2pkv.metadata import RecvTask
from p2pkv.negotiate import PeerPlan
from p2pkv.stager import Stage
from p2pkv.transfer import PullHandle


@dataclass
class Peer:
    """A prefill rank this worker pulls from (or only notifies)."""

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
class Group:
    """One request's pull: a READ from each prefill rank it reads (one when TP sizes match)."""

    task: RecvTask
    started: float
    notify: list[tuple[tuple[str, int], int]]
    parts: int = 0
    confirmed: int = 0
    failed: bool = False
    num_bytes: int = 0
    num_descriptors: int = 0
    done: float = 0.0
    peers: list[str] = field(default_factory=list)


@dataclass
class Pull:
    """One READ in flight from one prefill rank (part of a :class:`Group`)."""

    task: RecvTask
    handle: PullHandle
    started: float
    peer_key: tuple[str, int]
    peer: Peer
    group: Group
    stage: Stage | None = None
    done: float = 0.0


@dataclass
class Pending:
    """Tasks waiting for a handshake with one prefill rank."""

    tasks: list[RecvTask] = field(default_factory=list)
    future: Future | None = None
    started: float = field(default_factory=time.monotonic)


def failure_kind(exc: BaseException) -> str:
    """``disconnect`` when NIXL says the peer went away, else ``transfer``."""
    return "disconnect" if "DISCONNECT" in str(exc).upper() else "transfer"
