"""The side-channel wire contract: versioned msgspec Structs.

Every message on the side channel is one of the tagged Structs below,
msgpack-encoded by :mod:`handshake.codec`. Nothing on the wire is pickled.
Decoding is strict: unknown fields, wrong types and missing fields are
rejected with an error that names the field.

Units: addresses and lengths are bytes; ``block_size`` is tokens per block;
``num_blocks`` is blocks per region.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from handshake.fields import (
    MAX_AGENT_METADATA_BYTES,
    MAX_GROUP_BLOCK_IDS,
    MAX_HOLD_BLOCK_IDS,
    MAX_ID_CHARS,
    MAX_KV_GROUPS,
    MAX_NAME_CHARS,
    MAX_READERS,
    MAX_REGIONS,
    BlockId,
    CompatHash,
    EchoedNonce,
    Id,
    Nonce,
    Rank,
    RefusalCode,
    Text,
    Word,
)

PROTOCOL_VERSION = 17
"""Bumped on any incompatible change to the Structs in this module. History:

* 1: ``MetadataRequest`` / ``MetadataReply`` / ``ErrorReply``.
* 2: ``LeaseHeartbeat`` and its reply (lease extension for queued requests).
* 3: fence block ids in ``LeaseHeartbeat``; request nonces echoed by replies; ``ReleaseHolds``.
* 4: ``compat_hash`` became a field-by-field fingerprint (:mod:`handshake.fingerprints`).
* 5: every request names its destination (``to_engine_id``, ``to_rank``) and its time
  (``sent_at``) and carries a required nonce, refused when replayed; the fence question is
  :class:`HoldQuery`, every hold request is answered by :class:`HoldsReply`; ``ReleaseHolds``
  carries the block ids it frees; ``ErrorReply`` echoes the request's nonce and its ``code``
  is a closed set.
* 6: push: :class:`PushRequest` (a decode rank asks a prefill rank to WRITE a held request's
  blocks into its memory) and :class:`PushReply`.
* 7: :class:`AgentInfo` declares its ``staging`` regions (memory outside the KV cache a peer may
  WRITE into), so a prefill rank checks a push's target rows against the regions the requester
  declared.
* 8: every list, string and bytes field is bounded (:data:`MAX_MESSAGE_BYTES` is derived from the
  bounds; a hold request carries at most :data:`MAX_HOLD_BLOCK_IDS` block ids in all), and a payload
  over 256 KiB travels in frames of 256 KiB (:mod:`handshake.codec`).
* 9: the NIXL notifications ("done", "pushed"; :mod:`p2pkv.notification`) are msgpack-encoded Structs,
  as strict as these, instead of text; a peer of version 8 would drop them, so it never passes the
  handshake.
* 10: layer-streamed transfer: :class:`StreamRequest` (a decode rank gives a prefill rank its destination
  for a stream the proxy granted), answered by :class:`PushReply`.
* 11: :class:`StreamRequest` carries ``staging_addrs``: a decode rank whose pages differ from the prefill
  rank's (block size, HND/NHD) has the stream land in its staging, in the prefill rank's geometry.
* 12: :class:`StreamRequest` carries ``readers``: how many decode ranks send a destination for one stream to
  one prefill rank (a decode engine of a larger TP size); the prefill rank streams to each.
