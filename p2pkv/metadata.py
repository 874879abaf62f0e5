"""What the scheduler side tells the worker side each step.

Plain dataclasses, importable without vLLM (the worker side and its tests
stay light); :mod:`p2pkv.connector` hands vLLM a subclass that is also a
``KVConnectorMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handshake import GroupBlocks
from p2pkv.params import RemotePrefill


@dataclass(frozen=True)
class LoadSpec:
    """One transfer (read or pushed) a decode worker must run: a request's KV load.

    Attributes:
        request_id: the local (decode engine) request id.
        local_block_ids: local blocks to fill, in token order.
        remote_block_ids: the prefill engine's blocks to read, paired with
            ``local_block_ids`` (same length).
        remote: where to pull from.
        report: report the request in ``finished_recving`` when done (False
            for notify-only pulls: nothing to load, or the request is gone).
        first_token: prompt position (tokens) of the first slot of
            ``local_block_ids[0]`` (a multiple of the local block size; > 0
            when the decode engine had a prefix cached).
        num_tokens: prompt tokens whose KV exists on the prefill side; the
            pull moves tokens ``[first_token, num_tokens)``.
            ``remote_block_ids`` then covers the prompt from token 0 in the
            prefill engine's block size. -1: the two id lists pair up block
            for block (same block size on both sides).
        arrival: when the request reached the decode engine (vLLM's
            ``arrival_time``, ``time.time()`` seconds; 0: unknown).
        scheduled: when the scheduler allocated its blocks (``time.time()`` seconds; 0: unknown).
        traceparent: the W3C trace context of the decode leg the pull's spans
            belong under (``kv_transfer_params.traceparent``; ``""``: none, or
            tracing off).
        stream_grant: a layer-streamed load's grant (:mod:`p2pkv.grant`): the prefill rank WRITEs each layer
            into ``local_block_ids`` as it is computed; ``remote`` then names the stream (``request_id`` its
            ``stream_id``, no block ids) and carries this prompt's digest of the ``num_tokens`` it loads.
            "" for pull and push.
        stream_groups: a layer-streamed load of a model with several KV cache groups: each group's local
            blocks, ``first_block`` counted in that group's block list (``local_block_ids`` is then their
            concatenation, as a pull's of such a model is); empty for one group.
    """

    request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    remote: RemotePrefill
    report: bool = True
    first_token: int = 0
    num_tokens: int = -1
    arrival: float = 0.0
    scheduled: float = 0.0
    traceparent: str = ""
    stream_grant: str = ""
    stream_groups: tuple[GroupBlocks, ...] = ()

    @property
    def way(self) -> str:
        """The way (:data:`p2pkv.ways.WAYS`) its load fixes for every part: ``"stream"`` for a streamed load (its
        grant names the stream), ``""`` when each prefill rank's part moves the way the decode rank chooses for it."""
        return "stream" if self.stream_grant else ""


@dataclass(frozen=True)
class StreamChunk:
    """One step's share of a layer-streamed prefill (prefill side): the blocks its layers compute this step.

    Attributes:
        request_id: the prefill engine's request id.
        stream_id: the grant's stream id (the decode rank names the stream by it).
        first_block: prompt block index of ``block_ids[0]``.
        block_ids: this engine's block ids the step writes (the prompt's blocks from ``first_block``; the
            first chunk starts at block 0, so a prefix this engine had cached goes with it).
        num_tokens: prompt tokens computed once this step ends (tokens, from token 0).
        last: the step computes the prompt's last token: after its last layer the stream finishes.
        prompt_digest: :func:`p2pkv.prompt_digest.prompt_digest` of the first ``loaded_tokens`` prompt tokens
            (set on the request's first chunk, "" after).
        loaded_tokens: prompt tokens a decode engine streaming it loads (all but the last; first chunk only).
        group_blocks: a model with several KV cache groups: the blocks of groups 1 .. the step writes
            (``first_block`` and ``block_ids`` are group 0's). A state group's (Mamba) come in the last chunk only,
            all of them: its layers call no ``save_kv_layer``, and only the last step's state is the prompt's.
    """

    request_id: str
    stream_id: str
    first_block: int
    block_ids: tuple[int, ...]
    num_tokens: int
    last: bool
    prompt_digest: str = ""
    loaded_tokens: int = 0
    group_blocks: tuple[GroupBlocks, ...] = ()


@dataclass
class P2pKvMetadata:
    """Per-step connector metadata.

    Attributes:
        loads: the transfers to start (decode side), read or pushed.
        send_leases: prefill request id → ``time.monotonic()`` deadline (seconds)
            after which its held blocks are released even without a
            notification (prefill side).
        send_blocks: prefill request id → the block ids it holds (a pull of
            other block ids is refused).
        failed: decode request id → local block ids of a pull the scheduler
            could not set up: reported finished, its blocks as load errors.
        idle: the step scheduled no tokens (vLLM steps only to poll
            transfers); the workers may wait a little for one to finish
            (:data:`p2pkv.worker.IDLE_WAIT_S`).
        send_traces: prefill request id → (the W3C trace context of its
            prefill leg, when its hold began in nanoseconds since the epoch),
            for requests whose hold is traced (empty with tracing off).
        streams: this step's chunks of layer-streamed prefills (prefill side).
        stream_aborts: prefill request id → why its stream stops (its request aborted).
        stream_restarts: prefill request ids of streamed requests preempted this step (prefill side): vLLM freed
            their blocks, so their streams drop the layers not WRITTEN yet, and get them again when resumed.
        ended_streams: decode request ids of layer-streamed loads whose request has finished (decode side):
            a stream still under way is given up (its request was aborted while it ran).
        stream_admits: prefill request id → (its grant's stream id, when the grant expires: ``time.time()``
            seconds) of the streamed requests that arrived since the last step (prefill side): the workers bind
            the stream id to that request (never to another), wait for its destinations as long as the decode
            ranks do, and end a stream that has had no destination by its grant's expiry.
        stream_refusals: stream id → why its request is not streamed (prefill side: past ``max_held_fraction``,
            say): a destination naming it is refused at once with that reason, not left waiting.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    send_leases: dict[str, float] = field(default_factory=dict)
    send_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    idle: bool = False
    send_traces: dict[str, tuple[str, int]] = field(default_factory=dict)
    streams: list[StreamChunk] = field(default_factory=list)
    stream_aborts: dict[str, str] = field(default_factory=dict)
    stream_restarts: list[str] = field(default_factory=list)
    ended_streams: list[str] = field(default_factory=list)
    stream_admits: dict[str, tuple[str, float]] = field(default_factory=dict)
    stream_refusals: dict[str, str] = field(default_factory=dict)
