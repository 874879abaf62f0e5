"""Pipeline-parallel stages: the layers one prefill stage holds, and a decode rank's KV seen as one stage's.

vLLM's pipeline parallelism gives each stage a contiguous range of the
model's layers (``get_pp_indices``, or ``VLLM_PP_LAYER_PARTITION``), and each
stage's workers register only those layers' KV. A decode rank of an engine
without pipeline parallelism holds every layer: it pairs with one stage
through the view of its own KV restricted to that stage's layers and
renumbered from 0 (:func:`stage_view`), so a plan between that view and the
stage's own description (:func:`p2pkv.dataplane.negotiate.plan_peer`,
:func:`~p2pkv.dataplane.negotiate.page_slices`, the descriptor rows of
:mod:`p2pkv.dataplane.plan`) moves exactly that stage's layers into the
matching layers here. vLLM's NixlConnector does the same for a PP prefill
engine pushing to a non-PP decode engine (vLLM #45880: each stage writes its
own layers into the matching range of the decode's regions).

Layers are counted as :func:`p2pkv.dataplane.layout.describe_kv_caches`
counts them (attention layers in ``kv_caches`` order). Pure: no NIXL, no I/O.

A decode rank pairs with each stage's workers at their handshake
(:meth:`p2pkv.decode.peers.PeerTable.add`) and checks, before a pull's first
READ, that the stages it reads tile its layers (:func:`check_peer_stages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from handshake import AgentInfo, KVLayoutDesc, KVRegion
from p2pkv.dataplane.layout import LayoutError, Segment
from p2pkv.dataplane.negotiate import INTERLEAVED_LAYOUTS, PairRefused, page_bytes


@dataclass(frozen=True)
class StageLayers:
    """The layers one pipeline stage holds.

    Attributes:
        pp_rank: the stage (0-based).
        first_layer: its first layer, counted over the whole model's attention layers.
        num_layers: layers it holds (its KV description's ``num_layers``).
    """

    pp_rank: int
    first_layer: int
    num_layers: int

    @property
    def end_layer(self) -> int:
        """One past its last layer."""
        return self.first_layer + self.num_layers

    @classmethod
    def of(cls, info: AgentInfo) -> StageLayers:
        """The layers the worker ``info`` describes holds (its stage, ``layout.first_layer``, ``layout.num_layers``)."""
        return cls(info.pp_rank, info.layout.first_layer, info.layout.num_layers)


def first_layer_of(layer_names: Sequence[str], num_layers: int) -> int:
    """The model layer a pipeline stage's KV starts at, from the names of its KV tensors (vLLM's
    ``model.layers.<i>.self_attn.attn``: the one integer among the dot-separated parts, as vLLM's
    ``extract_layer_index`` reads it).

    Args:
        layer_names: the stage's attention layer names, in ``kv_caches`` order.
        num_layers: the layers its KV description counts (``KVLayoutDesc.num_layers``).

    Returns:
        The first name's layer index.

    Raises:
        LayoutError: a name without exactly one integer part, or indices that are not ``num_layers``
            consecutive ascending layers.
    """
    indices: list[int] = []
    for name in layer_names:
        ints = [int(part) for part in name.split(".") if part.isdigit()]
        if len(ints) != 1:
            raise LayoutError(f"KV cache layer name {name[:128]!r} has {len(ints)} integer parts, not one layer "
                              "index: a pipeline stage's layers cannot be placed in the model")
        if not indices or indices[-1] != ints[0]:
            indices.append(ints[0])
    if not indices or indices != list(range(indices[0], indices[0] + num_layers)):
        raise LayoutError(f"this pipeline stage's KV cache layers {indices[:8]}{'...' if len(indices) > 8 else ''} "
                          f"are not {num_layers} consecutive model layers: p2pkv pairs a stage's layers by their "
                          "place in the model (a model whose attention layers interleave with others is not "
                          "supported with --pipeline-parallel-size > 1)")
    return indices[0]


def stage_desc(desc: KVLayoutDesc, layer_names: Sequence[str], has_state: bool = False) -> KVLayoutDesc:
    """A pipeline stage worker's KV description: ``desc`` with its ``first_layer`` (:func:`first_layer_of`).

    Args:
        desc: the description of the stage's KV cache (its ``num_layers``: the stage's layers).
        layer_names: its attention layer names, in ``kv_caches`` order.
        has_state: the stage holds Mamba/SSM state layers too.

    Raises:
        LayoutError: Mamba/SSM state on a stage (only attention KV pairs by layer), or as :func:`first_layer_of`.
    """
    if has_state:
        raise LayoutError("a pipeline stage with Mamba/SSM state layers: p2pkv moves a stage's attention KV only; "
                          "run this engine with --pipeline-parallel-size 1")
    return msgspec.structs.replace(desc, first_layer=first_layer_of(layer_names, desc.num_layers))


def check_peer_stages(infos: Sequence[AgentInfo], pp_size: int, num_layers: int) -> None:
    """Check the workers of one prefill engine a pull reads (``infos``, from their handshakes) against the
    ``pp_size`` its ``kv_transfer_params`` name: each says that ``pp_size``, and their stages' layers tile this
    engine's ``num_layers`` (:func:`check_stages`; the workers of one stage, its TP ranks, hold one range).

    Raises:
        PairRefused: a worker of another ``pp_size``, two ranks of one stage with different layers, or stages
            that do not tile (the message names each side's values).
    """
    stages: dict[int, StageLayers] = {}
    for info in infos:
        if info.pp_size != pp_size:
            raise PairRefused(f"kv_transfer_params.pp_size={pp_size}, but prefill rank {info.rank} of "
                              f"{info.engine_id[:64]!r} runs pp_size={info.pp_size}")
        stage = stages.setdefault(info.pp_rank, StageLayers.of(info))
        if stage != StageLayers.of(info):
            raise PairRefused(f"prefill stage {info.pp_rank}'s ranks hold different layers ({stage.first_layer}.."
                              f"{stage.end_layer - 1} and {info.layout.first_layer}.."
                              f"{info.layout.first_layer + info.layout.num_layers - 1})")
    check_stages(list(stages.values()), pp_size, num_layers)


def check_stages(stages: Sequence[StageLayers], pp_size: int, num_layers: int) -> None:
    """Check that the stages of a prefill engine tile this engine's layers: stage ``s`` once for every ``s`` in
    ``[0, pp_size)``, their ranges in stage order, touching, from layer 0 to ``num_layers``.

    A stage set that leaves a layer out would load a prompt whose KV misses that layer, and one that overlaps
    would WRITE one layer twice: both are refused before any transfer.

    Args:
        stages: what each stage's handshake declared, in any order.
        pp_size: the prefill engine's pipeline-parallel size (its ``kv_transfer_params.pp_size``).
        num_layers: this engine's attention layers.

    Raises:
        PairRefused: a stage missing, repeated or out of range, or ranges that do not tile ``[0, num_layers)``
            (the message names the stages' ranges and this engine's layer count).
    """
    ranks = sorted(s.pp_rank for s in stages)
    if ranks != list(range(pp_size)):
        raise PairRefused(f"prefill stages {ranks} declared for pp_size={pp_size}: each stage 0..{pp_size - 1} "
                          "must answer once; check the prefill engine's --pipeline-parallel-size")
    ordered = sorted(stages, key=lambda s: s.pp_rank)
    ranges = ", ".join(f"stage {s.pp_rank}: layers {s.first_layer}..{s.end_layer - 1}" for s in ordered)
    end = 0
    for stage in ordered:
        if stage.num_layers <= 0 or stage.first_layer != end:
            break
        end = stage.end_layer
    else:
        if end == num_layers:
            return
    raise PairRefused(f"the prefill stages' layers ({ranges}) do not tile the decode engine's {num_layers} layers "
                      "in stage order; run both engines with the same model (and the same "
                      "VLLM_PP_LAYER_PARTITION, if set)")


def stage_segments(segments: Sequence[Segment], page: int, stage: StageLayers, kv_layout: str = "") -> list[Segment]:
    """This rank's segments covering exactly ``stage``'s layers, renumbered from 0 (the stage's own numbering).

    A segment of several layers (cross-layer blocks: each layer's page at ``layer × page`` inside the block) is
    cut at the stage's first and last layer. Where the cut leaves segments of different lengths, every one is
    cut into one segment per layer, so that all have one length (what a :class:`handshake.KVLayoutDesc`
    declares in ``block_len``).

    Args:
        segments: this rank's segments (:attr:`p2pkv.dataplane.layout.KVLayout.segments`), ascending layers.
        page: bytes of one layer's page of a block in a segment (:func:`p2pkv.dataplane.negotiate.page_bytes`).
        stage: the stage's layers, within this rank's.
        kv_layout: this rank's vLLM KV cache layout name: one whose layers interleave inside a block
            (:data:`p2pkv.dataplane.negotiate.INTERLEAVED_LAYOUTS`) has no per-layer page to cut out.

    Returns:
        Segments in this rank's order, each with ``layer_start`` counted from ``stage.first_layer``.

    Raises:
        PairRefused: the stage's layers are not all in ``segments``, or a multi-layer segment of an
            interleaved layout would have to be cut.
    """
    out: list[Segment] = []
    for seg in segments:
        lo, hi = max(seg.layer_start, stage.first_layer), min(seg.layer_start + seg.num_layers, stage.end_layer)
        if lo >= hi:
            continue
        if kv_layout in INTERLEAVED_LAYOUTS and hi - lo != seg.num_layers:
            raise PairRefused(f"kv_layout={kv_layout} interleaves layers inside a block, so the layers "
                              f"{stage.first_layer}..{stage.end_layer - 1} of prefill stage {stage.pp_rank} cannot "
                              "be cut out of it; use LBHNC/BLHNC on the decode engine")
        out.append(Segment(seg.addr + (lo - seg.layer_start) * page, (hi - lo) * page, seg.block_stride,
                           lo - stage.first_layer, hi - lo, seg.kv_index))
    covered = {(s.layer_start + i) for s in out for i in range(s.num_layers)}
    if covered != set(range(stage.num_layers)):
        raise PairRefused(f"prefill stage {stage.pp_rank} holds layers {stage.first_layer}..{stage.end_layer - 1}, "
                          "which this decode rank's KV cache does not all hold; run both engines with the same model")
    if len({s.length for s in out}) > 1:
        out = [Segment(s.addr + i * page, page, s.block_stride, s.layer_start + i, 1, s.kv_index)
               for s in out for i in range(s.num_layers)]
    return out


def stage_view(desc: KVLayoutDesc, segments: Sequence[Segment], stage: StageLayers) -> tuple[KVLayoutDesc,
                                                                                          list[Segment]]:
    """This rank's KV as the description of a rank that holds only ``stage``'s layers.

    The result pairs with the stage's own :class:`handshake.KVLayoutDesc` as two whole-model ranks pair: same
    ``num_layers``, one region per segment (its ``layer_start`` from 0), the same block geometry. Its regions
    lie inside this rank's registered memory, so descriptors built on them READ into (or are WRITTEN at) the
    matching layers' pages here.

    Args:
        desc: this rank's description (``num_layers`` the whole model's).
        segments: this rank's segments, as ``desc.regions`` describes them.
        stage: the stage's layers.

    Returns:
        ``(view, view_segments)``: the restricted description and its segments (:func:`stage_segments`).

    Raises:
        PairRefused: as :func:`stage_segments`.
    """
    cut = stage_segments(segments, page_bytes(desc), stage, desc.kv_layout)
    device_id = desc.regions[0].device_id if desc.regions else 0
    regions = [KVRegion(base_addr=s.addr, length=desc.num_blocks * s.block_stride, device_id=device_id,
                        layer_start=s.layer_start, num_layers=s.num_layers, kv_index=s.kv_index) for s in cut]
    view = msgspec.structs.replace(desc, num_layers=stage.num_layers, block_len=cut[0].length, regions=regions)
    return view, cut


__all__ = ["StageLayers", "check_peer_stages", "check_stages", "first_layer_of", "stage_desc", "stage_segments",
           "stage_view"]