* 13: :class:`StreamRequest` carries ``group_blocks``: the destination of every KV cache group after the
  first (vLLM's hybrid KV cache manager: sliding-window and full-attention layers, attention and Mamba).
* 14: :class:`StreamRequest` carries ``head_slice``: a decode rank of another TP size over head-major pages
  (HND) has the stream WRITE its heads' slice of each page straight into its own pages, without staging.
* 15: verified KV: :class:`HoldQuery` may carry ``digest_rows`` (the rows a READ reads, per request) and
  :class:`HoldsReply` their ``digests``; :class:`PushRequest` and :class:`StreamRequest` carry ``kv_digest``
  (the digest of what the WRITEs read asked for, in the "pushed" notification).
* 16: a KV digest carries, after its :data:`DIGEST_BYTES`, the digests of up to :data:`DIGEST_BUCKETS` buckets of
  what it covers (:data:`BUCKET_BYTES` each): where a mismatch lies, named in the log by layer and block.
* 17: pipeline-parallel prefill: :class:`AgentInfo` carries ``pp_rank`` and ``pp_size`` and a request's ``to_rank``
  names a worker by its rank in its engine (``pp_rank * tp_size + tp_rank``, :attr:`AgentInfo.rank`);
  :class:`KVLayoutDesc` carries ``first_layer``, the first of the model's layers a stage's worker holds.
"""

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


Regions = Annotated[list[KVRegion], msgspec.Meta(max_length=MAX_REGIONS)]
"""Memory regions (at most :data:`MAX_REGIONS`)."""


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
        first_layer: the model's layer this cache's layer 0 is (0 but on a pipeline stage after the first,
            which holds layers ``[first_layer, first_layer + num_layers)``).
    """

    kv_layout: Word
    attn_layout: Word
    dtype: Word
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    block_len: int
    block_stride: int
    mem_type: Word
    regions: Regions
    total_num_kv_heads: int = 0
    is_mla: bool = False
    first_layer: Rank = 0


class AgentInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a peer needs to pull from one worker (one tp_rank of one pipeline stage).

    Attributes:
        engine_id: the vLLM engine id of the worker's engine.
        tp_rank: tensor-parallel rank of the worker.
        tp_size: tensor-parallel size of the engine.
        pp_rank: the worker's pipeline stage (0-based).
        pp_size: the engine's pipeline-parallel size (its stages; 1 without pipeline parallelism).
        agent_name: NIXL agent name (unique per process incarnation).
        agent_metadata: opaque NIXL agent metadata (``get_agent_metadata()``).
        metadata_digest: SHA-256 of ``agent_metadata``, checked before the
            metadata reaches NIXL.
        compat_hash: compatibility fingerprint (:mod:`handshake.fingerprints`):
            canonical JSON of what must match between peers (vLLM version,
            model, dtypes, KV cache groups, ...), compared field by field by
            the requester.
        layout: the KV memory description.
        staging: registered memory outside the KV cache that a peer may WRITE
            into (a decode rank's staging area, once it has registered one;
            empty before). With ``layout.regions``, every byte a push may
            write (:class:`PushRequest`).
    """

    engine_id: Id
    tp_rank: int
    tp_size: int
    agent_name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    metadata_digest: Annotated[bytes, msgspec.Meta(max_length=64)]
    compat_hash: CompatHash
    layout: KVLayoutDesc
    staging: Regions = msgspec.field(default_factory=list)
    pp_rank: Rank = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1, lt=1 << 16)] = 1

    @property
    def rank(self) -> int:
        """The worker's rank in its engine, ``pp_rank * tp_size + tp_rank``: what a request's ``to_rank`` names and
        what its side-channel port adds to the engine's base port."""
        return self.pp_rank * self.tp_size + self.tp_rank


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What every side-channel request carries besides its own fields.

    A server refuses a request for another destination (``"wrong_destination"``),
    one sent outside its freshness window (``"stale"``), and a nonce it has seen
    within that window (``"replayed"``), so a captured request cannot be sent
    again, nor to another engine or rank.

    Attributes:
        protocol_version: the sender's :data:`PROTOCOL_VERSION`.
        to_engine_id: the engine id of the worker the request is for.
        to_rank: the worker it is for, by its rank in its engine (:attr:`AgentInfo.rank`:
            ``pp_rank * tp_size + tp_rank``, its tensor-parallel rank without pipeline parallelism).
        sent_at: when it was sent (seconds since the Unix epoch, the sender's clock).
        nonce: 16..64 random bytes, echoed in the reply.
        requester_engine_id: the sending side's engine id (for logs; a
            :class:`PushRequest`'s ``agent`` must be this engine's own).
    """

    protocol_version: int
    to_engine_id: Id
    to_rank: Rank
    sent_at: float
    nonce: Nonce
    requester_engine_id: Id


class MetadataRequest(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="metadata_request"):
    """Ask a server for one worker's :class:`AgentInfo` (``to_rank``).

    Attributes:
        compat_hash: the asking side's compatibility fingerprint; the
            server logs the fields that differ from its own (the requester
            refuses the reply).
    """

    compat_hash: CompatHash


class MetadataReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="metadata_reply"):
    """Answer to :class:`MetadataRequest` (``nonce``: the request's)."""

    protocol_version: int
    info: AgentInfo
    nonce: EchoedNonce = b""


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    """A request the server refused.

    Its shape is kept across protocol versions (a new field only ever gets a
    default) so a refusal stays readable by a peer of another version.

    Attributes:
        code: machine-readable reason (:data:`RefusalCode`).
        field: the offending field (``""`` when not about one field; at most
            256 characters).
        message: human-readable explanation that names the fix (at most
            :data:`handshake.fields.MAX_TEXT_CHARS`).
        nonce: the refused request's nonce (empty when it did not decode).
    """

    protocol_version: int
    code: RefusalCode
    field: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    message: Text
    nonce: EchoedNonce = b""


MAX_HEARTBEAT_IDS = 4096
"""Most request ids one hold request (:class:`LeaseHeartbeat`, :class:`HoldQuery`, :class:`ReleaseHolds`) carries."""

RequestIds = Annotated[list[Id], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]
BlockIdLists = Annotated[list[Annotated[list[BlockId], msgspec.Meta(max_length=MAX_HOLD_BLOCK_IDS)]],
                         msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]
"""One block id list per request id; with :func:`_check_block_ids`, at most :data:`MAX_HOLD_BLOCK_IDS` in all."""
ExtendS = Annotated[float, msgspec.Meta(gt=0, le=3600)]

MAX_PUSH_ROWS = 1 << 18
"""Most descriptor rows one :class:`PushRequest` carries on each side (24 bytes each: 6 MiB)."""

ROW_BYTES = 24
"""Bytes of one descriptor row on the wire."""

Rows = Annotated[bytes, msgspec.Meta(max_length=MAX_PUSH_ROWS * ROW_BYTES)]
"""Descriptor rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``, little-endian, row-major (``n * 24`` bytes)."""

DIGEST_BYTES = 8
"""Bytes of the digest of everything a KV digest covers (:mod:`p2pkv.dataplane.digest`)."""

DIGEST_BUCKETS = 64
"""Most buckets a KV digest cuts what it covers into (consecutive rows or pieces), each digested apart."""

BUCKET_BYTES = 4
"""Bytes of one bucket's digest on the wire (it only locates a mismatch; :data:`DIGEST_BYTES` decide it)."""

KV_DIGEST_BYTES = DIGEST_BYTES + DIGEST_BUCKETS * BUCKET_BYTES
"""Largest KV digest: the whole's and every bucket's (264 bytes)."""

KVDigest = Annotated[bytes, msgspec.Meta(max_length=KV_DIGEST_BYTES)]
"""A KV digest (:data:`DIGEST_BYTES` bytes, then :data:`BUCKET_BYTES` per bucket), or ``b""``: none."""


def _check_block_ids(block_ids: list[list[int]]) -> None:
    """Refuse more than :data:`MAX_HOLD_BLOCK_IDS` block ids in all (run when decoding, after the fields).

    Raises:
        ValueError: too many (msgspec reports it as a validation error of the field ``block_ids``).
    """
    total = sum(len(ids) for ids in block_ids)
    if total > MAX_HOLD_BLOCK_IDS:
        raise ValueError(f"Expected at most {MAX_HOLD_BLOCK_IDS} block ids in all, got {total} - at `$.block_ids`")


class LeaseHeartbeat(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="lease_heartbeat"):
    """Ask a prefill worker to keep holding requests a decode engine still has queued.

    Attributes:
        request_ids: prefill-side request ids (``remote_request_id``) whose
            leases to extend; ids not held are ignored.
        extend_s: new lease length from now (seconds).
    """

    request_ids: RequestIds
    extend_s: ExtendS


class HoldQuery(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="hold_query"):
    """A pull's fence question: does the prefill worker hold these requests with these block ids?

    Held ones get their lease extended to ``extend_s`` from now.

    Attributes:
        request_ids: prefill-side request ids.
        block_ids: per request id, the prefill block ids the sender reads: a
            hold that does not contain them all is reported in ``not_held``.
        extend_s: new lease length from now (seconds).
        digest_rows: verified KV: empty, or per request id the prefill rank's rows the sender READs
            (:data:`Rows`; ``b""``: no digest asked for that id), each inside the held blocks; the reply's
            ``digests`` gives the digest of each (:func:`p2pkv.dataplane.digest.digest_rows`). At most
            :data:`MAX_PUSH_ROWS` rows in all.
    """

    request_ids: RequestIds
    block_ids: BlockIdLists
    extend_s: ExtendS
    digest_rows: Annotated[list[Rows], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(
        default_factory=list)

    def __post_init__(self) -> None:
        _check_block_ids(self.block_ids)
        _check_digest_rows(self.digest_rows)


def _check_digest_rows(digest_rows: list[bytes]) -> None:
    """Refuse rows that are not whole 24-byte rows, or more than :data:`MAX_PUSH_ROWS` of them in all.

    Raises:
        ValueError: as msgspec reports a validation error of the field ``digest_rows``.
    """
    if any(len(rows) % ROW_BYTES for rows in digest_rows):
        raise ValueError(f"Expected whole rows of {ROW_BYTES} bytes - at `$.digest_rows`")
    if sum(len(rows) for rows in digest_rows) > MAX_PUSH_ROWS * ROW_BYTES:
        raise ValueError(f"Expected at most {MAX_PUSH_ROWS} rows in all - at `$.digest_rows`")


class ReleaseHolds(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="release_holds"):
    """Tell a prefill worker that nobody will pull these requests: free their blocks now.

    Sent by a decode worker whose pull failed and by the proxy when the decode
    leg failed after the prefill succeeded. A hold is freed only when its block
    ids are exactly ``block_ids`` of its request id (so params naming another
    request's id with other blocks free nothing). A layer stream's id
    (:mod:`p2pkv.grant`) with no block ids declines that stream: the decode
    rank loads nothing of it. Answered with a
    :class:`HoldsReply` (``accepted``: ids held with those blocks, now released).

    Attributes:
        request_ids: prefill-side request ids.
        block_ids: per request id, every prefill block id of the hold (the
            ``remote_block_ids`` of its ``kv_transfer_params``, groups flattened).
    """

    request_ids: RequestIds
    block_ids: BlockIdLists

    def __post_init__(self) -> None:
        _check_block_ids(self.block_ids)


class HoldsReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="holds_reply"):
    """Answer to :class:`LeaseHeartbeat`, :class:`HoldQuery` and :class:`ReleaseHolds`.

    Attributes:
        accepted: how many ids were taken (extended, or released).
        expired: the asked-for ids whose lease already ran out on this
            worker (their blocks may have been reused): a pull of them that
            just finished must be treated as failed.
        not_held: ids released already (by notification or release), or whose
            hold does not contain the asked-for block ids.
        unknown: ids this worker has not (yet) been told to hold.
        request_ids: the request's ids, echoed.
        nonce: the request's nonce, echoed.
        digests: a :class:`HoldQuery` with ``digest_rows``: one per request id, the digest of its rows
            (:data:`KVDigest`), or ``b""`` (none asked, not held, or rows outside the held blocks).
    """

    protocol_version: int
    accepted: int
    expired: RequestIds = msgspec.field(default_factory=list)
    not_held: RequestIds = msgspec.field(default_factory=list)
    unknown: RequestIds = msgspec.field(default_factory=list)
    request_ids: RequestIds = msgspec.field(default_factory=list)
    nonce: EchoedNonce = b""
    digests: Annotated[list[KVDigest], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = msgspec.field(
        default_factory=list)


HoldRequest = LeaseHeartbeat | HoldQuery | ReleaseHolds
"""The requests a prefill worker's holds answer."""

PushId = Annotated[bytes, msgspec.Meta(min_length=16, max_length=32)]
"""Random bytes naming one WRITE in its notification (:class:`p2pkv.notification.PushedNotification`)."""

WindowS = Annotated[float, msgspec.Meta(gt=0, le=3600)]

PushStatus = Literal["accepted", "expired", "not_held", "unknown", "busy", "refused"]
"""What a prefill worker did with a :class:`PushRequest`; a closed set."""


class PushRequest(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="push_request"):
    """Ask a prefill rank to WRITE a held request's blocks into the sender's memory (push mode).

    The prefill rank checks that it holds ``request_id`` with exactly
    ``block_ids`` and that every ``source_rows`` byte lies in those blocks,
    keeps the hold (no release, notification or lease expiry ends it) until
    the WRITE has ended, and posts a NIXL WRITE of ``source_rows`` into
    ``target_rows`` of the agent in ``agent`` whose notification
    (:class:`p2pkv.notification.PushedNotification`) reaches the sender after the bytes.

    ``agent`` must be the sender's own: its ``engine_id`` is
    ``requester_engine_id`` and its ``agent_name`` the name p2pkv gives that
    engine's rank ``agent.tp_rank`` (``p2pkv-<engine id>-tp<rank>-<12 hex>``,
    also the name inside its NIXL metadata), so one engine's request never
    loads, replaces or writes into another engine's agent.

    Attributes:
        request_id: the prefill-side request id (``remote_request_id``).
        block_ids: every prefill block id of the hold (``remote_block_ids``, groups flattened).
        push_id: names this WRITE in its notification.
        agent: the sender rank's :class:`AgentInfo` (NIXL metadata checked
            against its digest before NIXL loads it; its layout).
        source_rows: the prefill rank's bytes to WRITE (:data:`Rows`).
        target_rows: where they land in the sender's registered memory (same
            lengths row by row), each row inside one of the regions ``agent``
            declares (``layout.regions`` or ``staging``, same device id).
        window_s: seconds from receipt within which the WRITE may start; past
            it the sender has given up (its blocks may be reused), so a WRITE
            not yet posted is dropped and one in flight cancelled.
        kv_digest: verified KV: the "pushed" notification carries the digest of ``source_rows`` as the WRITE
            reads them (:func:`p2pkv.dataplane.digest.digest_rows`); a prefill rank that cannot digest its
            KV memory refuses the request.
    """

    request_id: Id
    block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=MAX_HOLD_BLOCK_IDS)]
    push_id: PushId
    agent: AgentInfo
    source_rows: Rows
    target_rows: Rows
    window_s: WindowS
    kv_digest: bool = False


class PushReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="push_reply"):
    """Answer to :class:`PushRequest`.

    Attributes:
        status: ``accepted`` (the WRITE is queued; its notification follows),
            ``expired`` / ``not_held`` / ``unknown`` (as in :class:`HoldsReply`:
            nothing will be written), ``busy`` (this prefill rank's queue for
            the sender is full), ``refused`` (bad rows or agent; ``message`` says which).
        message: why, when not accepted.
        nonce: the request's nonce, echoed.
    """

    protocol_version: int
    status: PushStatus
    message: Text = ""
    nonce: EchoedNonce = b""


