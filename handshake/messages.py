"""The side-channel wire contract: versioned msgspec Structs.

Every message on the side channel is one of the tagged Structs below,
msgpack-encoded by :mod:`handshake.codec`. Nothing on the wire is pickled.
Decoding is strict: unknown fields, wrong types and missing fields are
rejected with an error that names the field.

Units: addresses and lengths are bytes; ``block_size`` is tokens per block;
``num_blocks`` is blocks per region.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PROTOCOL_VERSION = 4
"""Bumped on any incompatible change to the Structs in this module."""

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]
"""Random bytes a request carries and its reply echoes: a reply answers that request only."""
"""Largest message (bytes) a server or client accepts; larger input is refused."""


class KVRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered memory region holding KV blocks.

    Attributes:
        base_addr: start address of the region (bytes, process virtual address
            or device pointer).
        length: region length in bytes.
        device_id: NIXL device id (GPU index for VRAM, 0 for DRAM).
        layer_start: first model layer whose KV lives in this region.
        num_layers: number of layers whose KV lives in this region
            (all layers for a cross-layer region).
        kv_index: 0 for K, 1 for V, -1 when K and V share the region.
    """

    base_addr: int
    length: int
    device_id: int = 0
    layer_start: int = 0
    num_layers: int = 1
    kv_index: int = -1


class KVLayoutDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one worker's KV cache sits in memory.

    A block id ``b`` occupies bytes ``[r.base_addr + b * block_stride,
    r.base_addr + b * block_stride + block_len)`` of every region ``r``.

    Attributes:
        kv_layout: vLLM KV cache layout name over logical [L, B, H, N, C]
            (e.g. ``"LBHNC"`` layer-compact, ``"BLHNC"`` cross-layer).
        attn_layout: ``"HND"`` or ``"NHD"``: order of heads and tokens inside
            one layer's page of a block.
        dtype: KV cache element dtype name (e.g. ``"bfloat16"``).
        num_layers: attention layers of the model.
        num_kv_heads: KV heads held by this rank.
        head_dim: elements per head.
        block_size: tokens per block.
        num_blocks: blocks in each region.
        block_len: bytes one block occupies in one region (one descriptor).
        block_stride: bytes between consecutive blocks in one region.
        mem_type: NIXL memory type, ``"DRAM"`` or ``"VRAM"``.
        regions: the registered regions, in a fixed order both peers agree on.
        total_num_kv_heads: the model's KV heads over all ranks (0: unknown).
        is_mla: an MLA latent cache (no head split across ranks).
    """

    kv_layout: str
    attn_layout: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    block_len: int
    block_stride: int
    mem_type: str
    regions: list[KVRegion]
    total_num_kv_heads: int = 0
    is_mla: bool = False


class AgentInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a peer needs to pull from one worker (one tp_rank).

    Attributes:
        engine_id: the vLLM engine id of the worker's engine.
        tp_rank: tensor-parallel rank of the worker.
        tp_size: tensor-parallel size of the engine.
        agent_name: NIXL agent name (unique per process incarnation).
        agent_metadata: opaque NIXL agent metadata (``get_agent_metadata()``).
        metadata_digest: SHA-256 of ``agent_metadata``, checked before the
            metadata reaches NIXL.
        compat_hash: compatibility fingerprint (:mod:`handshake.compat`):
            canonical JSON of what must match between peers (vLLM version,
            model, dtypes, KV cache groups, ...), compared field by field by
            the requester.
        layout: the KV memory description.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    metadata_digest: bytes
    compat_hash: str
    layout: KVLayoutDesc


class MetadataRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="metadata_request"):
    """Ask a server for one rank's :class:`AgentInfo`.

    Attributes:
        protocol_version: the sender's :data:`PROTOCOL_VERSION`.
        tp_rank: the rank whose info is wanted.
        requester_engine_id: engine id of the asking side (for logs).
        compat_hash: the asking side's compatibility fingerprint; the
            server logs the fields that differ from its own (the requester
            refuses the reply).
        nonce: echoed in the reply.
    """

    protocol_version: int
    tp_rank: int
    requester_engine_id: str
    compat_hash: str
    nonce: Nonce = b""


class MetadataReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="metadata_reply"):
    """Answer to :class:`MetadataRequest` (``nonce``: the request's)."""

    protocol_version: int
    info: AgentInfo
    nonce: Nonce = b""


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    """A request the server refused.

    Attributes:
        code: machine-readable reason (``"malformed"``, ``"version"``,
            ``"incompatible"``, ``"unknown_rank"``, ``"too_large"``,
            ``"auth"``).
        field: the offending field (``""`` when not about one field).
        message: human-readable explanation that names the fix.
    """

    protocol_version: int
    code: str
    field: str
    message: str


MAX_HEARTBEAT_IDS = 4096
"""Most request ids one :class:`LeaseHeartbeat` may carry."""


class LeaseHeartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="lease_heartbeat"):
    """Ask a prefill worker to keep holding requests a decode engine still has queued.

    Attributes:
        protocol_version: the sender's :data:`PROTOCOL_VERSION`.
        requester_engine_id: the decode engine's id (for logs).
        request_ids: prefill-side request ids (``remote_request_id``) whose
            leases to extend; ids not held are ignored.
        extend_s: new lease length from now (seconds).
        block_ids: empty, or per request id the prefill block ids the sender
            reads: an id whose hold does not contain them all is reported
            in ``not_held`` (a pull's fence; queued-request heartbeats send none).
        nonce: echoed in the reply.
    """

    protocol_version: int
    requester_engine_id: str
    request_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]
    extend_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    block_ids: Annotated[list[list[int]], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(
        default_factory=list)
    nonce: Nonce = b""


class HeartbeatReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="heartbeat_reply"):
    """Answer to :class:`LeaseHeartbeat`.

    Attributes:
        accepted: how many ids were taken for extension.
        expired: the asked-for ids whose lease already ran out on this
            worker (their blocks may have been reused): a pull of them that
            just finished must be treated as failed.
        not_held: ids released already (by notification or release), or whose
            hold does not contain the asked-for block ids.
        unknown: ids this worker has not (yet) been told to hold.
        request_ids: the request's ids, echoed.
        nonce: the request's nonce, echoed.
    """

    protocol_version: int
    accepted: int
    expired: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(default_factory=list)
    not_held: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(default_factory=list)
    unknown: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(default_factory=list)
    request_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(
        default_factory=list)
    nonce: Nonce = b""


class ReleaseHolds(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="release_holds"):
    """Tell a prefill worker that nobody will pull these requests: free their blocks now.

    Sent by the proxy when the decode leg of a request fails after its prefill
    succeeded. Answered with a :class:`HeartbeatReply` (``accepted``: ids held
    and released).
    """

    protocol_version: int
    requester_engine_id: str
    request_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]
    nonce: Nonce = b""


Message = MetadataRequest | MetadataReply | ErrorReply | LeaseHeartbeat | HeartbeatReply | ReleaseHolds
"""Every message that travels on the side channel."""
