"""One worker's rank as its transfers see it: who it is, and where its KV cache lies."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from handshake import KVLayoutDesc
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.negotiate import PairRefused, total_heads
from p2pkv.dataplane.topology import RankRead, TopologyError, notifiers_of, notify_ranks, read_plan


@dataclass(frozen=True)
class LocalRank:
    """This worker's rank.

    Attributes:
        engine_id: the engine's id.
        tp_rank / tp_size: this rank and its engine's tensor-parallel size.
        layout: the KV cache's segments and regions (bytes).
        desc: its wire description (:class:`handshake.KVLayoutDesc`).
        device_id: GPU index of the KV cache (0 for DRAM).
        layer_groups: layer index → the KV cache groups whose blocks lie in that layer's pages
            (:func:`p2pkv.dataplane.layers.groups_by_layer`); empty: one group.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    layout: KVLayout
    desc: KVLayoutDesc
    device_id: int = 0
    layer_groups: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``<engine_id>:<tp_rank>``, as notifications and logs name a rank."""
        return f"{self.engine_id}:{self.tp_rank}"

    def topology(self, remote_tp: int, remote_pp: int = 1) -> tuple[list[RankRead], list[int]]:
        """The prefill ranks (of an engine with TP size ``remote_tp`` and ``remote_pp`` pipeline stages) this
        rank reads, with head slices, and those it notifies (:mod:`p2pkv.dataplane.topology`).

        Every stage holds its own layers of the same heads, so this rank reads the same head slices from each
        stage: prefill ranks are numbered ``pp_rank * remote_tp + tp_rank`` (:attr:`handshake.AgentInfo.rank`),
        stage by stage.

        Raises:
            PairRefused: the heads cannot be mapped between the two TP sizes.
        """
        args = (self.tp_rank, self.tp_size, remote_tp, total_heads(self.desc, self.tp_size), self.desc.is_mla)
        try:
            reads, notify = read_plan(*args), notify_ranks(*args)
        except TopologyError as exc:
            raise PairRefused(f"prefill tp_size={remote_tp}, decode tp_size={self.tp_size}: {exc}") from exc
        return ([dataclasses.replace(r, remote_rank=stage * remote_tp + r.remote_rank)
                 for stage in range(remote_pp) for r in reads],
                [stage * remote_tp + r for stage in range(remote_pp) for r in notify])

    def answered_ranks(self, remote_tp: int, remote_pp: int = 1) -> list[int]:
        """The prefill ranks this rank tells about a request: those it notifies, or all of them when the TP
        sizes cannot pair."""
        try:
            return self.topology(remote_tp, remote_pp)[1]
        except PairRefused:
            return list(range(remote_tp * remote_pp))

    def notifiers(self, remote_tp: int, ranks: list[int]) -> list[int]:
        """For each prefill rank in ``ranks`` (of any stage), how many decode ranks notify it about a request
        (:func:`p2pkv.dataplane.topology.notifiers_of` of its tensor-parallel rank, ``rank % remote_tp``)."""
        args = (self.tp_size, remote_tp, total_heads(self.desc, self.tp_size), self.desc.is_mla)
        return [notifiers_of(r % remote_tp, *args) for r in ranks]