MAX_GRANT_CHARS = 160
"""Longest stream grant (characters; :mod:`p2pkv.grant` makes them of 113)."""

Grant = Annotated[str, msgspec.Meta(max_length=MAX_GRANT_CHARS)]

Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
"""A prompt digest: 32 hex digits (:func:`p2pkv.params.prompt_digest`)."""

Address = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
"""A process virtual address or device pointer (bytes; below 2**62, as descriptor rows)."""


class GroupBlocks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode rank's blocks of one KV cache group for a layer stream (:attr:`StreamRequest.group_blocks`):
    ``block_ids`` from index ``first_block`` of the group's block list on (blocks before it the decode engine has
    cached, or, behind a sliding window, does not keep)."""

    first_block: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=MAX_GROUP_BLOCK_IDS)]


class HeadSlice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Heads ``prefill_head_start ..`` of each of a prefill rank's pages, ``num_heads`` of them, written at head
    ``decode_head_start`` of the decode rank's page of the same block, layer and K/V (head-major pages: a slice of
    heads is one contiguous run of bytes; :attr:`StreamRequest.head_slice`). Heads are counted within each rank's
    own heads."""

    prefill_head_start: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    decode_head_start: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class StreamRequest(Request, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="stream_request"):
    """Give a prefill rank this decode rank's destination for a layer-streamed request (docs/streaming.md).

    Sent as soon as the decode engine has allocated the prompt's blocks,
    before the prefill engine has answered (it may not have seen the request
    yet). The prefill rank checks the grant (it names this prefill engine and
    the requester's engine, or any decode engine; unexpired), that ``agent``
    is the requester's own (as a :class:`PushRequest`'s), that its pages are
    this rank's (same block size, page order and heads: a stream moves pages
    as they are) and that every block id lies in its cache; it takes one
    destination per ``stream_id``. A decode rank whose pages differ sends
    ``staging_addrs`` instead: the stream lands in its declared staging, in
    the prefill rank's own geometry, and the decode rank fixes it up into its
    blocks after the notification. When several ranks of the requesting
    engine read this prefill rank (a larger TP size), each sends its own
    destination, all saying how many they are (``readers``): the prefill rank
    streams to each, and keeps the request's blocks until every one has
    ended. Once its request's layers are computed
    it WRITEs them into ``block_ids`` and sends the "pushed" notification
    naming ``push_id`` (:class:`p2pkv.notification.PushedNotification`),
    ``ok=False`` with the reason when the stream stops (the prompt's tokens
    differ: ``prompt_digest``; the request was aborted or preempted).

    Attributes:
        grant: the proxy's stream grant (:func:`p2pkv.grant.make_stream_grant`), as both legs carry it.
        block_ids: the decode rank's block ids for prompt blocks ``first_block ..``.
        first_block: prompt block index of ``block_ids[0]`` (blocks before it the decode engine has cached).
        num_tokens: prompt tokens the decode engine loads (tokens, from token 0).
        prompt_digest: :func:`p2pkv.params.prompt_digest` of those ``num_tokens`` token ids.
        push_id: names the stream in its notification.
        agent: the sender rank's :class:`AgentInfo`.
        window_s: seconds from receipt within which the stream must end; past it the sender has given up.
        staging_addrs: empty: ``block_ids`` are the decode rank's own blocks. Else one address per region
            of the prefill rank's layout (in its order): block ``i`` of region ``r`` lands at
            ``staging_addrs[r] + i * block_len`` (the prefill rank's ``block_len``), inside a staging
            region ``agent`` declares; ``block_ids`` then name staging blocks, each below ``len(block_ids)``.
        readers: how many ranks of the requesting engine send a destination for this stream to this prefill
            rank (1 ..); each rank's destination is taken once.
        group_blocks: for a model with several KV cache groups (vLLM's hybrid KV cache manager), the
            destination of groups 1 .. in group order (``block_ids`` and ``first_block`` are group 0's);
            empty for one group (with ``staging_addrs``, staging blocks, each group's after the previous's).
        head_slice: None: the stream moves this rank's pages whole. Else (head-major pages of the same block
            size and bytes per head on both ranks, TP sizes differing) each of this rank's pages gives the
            slice of heads it names, WRITTEN into that slice of the decode rank's own page (no staging).
        kv_digest: verified KV: the final "pushed" notification carries the digest of what the stream's WRITEs
            read (:func:`p2pkv.dataplane.digest.combine`); a prefill rank that cannot digest refuses it.
    """

    grant: Grant
    block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=MAX_HOLD_BLOCK_IDS)]
    first_block: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)]
    prompt_digest: Digest
    push_id: PushId
    agent: AgentInfo
    window_s: WindowS
    staging_addrs: Annotated[list[Address], msgspec.Meta(max_length=MAX_REGIONS)] = msgspec.field(
        default_factory=list)
    readers: Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)] = 1
    group_blocks: Annotated[list[GroupBlocks], msgspec.Meta(max_length=MAX_KV_GROUPS - 1)] = msgspec.field(
        default_factory=list)
    head_slice: HeadSlice | None = None
    kv_digest: bool = False


Message = (MetadataRequest | MetadataReply | ErrorReply | LeaseHeartbeat | HoldQuery | ReleaseHolds | HoldsReply
           | PushRequest | PushReply | StreamRequest)
"""Every message that travels on the side channel."""
